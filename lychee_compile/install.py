"""install: every change lychee_compile makes to a model, applied in one place, in this order.

  1. generation_config.cache_implementation = "static" and generation_config.compile_config = a CompileConfig with
     our backend (fullgraph): a plain model.generate(...) compiles its decode step through the rewrite.
  2. get_compiled_call: the model's own compiled call (a code object of its own, not nn.Module's shared __call__),
     so each model in a process compiles its own decode step (_own_compiled_call).
  3. with LycheeConfig.fuse_linears: the probe's sibling linears' weights become views of one buffer each
     (linear_groups.fuse_weights; same values, no extra memory).
  4. with rectify_every: get_compiled_call wrapped (rectify.py: a dense re-encode every N steps, after the step),
     by default through a compiled call of the model's own for it (a second code object, its own backend without
     CUDA graphs: a prefill graph whose attention the pass rewrite makes lychee::dense_decode).
  5. state buffers registered (`_lychee_kinds`; `_lychee_heat` with heat; `_lychee_quest` at the first prefill with
     Quest; `_lychee_all_reduce` under tensor parallelism on CUDA), forward wrapped to announce them to the graph
     and rebuild them at a prefill; with Quest, get_compiled_call wrapped to rebuild descriptors for a cache this
     model did not prefill (state_buffers.py).
  6. forward wrapped to route decode steps made outside the compiled call (beam search's, on the static cache)
     through it and those on a DynamicCache through the backend, and generate() wrapped to let cache objects in
     (dynamic_cache.py). After 5: the compiled call must include 5's forward wrapper.
  7. `_reorder_cache`: beam search reorders the cache and the state buffers in place (beam_search.py); during a
     beam-search generate() the model carries `_lychee_beam_steps` (set by 8), which routes its steps (6).
  8. generate() wrapped (outermost): a padding mask the step cannot read and, in strict mode, a generation mode that
     would not run the rewrite are refused before any work; a generate() whose decode steps bypassed the rewrite
     is an error in strict mode, a warning otherwise (masks.py, generation_modes.py).
  9. `_lychee_state` (api.LycheeState): config, head map, counters, backend, snapshots.
Nothing else on the model or in the process changes (Inductor: lowering/inductor_changes.py).
"""
from __future__ import annotations

import logging

import torch

from .beam_search import BEAM_STEPS_ATTR, install_beam_reorder
from .dynamic_cache import install_dynamic_cache
from .fresh_call import fresh_call
from .errors import LycheeCompileError, lychee_error_inside
from .cache_kwarg import tokens_of
from .generation_modes import generation_mode, merged_config, unsupported_mode
from .linear_groups import fuse_weights
from .masks import check_padding_mask
from .rectify import install_rectification
from .state_buffers import install_state
from .tensor_parallel import local_linear_shards

STATE_ATTR = "_lychee_state"
log = logging.getLogger("lychee_compile")


def install(model, config, backend, dynamic_backend, reencode_backend, linear_groups, kinds, global_layers,
            counters, all_reduce_buffer=None) -> None:
    """Steps 1-8 of the module docstring (api.lychee_compile sets 9). kinds: bool [Lg, Hkv], the head kinds of the
    global layers `global_layers`; dynamic_backend: the backend for DynamicCache decode steps; reencode_backend: the
    backend of rectification's re-encode, None where it runs the uncompiled model (rectify.reencode_mode);
    all_reduce_buffer: tensor parallel, the symmetric buffer of lychee::one_shot_all_reduce (or None)."""
    _compile_decode_steps(model, backend)                                            # 1, 2
    if config.fuse_linears:
        fuse_weights(model, linear_groups)                                           # 3
    if config.rectify_every:                                                         # 4
        install_rectification(model, config.rectify_every, reencode_backend, counters)
    before_decode = install_state(model, config, kinds, global_layers, all_reduce_buffer)  # 5
    install_dynamic_cache(model, dynamic_backend, config, before_decode)            # 6
    install_beam_reorder(model)                                                      # 7
    _guard_generate(model, counters, config)                                         # 8


def _guard_generate(model, counters, config) -> None:
    """Wrap the instance's generate() so a call whose decode steps bypassed the rewrite (a dynamic cache, compile
    disabled, a generation mode HF does not compile) never passes silently as lychee output; a padding mask the
    rewritten step cannot read (masks.py) and, in strict mode, a generation mode that would not run it
    (generation_modes.py) are refused before any work."""
    inner = model.generate

    def generate(*args, **kwargs):
        check_padding_mask(kwargs.get("attention_mask"))
        generation = merged_config(model, args, kwargs)
        refused = unsupported_mode(model, args, kwargs, config.rectify_every, generation)
        if refused is not None:
            if config.strict:
                raise LycheeCompileError(refused)
            log.warning("lychee_compile: %s", refused)
        before = counters.decode_calls
        setattr(model, BEAM_STEPS_ATTR, generation_mode(model, args, kwargs, generation).startswith("beam_"))
        setattr(model, PREFILL_CALLS_ATTR, _prefill_chunks(args, kwargs, generation))
        try:
            out = inner(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:    # our backend refused the decode graph (strict)
            raise lychee_error_inside(exc) from None
        finally:
            setattr(model, BEAM_STEPS_ATTR, False)
            setattr(model, PREFILL_CALLS_ATTR, 0)
        sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        prompt = args[0] if args else kwargs.get("input_ids")
        new_tokens = (sequences.shape[-1] - prompt.shape[-1]) if (
            isinstance(sequences, torch.Tensor) and isinstance(prompt, torch.Tensor)) else 0
        if new_tokens > 1 and counters.decode_calls == before:
            counters.generate_calls_dense += 1
            message = ("generate() produced its tokens without the lychee decode step (it ran dense): transformers "
                       "did not compile the decode step -- use the static cache lychee_compile set or a "
                       "DynamicCache (other cache kinds, use_cache=False or disabled compilation bypass it).")
            if config.strict:
                raise LycheeCompileError(message)
            log.warning("lychee_compile: %s", message)
        return out

    generate.__doc__ = inner.__doc__
    model.generate = generate


PREFILL_CALLS_ATTR = "_lychee_prefill_calls"     # compiled calls left that are prompt chunks (chunked prefill)


def _prefill_chunks(args, kwargs, generation) -> int:
    """How many of generate()'s calls of the compiled call are prompt chunks: ceil(prompt / prefill_chunk_size) with
    chunked prefill, else 0 (transformers then prefills with one eager call)."""
    chunk = getattr(generation, "prefill_chunk_size", None)
    prompt = tokens_of(args, kwargs)
    return -(-int(prompt.shape[1]) // int(chunk)) if chunk and prompt is not None else 0


def _prompt_chunks_eager(model, compiled):
    """The compiled call, except for a one-token prompt chunk (chunked prefill, prompt length % chunk == 1), which
    runs the model eagerly: to the compiled graph a one-token call is a decode step, and it would be rewritten
    (sparse) while it is part of the prefill (dense). Longer chunks compile as prefill graphs (classify.py)."""
    shards = local_linear_shards(model)          # tensor parallel: the graphs read Linear weights' local shards

    def compiled_call(*args, **kwargs):
        left = getattr(model, PREFILL_CALLS_ATTR, 0)
        if left:
            setattr(model, PREFILL_CALLS_ATTR, left - 1)
            if tokens_of(args, kwargs).shape[1] == 1:
                return model(*args, **kwargs)
        if shards is None:
            return compiled(*args, **kwargs)
        with shards:
            return compiled(*args, **kwargs)
    return compiled_call


def _compile_decode_steps(model, backend) -> None:
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
            compiled = torch.compile(call, **compile_config.to_dict())
            made.update(config=compile_config, call=_prompt_chunks_eager(model, compiled))
        return made["call"]

    model.get_compiled_call = get_compiled_call
