"""Which generate() modes run the rewritten decode step, decided before any work.

generate() runs the compiled decode step (the rewrite) for greedy search and sampling, with any logits processors,
stopping criteria or num_return_sequences: their loop calls model.get_compiled_call() for every step after the
prefill. Beam search (and beam sampling) calls the model directly: those steps are routed through the compiled call
and the cache and state are reordered in place (beam_search.py), except with rectify_every. The other modes do not
run it: assisted generation and prompt lookup verify several tokens a step; contrastive search, DoLa, group and
constrained beam search are loaded from the hub (offline: not at all). Chunked prefill (prefill_chunk_size) runs its
chunks through the compiled call as prefill graphs, dense, as any prefill. Their tokens would come from dense attention, so lychee_compile names the mode and refuses
it before the prefill (strict mode), or logs it and lets generate() count the dense call (generate_calls_dense).
"""
from __future__ import annotations

import copy

SUPPORTED = ("greedy_search", "sample", "beam_search", "beam_sample")


def unsupported_mode(model, args, kwargs, rectify_every: int = 0, config=None) -> str | None:
    """What generate(*args, **kwargs) would run instead of the rewritten decode step, as a sentence; None when it runs
    it. config: merged_config(model, args, kwargs) where the caller has it."""
    config = merged_config(model, args, kwargs) if config is None else config
    if kwargs.get("custom_generate") is not None:
        return "a custom_generate loop does not call the compiled decode step."
    mode = generation_mode(model, args, kwargs, config)
    if mode.startswith("beam_") and mode in SUPPORTED and rectify_every:
        return (f"generate() mode '{mode}' with rectify_every={rectify_every} is not supported: rectification's "
                "record of the last tokens does not follow the beams. Use rectify_every=0 for beam search.")
    if mode in SUPPORTED:
        return None
    return (f"generate() mode '{mode}' does not run the rewritten decode step (its tokens would come from dense "
            f"attention); lychee_compile supports {', '.join(SUPPORTED)} (no assistant model, penalty_alpha or "
            "dola_layers).")


def generation_mode(model, args, kwargs, config=None) -> str:
    """The mode generate(*args, **kwargs) will run, by transformers' own rule ("greedy_search", "beam_search", ...)."""
    config = merged_config(model, args, kwargs) if config is None else config
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    return getattr(mode, "value", mode)    # an enum of strings


def merged_config(model, args, kwargs):
    """The generation config generate() will use, merged as generate() merges it: a passed one (keyword, or
    generate()'s second positional argument) with its unset fields taken from the model's, then the keyword
    arguments."""
    passed = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    config = copy.deepcopy(passed if passed is not None else model.generation_config)
    if passed is not None:
        config.update(defaults_only=True, **model.generation_config.to_dict())
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config
