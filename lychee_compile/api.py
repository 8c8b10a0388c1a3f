"""lychee_compile(model, head_map, config): the one entry point.

Order of work, so that bad input never leaves a half-changed model:
  1. validate config, model and head map (pure checks); under tensor parallelism (tensor_parallel.py) steps 1-2
     and the KV-head check after the probe run on every rank, and one rank's error is raised on all of them;
  2. probe: one tiny generate() through a detect-only backend, run on a copy of nothing -- the model's own weights,
     its state restored afterwards -- which finds every attention site and refuses unsupported forms;
  3. only then change the model: a static cache and a CompileConfig with our backend in its generation config, so a
     plain model.generate(...) compiles the decode step with the rewrite (prefill stays eager and dense); with
     fuse_linears, the probe's sibling-linear weights laid out in one buffer each (linear_groups.py). Every change
     to the model is made by install.py, in one place and order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch

from .backend import make_backend
from .config import LycheeConfig
from .errors import HeadMapError, LycheeCompileError, LycheeConfigError, lychee_error_inside
from .fresh_call import fresh_call
from .head_map import HeadMap
from .install import STATE_ATTR, install
from .lowering.kernel_path import refuse_probe_sites
from .rectify import reencode_mode
from .state_buffers import write_kinds
from .tensor_parallel import agreed, kv_shard, local_linear_shards, process_group, resolved_all_reduce
from .passes import Counters, PassContext, run_passes
from .passes.fuse_linears import sibling_groups

log = logging.getLogger("lychee_compile")


class LycheeState:
    """What lychee_compile attaches to a model: its config, effective head map, counters and backend."""

    def __init__(self, config, head_map, retrieval, global_layers, counters, backend, snapshots):
        self.config, self.head_map, self.retrieval = config, head_map, retrieval
        self.global_layers, self.counters, self.backend = global_layers, counters, backend
        self.snapshots = snapshots     # graph_snapshot() text of each rewritten decode graph and re-encode graph
        self.budget_from_map = False   # config.budget was None: resolved from the head map (set_head_map checks it)
        # tensor parallelism (tensor_parallel.py): this rank's KV heads; None in one process. head_map stays global,
        # retrieval holds this rank's columns of the effective map (what its ops use)
        self.shard = None


def lychee_compile(model, head_map, config: LycheeConfig | None = None):
    # Tensor parallel: every rank checks, and one rank's error is raised on all of them (tensor_parallel.agreed)
    group = process_group(model)
    config, head_map, budget_from_map, budget = agreed(group, lambda: _validated(model, head_map, config),
                                                       same=lambda r: (r[0].cache_key(), r[1].digest()))
    info = log.info if _is_lead(group) else log.debug      # one summary, from rank 0
    info("lychee_compile: %s", budget)
    asked, asked_one_shot = config.cuda_graphs, config.symm_mem_all_reduce
    config, graphs = config.resolved_for(model.device)
    # a CUDA model decoding without CUDA graphs is the slow path: a warning where that was not asked for
    slow = model.device.type == "cuda" and not config.cuda_graphs and asked is None
    (log.warning if slow else info)("lychee_compile: %s", graphs)

    global_layers, linear_groups, sites = agreed(group, lambda: probe_global_layers(model, config))
    agreed(group, lambda: refuse_probe_sites(sites, config))
    shard = agreed(group, lambda: kv_shard(model, sites, head_map.shape[1], group, config.strict))
    if config.rectify_every and len(global_layers) != model.config.num_hidden_layers:
        raise LycheeConfigError("rectify_every needs every layer to be global: sliding-window layers keep ring "
                                "buffers whose slots cannot be re-encoded in place. Use rectify_every=0 here.")
    retrieval = head_map.effective(global_layers, config.first_layer_retrieval)
    streaming = head_map.streaming
    # not inside `agreed`: it agrees step by step itself (its rendezvous is a collective)
    config, all_reduce, all_reduce_failure, all_reduce_buffer = resolved_all_reduce(config, shard, model.device)
    if shard is not None or asked_one_shot:
        info("lychee_compile: %s%s", f"{shard.describe()}; " if shard is not None else "", all_reduce)
    if shard is not None:
        retrieval, streaming = shard.columns(retrieval), shard.columns(streaming)
    counters = Counters()
    if all_reduce_failure:
        counters.reasons.append(all_reduce_failure)
    snapshots: list[str] = []

    def backend_for(cfg, reencode=False):
        return make_backend(model, cfg, retrieval, streaming, counters, head_map.digest(), snapshots, reencode)
    backend = backend_for(config)
    # A DynamicCache grows every step: its decode steps compile without CUDA graphs (a graph for every length)
    graphless = dataclasses.replace(config, cuda_graphs=False)
    dynamic_backend = backend_for(graphless) if config.cuda_graphs else backend
    # rectification's re-encode (once every R steps): its own backend, with CUDA graphs as the decode step has them
    # (fixed shapes, the static cache's fixed addresses; without them its ~2,000 launches bind it to the host);
    # None: it runs eagerly
    reencode_backend = (backend_for(config, reencode=True)
                        if config.rectify_every and reencode_mode(config, counters) else None)   # strict: may raise
    install(model, config, backend, dynamic_backend, reencode_backend, linear_groups, retrieval[global_layers],
            global_layers, counters, all_reduce_buffer)
    setattr(model, STATE_ATTR, LycheeState(config, head_map, retrieval, global_layers, counters, backend, snapshots))
    state_of(model).budget_from_map = budget_from_map
    state_of(model).shard = shard
    return model


def _validated(model, head_map, config):
    """(config, head map, whether the budget came from the map, the budget's log line) after the pure checks of
    config, model and head map."""
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
    budget_from_map = config.budget is None
    config, budget = config.with_budget_for(head_map)
    return config, head_map, budget_from_map, budget


def set_head_map(model, head_map) -> None:
    """Swap the head map of a compiled model in place: the retrieval/sparse kinds are runtime data of the rewritten
    ops (the `_lychee_kinds` buffer, ops/state.py), so nothing recompiles and a captured CUDA graph replays with the
    new kinds. Validated like lychee_compile's map; on error the model keeps its old map."""
    state = state_of(model)
    group = None if state.shard is None else state.shard.group
    head_map = agreed(group, lambda: _validated_swap(model, state, head_map), same=HeadMap.digest)
    retrieval = head_map.effective(state.global_layers, state.config.first_layer_retrieval)
    if state.shard is not None:
        retrieval = state.shard.columns(retrieval)
    write_kinds(model, retrieval[state.global_layers])
    state.head_map, state.retrieval = head_map, retrieval


def _validated_swap(model, state, head_map) -> HeadMap:
    if isinstance(head_map, (str, os.PathLike)):
        head_map = HeadMap.load(head_map)
    if not isinstance(head_map, HeadMap):
        raise HeadMapError(f"head_map must be a HeadMap or a path to one, got {type(head_map).__name__}.")
    head_map.validate_for(model, state.config.strict)
    if not torch.equal(head_map.streaming, state.head_map.streaming):
        raise HeadMapError("set_head_map can change retrieval/sparse kinds only; streaming heads change the graph "
                           "(they inherit nothing). Compile a fresh model for a different streaming map.")
    _check_budget_for(state, head_map)
    return head_map


def _check_budget_for(state, head_map) -> None:
    """The budget is compiled into the graph: a calibrated map recommending another budget than the one the model
    was compiled with (where the config left it to the map) would run below its calibration -- refused in strict
    mode, logged otherwise."""
    recommended = head_map.recommended_budget
    if not state.budget_from_map or recommended is None or recommended == state.config.budget:
        return
    message = (f"the new head map was calibrated for budget {recommended} tokens, but this model was compiled with "
               f"{state.config.budget} (from its first map): the budget is compiled in. Compile a fresh model with "
               "this map, or pass LycheeConfig(budget=...) to choose it yourself.")
    if state.config.strict:
        raise HeadMapError(message)
    log.warning("lychee_compile: %s", message)


def state_of(model) -> LycheeState:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise LycheeCompileError("this model has not been through lychee_compile().")
    return state


def _check_model(model) -> None:
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None or not hasattr(model, "generate"):
        raise LycheeCompileError(f"lychee_compile takes a transformers causal LM (a PreTrainedModel with generate()), "
                                 f"got {type(model).__name__}.")
    if getattr(model, STATE_ATTR, None) is not None:
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


def probe_global_layers(model, config: LycheeConfig) -> tuple[list[int], list, list]:
    """Trace one decode step through the detect/check passes only; returns the global layers, the decode graph's
    sibling-linear groups (passes/fuse_linears.py) and its global attention sites. Raises on problems."""
    counters = Counters()
    found: list[PassContext] = []
    groups: list = []
    params = {id(p): p for p in model.parameters()}
    # tensor parallel: the probe sees the Linear weights as the decode graphs will, as local shards (a group's
    # members are then named by the model's DTensor parameters)
    shards = local_linear_shards(model)
    if shards is not None:
        params.update(shards.owners())

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
        with torch.no_grad(), (shards or contextlib.nullcontext()):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                           do_sample=False, cache_implementation="static", compile_config=compile_config,
                           pad_token_id=0, eos_token_id=None)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        raise lychee_error_inside(exc) from None
    finally:
        for key in set(model.__dict__) - set(saved):
            del model.__dict__[key]
        model.__dict__.update(saved)
    decode = [c for c in found if c.is_decode]
    if not decode:
        raise LycheeCompileError("the probe generate() never compiled a decode step, so no attention could be "
                                 "checked; is this a transformers causal LM that supports a static cache?")
    sites = [s for s in decode[0].sites if s.kind == "global"]
    return sorted(s.layer_idx for s in sites), groups, sites


def _is_lead(group) -> bool:
    """Whether this process logs lychee_compile's summary: rank 0 of a tensor-parallel group, or the only one."""
    import torch.distributed as dist
    return group is None or dist.get_rank(group) == 0
