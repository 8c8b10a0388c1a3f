"""Dense rectification of the KV cache (ReSA §2.2; LycheeDecode's cache correction).

Sparse decode steps write K/V computed from approximate hidden states. Every R decode steps the last R tokens are
re-encoded in one dense, parallel forward pass at their original positions, overwriting their K/V entries, so the
approximation error in the cache stays bounded.

Where it runs: after the compiled decode step, outside its graph. transformers' generate() obtains its compiled
decode call from `model.get_compiled_call(...)`; we wrap what that returns. The wrapper records each decode step's
token and position and, after every R-th step, rewinds each cache layer's write offset by R and runs the model over
those R tokens. Each generate() call gets a fresh wrapper, so nothing leaks between calls.

What runs the re-encode (LycheeConfig.compile_reencode, default on): a compiled call of the model's own for it
(fresh_call: a code object of its own, as the decode step has; fullgraph, dynamic=False), through a lychee backend
made for it (CUDA graphs and Inductor where the config says so, as for the decode step; the decode step's output is
copied out of the graph pool first). A forward of R >= 2 tokens is a prefill to the passes (classify.py): counted in
Counters.prefill_graphs (and reencode_graphs), never rewritten to sparse ops; the pass rewrite makes each of its
attention sites lychee::dense_decode with R queries (sharing one lychee::segment_plan) -- the same dense attention as
the model's, over the valid keys only (FlashAttention-2 varlen on CUDA), where HF's masked SDPA copies the cache G
times (repeat_kv) and attends its whole capacity. Its shapes are fixed -- tokens and positions [B, R], the padding
mask [B, T] over the whole static cache (T its capacity), the write offset a tensor of the cache -- so it compiles
once per batch size and never again across steps; it is a graph of its own, so the decode step's graph (and its
CUDA graphs) never recompiles for it. Off, or with rectify_every=1 (a one-token forward would compile as a decode
step and be rewritten sparse), the uncompiled model runs it: HF's eager forward; strict mode refuses
rectify_every=1 with compile_reencode at lychee_compile time, non-strict logs it; every re-encode is counted
(Counters.reencodes_compiled / reencodes_eager).

State kept through a re-encode (state_buffers.py, which reads REENCODING_ATTR): the heat is not zeroed (same
sequence); the Quest descriptors of the blocks holding the R rewritten keys are recomputed from the cache, in the
re-encode's own forward (inside its compiled graph, or eagerly), the other blocks' keys being unchanged.

Limits: only caches whose slot is the position (every layer global: no sliding-window ring buffers, which
lychee_compile checks); the 2-D padding mask is recovered from the decode step's mask.
"""
from __future__ import annotations

import logging

import torch

from .cache_kwarg import cache_kwarg, cache_of
from .errors import LycheeConfigError

REENCODING_ATTR = "_lychee_reencoding"     # True while a re-encode's forward runs
log = logging.getLogger("lychee_compile")


class Rectifier:
    """One generate() call's record of its last decode steps; reencode: the call that runs the re-encode forward,
    compiled: whether it is the compiled one (counted in counters)."""

    def __init__(self, model, every: int, reencode, compiled: bool, counters):
        self.model, self.every, self.reencode, self.compiled, self.counters = model, every, reencode, compiled, counters
        self.tokens, self.positions = [], []

    def after_step(self, kwargs, out=None):
        """Returns out, the decode step's output, or before a re-encode a copy of every tensor in it (a ModelOutput
        or tuples, nested): out of the CUDA-graph pool, which the re-encode's graph (another compiled call: a new
        cudagraph-trees generation) is free to reuse. The cache object's tensors live outside the pool."""
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        cache, mask = cache_of(kwargs), kwargs.get("attention_mask")
        if ids is None or cache is None or ids.shape[1] != 1:
            return out
        self.tokens.append(ids)
        self.positions.append(positions)
        if len(self.tokens) == self.every:
            out = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, out)   # logits [B, 1, V], ...
            self._reencode(cache, mask)
            self.tokens, self.positions = [], []
        return out

    def _reencode(self, cache, mask) -> None:
        tokens = torch.cat(self.tokens, dim=1)                                    # [B, R]
        padding = written_padding(mask, cache, tokens.shape[0])                   # [B, T]
        # every layer's write offset rewound by R: one foreach op, not one launch per layer (this runs eagerly)
        torch._foreach_sub_([layer.cumulative_length for layer in cache.layers], self.every)
        # tensors only (no read of the length on the host): [B, R] at the rewound offset
        positions = (torch.cat(self.positions, dim=1) if all(p is not None for p in self.positions)
                     else reencoded_positions(padding, cache.layers[0].cumulative_length, self.every))
        # marked: the state wrapper (state_buffers.py) must not take this multi-token forward for a prefill (a
        # prefill starts a new sequence and zeroes the heat) and refreshes the Quest blocks of these R keys only
        setattr(self.model, REENCODING_ATTR, True)
        try:
            with torch.no_grad():
                self.reencode(input_ids=tokens, position_ids=positions, attention_mask=padding, use_cache=True,
                              logits_to_keep=1, **{cache_kwarg(self.model): cache})
        finally:
            setattr(self.model, REENCODING_ATTR, False)
        if self.compiled:
            self.counters.reencodes_compiled += 1
        else:
            self.counters.reencodes_eager += 1


def reencoded_positions(padding: torch.Tensor, offset: torch.Tensor, every: int) -> torch.Tensor:
    """Positions [B, every] of the cache slots [offset, offset + every) counted over the padding mask [B, T]."""
    slots = (offset + torch.arange(every, device=padding.device)).expand(padding.shape[0], every)
    return (padding.cumsum(-1) - 1).clamp_min(0).gather(1, slots)


def written_padding(mask, cache, batch: int) -> torch.Tensor:
    """The padding mask [B, T] over the whole static cache (T its capacity: one shape for every re-encode) after a
    decode step with mask `mask`: 1 = a real token written so far, 0 = padding or not written yet. From tensors
    only: the written length is the cache's offset tensor, never read on the host."""
    keys = cache.layers[0].keys                                                   # [B, Hkv, T, D]
    capacity = keys.shape[2]
    row = padding_mask(mask, capacity, batch, keys.device)                        # [B, <= T]
    row = torch.nn.functional.pad(row, (0, capacity - row.shape[1]))
    written = torch.arange(capacity, device=keys.device) < cache.layers[0].cumulative_length
    return row * written


def padding_mask(mask, length: int, batch: int, device) -> torch.Tensor:
    """The 2-D padding mask [B, length] (1 = real token) behind a forward's mask (2-D, or 4-D bool/additive)."""
    if isinstance(mask, dict):   # transformers may pass one mask per layer type
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    if mask is None:
        return torch.ones(batch, length, dtype=torch.long, device=device)
    if mask.dim() == 4:
        row = mask[:, 0, -1, :length]
        row = row if row.dtype == torch.bool else row == 0
        return row.expand(batch, -1).long()
    return mask[:, :length].long()


def reencode_refusal(config) -> str | None:
    """Why the re-encode cannot run compiled under `config`; None where it can."""
    if config.rectify_every == 1:
        return ("rectify_every=1 re-encodes one token, and a one-token forward through a compiled call is a decode "
                "step, which the lychee backend rewrites to sparse attention (the re-encode must be dense)")
    return None


def reencode_mode(config, counters) -> bool:
    """Whether the re-encode runs compiled (lychee_compile calls this before it changes the model): as configured,
    except where reencode_refusal says it cannot, which strict mode refuses and non-strict mode logs and records in
    counters.reencode_eager_reason."""
    if not config.compile_reencode:
        counters.reencode_eager_reason = "compile_reencode=False (as configured)"
        log.info("lychee_compile: rectification's re-encode runs the uncompiled model (compile_reencode=False)")
        return False
    refused = reencode_refusal(config)
    if refused is None:
        log.info("lychee_compile: rectification's re-encode runs compiled (a dense prefill graph of its own)")
        return True
    if config.strict:
        raise LycheeConfigError(f"{refused}. Use rectify_every >= 2, or compile_reencode=False to re-encode with the "
                                "uncompiled model.")
    counters.reencode_eager_reason = refused
    log.warning("lychee_compile: %s: the re-encode runs the uncompiled model (counted in reencodes_eager).", refused)
    return False


def compiled_reencode(model, backend):
    """The model's own compiled call for the re-encode: a fresh code object, so its Dynamo cache entries are its own,
    never the decode step's. backend: the lychee backend made for it (backend.make_backend(reencode=True), CUDA graphs
    as configured); fixed shapes (dynamic=False): one graph per batch size."""
    from .fresh_call import fresh_call
    return torch.compile(fresh_call(model, "lychee_reencode"), backend=backend, fullgraph=True, dynamic=False)


def install_rectification(model, every: int, backend, counters) -> None:
    """backend: the re-encode's backend (compiled_reencode), or None: the re-encode runs the model itself."""
    reencode, compiled = (model, False) if backend is None else (compiled_reencode(model, backend), True)
    inner = model.get_compiled_call
    # the flag exists from the start: a traced multi-token forward reads it (state_buffers.py), and an attribute
    # appearing later would fail that graph's guard
    setattr(model, REENCODING_ATTR, False)

    def get_compiled_call(compile_config):
        step = inner(compile_config)
        rectifier = Rectifier(model, every, reencode, compiled, counters)

        def decode_step(*args, **kwargs):
            return rectifier.after_step(kwargs, step(*args, **kwargs))
        return decode_step

    model.get_compiled_call = get_compiled_call
