"""lychee_compile(model, head_map, config): the one entry point.

Order of work, so that bad input never leaves a half-changed model:
  1. validate config, model and head map (pure checks);
  2. probe: one tiny generate() through a detect-only backend, run on a copy of nothing -- the model's own weights,
     its state restored afterwards -- which finds every attention site and refuses unsupported forms;
  3. only then change the model: a static cache and a CompileConfig with our backend in its generation config, so a
     plain model.generate(...) compiles the decode step with the rewrite (prefill stays eager and dense); with
     fuse_linears, the probe's sibling-linear weights laid out in one buffer each (linear_groups.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from .backend import make_backend
from .config import LycheeConfig
from .errors import HeadMapError, LycheeCompileError, LycheeConfigError
from .dynamic_cache import fresh_call, install_dynamic_cache
from .head_map import HeadMap
from .linear_groups import fuse_weights
from .generation_modes import unsupported_mode
from .masks import check_padding_mask
from .rectify import install_rectification
from .state_buffers import install_state, write_kinds
from .passes import Counters, PassContext, run_passes
from .passes.fuse_linears import sibling_groups

_STATE_ATTR = "_lychee_state"
log = logging.getLogger("lychee_compile")


class LycheeState:
    """What lychee_compile attaches to a model: its config, effective head map, counters and backend."""

    def __init__(self, config, head_map, retrieval, global_layers, counters, backend, snapshots):
        self.config, self.head_map, self.retrieval = config, head_map, retrieval
        self.global_layers, self.counters, self.backend = global_layers, counters, backend
        self.snapshots = snapshots     # graph_snapshot() text of each rewritten decode graph


def lychee_compile(model, head_map, config: LycheeConfig | None = None):
    config = LycheeConfig() if config is None else config
    if not isinstance(config, LycheeConfig):
        raise LycheeConfigError(f"config must be a LycheeConfig, got {type(config).__name__}.")
    _check_model(model)
    if config.cuda_graphs and model.device.type != "cuda":
        raise LycheeConfigError(f"cuda_graphs=True needs the model on a CUDA device, it is on {model.device}. Move "
                                "it with model.to('cuda') first, or leave cuda_graphs off.")
    if isinstance(head_map, (str, os.PathLike)):
        head_map = HeadMap.load(head_map)
    if not isinstance(head_map, HeadMap):
        raise HeadMapError(f"head_map must be a HeadMap or a path to one, got {type(head_map).__name__}.")
    head_map.validate_for(model, config.strict)
    asked = config.cuda_graphs
    config, graphs = config.resolved_for(model.device)
    # a CUDA model decoding without CUDA graphs is the slow path: a warning where that was not asked for
    slow = model.device.type == "cuda" and not config.cuda_graphs and asked is None
    (log.warning if slow else log.info)("lychee_compile: %s", graphs)

    global_layers, linear_groups = probe_global_layers(model, config)
    if config.rectify_every and len(global_layers) != model.config.num_hidden_layers:
        raise LycheeConfigError("rectify_every needs every layer to be global: sliding-window layers keep ring "
                                "buffers whose slots cannot be re-encoded in place. Use rectify_every=0 here.")
    retrieval = head_map.effective(global_layers, config.first_layer_retrieval)
    counters = Counters()
    snapshots: list[str] = []
    def backend_for(cfg):
        return make_backend(model, cfg, retrieval, head_map.streaming, counters, head_map.digest(), snapshots)
    backend = backend_for(config)
    _install(model, backend)
    if config.fuse_linears:
        fuse_weights(model, linear_groups)
    if config.rectify_every:
        install_rectification(model, config.rectify_every)
    before_decode = install_state(model, config, retrieval[global_layers], global_layers)
    # last: its compiled call must include the forward wrappers. A DynamicCache grows every step: its decode steps
    # compile without CUDA graphs (a graph would be recorded for every length)
    dynamic_backend = backend_for(dataclasses.replace(config, cuda_graphs=False)) if config.cuda_graphs else backend
    install_dynamic_cache(model, dynamic_backend, config, before_decode)
    _guard_generate(model, counters, config.strict)
    setattr(model, _STATE_ATTR, LycheeState(config, head_map, retrieval, global_layers, counters, backend,
                                            snapshots))
    return model


def set_head_map(model, head_map) -> None:
    """Swap the head map of a compiled model in place: the retrieval/sparse kinds are runtime data of the rewritten
    ops (the `_lychee_kinds` buffer, ops/state.py), so nothing recompiles and a captured CUDA graph replays with the
    new kinds. Validated like lychee_compile's map; on error the model keeps its old map."""
    state = state_of(model)
    if isinstance(head_map, (str, os.PathLike)):
        head_map = HeadMap.load(head_map)
    if not isinstance(head_map, HeadMap):
        raise HeadMapError(f"head_map must be a HeadMap or a path to one, got {type(head_map).__name__}.")
    head_map.validate_for(model, state.config.strict)
    if not torch.equal(head_map.streaming, state.head_map.streaming):
        raise HeadMapError("set_head_map can change retrieval/sparse kinds only; streaming heads change the graph "
                           "(they inherit nothing). Compile a fresh model for a different streaming map.")
    retrieval = head_map.effective(state.global_layers, state.config.first_layer_retrieval)
    write_kinds(model, retrieval[state.global_layers])
    state.head_map, state.retrieval = head_map, retrieval


def state_of(model) -> LycheeState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise LycheeCompileError("this model has not been through lychee_compile().")
    return state


def _check_model(model) -> None:
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None or not hasattr(model, "generate"):
        raise LycheeCompileError(f"lychee_compile takes a transformers causal LM (a PreTrainedModel with generate()), "
                                 f"got {type(model).__name__}.")
    if getattr(model, _STATE_ATTR, None) is not None:
        raise LycheeCompileError("lychee_compile was already applied to this model; call it once per model "
                                 "(load a fresh model to change the head map or config).")
    if getattr(config, "is_encoder_decoder", False):
        raise LycheeCompileError(f"{type(model).__name__} is an encoder-decoder model; lychee_compile rewrites "
                                 "decoder-only self-attention.")
    if getattr(config, "output_attentions", False):
        raise LycheeCompileError("model.config.output_attentions=True: lychee ops do not materialize attention "
                                 "weights. Set it to False.")
    if model.training:
        raise LycheeCompileError("the model is in training mode (dropout active); call model.eval() first.")
    param = next(model.parameters(), None)
    if param is not None and (param.device.type == "meta" or not param.dtype.is_floating_point):
        raise LycheeCompileError(f"the model's weights are {param.dtype} on device '{param.device.type}': "
                                 "lychee_compile needs materialized floating-point weights (fp32/bf16/fp16) on "
                                 "CPU or CUDA. Load the weights (or de-quantize) first.")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "sdpa", "eager"):
        raise LycheeCompileError(f"attention implementation {impl!r} is not captured by lychee_compile; load the "
                                 "model with attn_implementation='sdpa' or 'eager'.")


def probe_global_layers(model, config: LycheeConfig) -> tuple[list[int], list]:
    """Trace one decode step through the detect/check passes only; returns the global layers and the decode graph's
    sibling-linear groups (passes/fuse_linears.py). Raises on problems."""
    counters = Counters()
    found: list[PassContext] = []
    groups: list = []
    params = {id(p): p for p in model.parameters()}

    def probe_backend(gm, example_inputs, **kwargs):
        ctx = run_passes(PassContext(gm, model, config, None, counters, rewrite=False))
        found.append(ctx)
        if ctx.is_decode and not groups:
            groups.extend(sibling_groups(gm, example_inputs, params))
        return gm.forward

    from transformers import CompileConfig
    compile_config = CompileConfig(backend=probe_backend, fullgraph=True, mode=None)
    compile_config._compile_all_devices = True
    ids = torch.ones(1, 2, dtype=torch.long, device=model.device)
    saved = dict(model.__dict__)
    try:
        # generate() compiles through get_compiled_call; give it a call of its own so the probe's Dynamo cache
        # entry lands on a fresh code object instead of HF's shared wrapper (whose recompile limit users need).
        model.get_compiled_call = lambda _config: torch.compile(fresh_call(model, "lychee_probe_call"),
                                                                backend=probe_backend,
                                                                fullgraph=True)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                           do_sample=False, cache_implementation="static", compile_config=compile_config,
                           pad_token_id=0, eos_token_id=None)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        raise _unwrap(exc) from None
    finally:
        for key in set(model.__dict__) - set(saved):
            del model.__dict__[key]
        model.__dict__.update(saved)
    decode = [c for c in found if c.is_decode]
    if not decode:
        raise LycheeCompileError("the probe generate() never compiled a decode step, so no attention could be "
                                 "checked; is this a transformers causal LM that supports a static cache?")
    return sorted(s.layer_idx for s in decode[0].sites if s.kind == "global"), groups


def _unwrap(exc: BaseException) -> BaseException:
    inner = exc
    while inner is not None and not isinstance(inner, (LycheeCompileError, HeadMapError, LycheeConfigError)):
        inner = inner.__cause__ or getattr(inner, "inner_exception", None)
    return inner if inner is not None else exc


def _guard_generate(model, counters, strict: bool) -> None:
    """Wrap the instance's generate() so a call whose decode steps bypassed the rewrite (a dynamic cache, compile
    disabled, a generation mode HF does not compile) never passes silently as lychee output; a padding mask the
    rewritten step cannot read (masks.py) and, in strict mode, a generation mode that would not run it
    (generation_modes.py) are refused before any work."""
    inner = model.generate

    def generate(*args, **kwargs):
        check_padding_mask(kwargs.get("attention_mask"))
        refused = unsupported_mode(model, args, kwargs)
        if refused is not None:
            if strict:
                raise LycheeCompileError(refused)
            log.warning("lychee_compile: %s", refused)
        before = counters.decode_calls
        out = inner(*args, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        prompt = args[0] if args else kwargs.get("input_ids")
        new_tokens = (sequences.shape[-1] - prompt.shape[-1]) if (
            isinstance(sequences, torch.Tensor) and isinstance(prompt, torch.Tensor)) else 0
        if new_tokens > 1 and counters.decode_calls == before:
            counters.generate_calls_dense += 1
            message = ("generate() produced its tokens without the lychee decode step (it ran dense): transformers "
                       "did not compile the decode step -- use the static cache lychee_compile set or a "
                       "DynamicCache (other cache kinds, use_cache=False or disabled compilation bypass it).")
            if strict:
                raise LycheeCompileError(message)
            log.warning("lychee_compile: %s", message)
        return out

    generate.__doc__ = inner.__doc__
    model.generate = generate


def _install(model, backend) -> None:
    from transformers import CompileConfig
    # dynamic=None (HF's default): a second compile may make sizes symbolic, which the passes and ops handle;
    # dynamic=False would recompile at every step on caches that guard on a Python int (HF's sliding layers).
    compile_config = CompileConfig(backend=backend, fullgraph=True, mode=None, dynamic=None)
    # HF auto-compiles generate() only on accelerators unless this flag is set; we want the rewrite everywhere.
    compile_config._compile_all_devices = True
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = compile_config
    _own_compiled_call(model)


def _own_compiled_call(model) -> None:
    """generate() compiles its decode step through model.get_compiled_call(compile_config). transformers' own
    compiles `self.__call__`: the same code object (nn.Module's call) for every model in the process, so to Dynamo a
    second model is a new call of the first one's frame, and its automatic dynamic shapes makes every constant that
    differs (the attention scale, head counts) a symbolic value -- which no pass can rewrite. Ours compiles a call of
    this model's own (fresh_call), rebuilt when the compile config changes, as transformers' is."""
    call = fresh_call(model, "lychee_decode_step")
    made: dict = {}

    def get_compiled_call(compile_config):
        compile_config = compile_config or model.generation_config.compile_config or model._default_compile_config()
        if "call" not in made or made["config"] != compile_config:
            made.update(config=compile_config, call=torch.compile(call, **compile_config.to_dict()))
        return made["call"]

    model.get_compiled_call = get_compiled_call
