"""Install the cross-step state buffers on a compiled model (layout: ops/state.py) and keep them current.

lychee_compile() registers `_lychee_kinds` (always), `_lychee_heat` (heat enabled) and `_lychee_all_reduce` (tensor
parallel on CUDA, symm_mem_all_reduce: made and rendezvoused by tensor_parallel.resolved_all_reduce) as
non-persistent buffers, marks them static for Dynamo (one address for the model's life: CUDA graphs replay against
it), and wraps the instance's forward so that every call announces them to the captured graph with
lychee::bind_state, and every prefill zeroes the heat (a new sequence starts with none; rectification's re-encode
is not a prefill).

Quest descriptors (`_lychee_quest`, Quest bounds on; layout in ops/quest.py) are sized from the cache, so the
buffer is created by the first eager forward that carries a cache (generate()'s prefill), not at install. After
every eager forward with a cache (a prefill) the wrapped forward rebuilds every block's descriptor from that cache's
global layers under the forward's padding mask; the compiled decode steps then keep them current themselves
(quest_decode_step). A rectification's re-encode of the R newest tokens (rectify.py; compiled or eager) recomputes
the blocks holding those R keys only, at the end of its own forward (inside its graph when it is compiled). A
prefill chunk run through the compiled call (chunked prefill) is followed by the same rebuild, and finds the heat
buffer sized for its batch beforehand (a new buffer cannot be made inside the graph). A compiled decode step called
on a cache object other than the one they were built from (a cache this model did not prefill: the eval harness
prefills on the base model and scores copies) rebuilds them from that cache first, outside the graph
(QuestDescriptors.before_decode, run by the wrapped compiled call). Changes to a cache made without this model's
forward (cropping it in place, say) are not seen. A new batch size, a larger cache, or a cache of another dtype /
device gets a new buffer (Dynamo recompiles for it, as it does for the new cache).
"""
from __future__ import annotations

import functools
import weakref

import torch

from .cache_kwarg import cache_of, tokens_of
from .linear_groups import announce as announce_linear_groups
from .ops.quest import block_descriptors, descriptor_dtype, fold_recent_keys_
from .errors import LycheeCompileError, LycheeConfigError
from .rectify import REENCODING_ATTR, padding_mask

KINDS_ATTR = "_lychee_kinds"
HEAT_ATTR = "_lychee_heat"
QUEST_ATTR = "_lychee_quest"
ALL_REDUCE_ATTR = "_lychee_all_reduce"


def install_state(model, config, kinds: torch.Tensor, global_layers: list[int],
                  all_reduce_buffer: torch.Tensor | None = None):
    """kinds: bool [Lg, Hkv], the head kinds of the global layers (`global_layers`, model layer indices) in order;
    all_reduce_buffer: the rendezvoused symmetric buffer of lychee::one_shot_all_reduce, or None.
    Returns what a decode step made outside transformers' compiled call (dynamic_cache.py) must call with its
    kwargs before the compiled step (QuestDescriptors.before_decode), or None when nothing needs it."""
    _register(model, KINDS_ATTR, kinds.to(device=model.device, dtype=torch.bool))
    if all_reduce_buffer is not None:
        _register(model, ALL_REDUCE_ATTR, all_reduce_buffer)
    if config.heat_blocks > 0:
        _register(model, HEAT_ATTR, torch.zeros(1, *kinds.shape, _heat_blocks(model, config), device=model.device))
    quest = QuestDescriptors(model, config, list(global_layers)) if config.quest != "off" else None
    _wrap_forward(model, quest)
    if quest is None and config.heat_blocks == 0:
        return None
    inner = model.get_compiled_call

    def get_compiled_call(compile_config):     # generate()'s decode steps (and the eval harness's) go through it
        compiled = inner(compile_config)

        def compiled_step(*args, **kwargs):
            chunk = _query_length(args, kwargs) > 1     # a prefill chunk (generate(prefill_chunk_size=...))
            heat = getattr(model, HEAT_ATTR, None)
            if chunk and heat is not None and heat.shape[0] != _batch(args, kwargs):
                _reset_heat(model, heat, _batch(args, kwargs), prefill=True)    # a new buffer: outside the graph
            if quest is not None:
                quest.before_decode(kwargs)
            out = compiled(*args, **kwargs)
            if chunk and quest is not None:             # as after an eager prefill: every block from the cache
                quest.rebuild(cache_of(kwargs), kwargs.get("attention_mask"))
            return out
        return compiled_step

    model.get_compiled_call = get_compiled_call
    return quest.before_decode if quest is not None else None


def _query_length(args, kwargs) -> int:
    return int(tokens_of(args, kwargs).shape[1])


def _batch(args, kwargs) -> int:
    return int(tokens_of(args, kwargs).shape[0])


def write_kinds(model, kinds: torch.Tensor) -> None:
    """Write new head kinds into the existing buffer, in place (same address, so no recompile / re-capture)."""
    buf = getattr(model, KINDS_ATTR)
    buf.copy_(kinds.to(device=buf.device, dtype=torch.bool))


def _register(model, attr: str, value: torch.Tensor) -> None:
    model.register_buffer(attr, value, persistent=False)
    torch._dynamo.mark_static_address(getattr(model, attr))


def _blocks_for_max_positions(model, block_size: int, what: str) -> int:
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if not max_pos:
        raise LycheeConfigError(f"{what} needs model.config.max_position_embeddings to size its block buffer.")
    return -(-int(max_pos) // block_size)


def _heat_blocks(model, config) -> int:
    return _blocks_for_max_positions(model, config.block_size, "heat")


def _wrap_forward(model, keeper) -> None:
    """keeper: QuestDescriptors (Quest bounds on) or None."""
    inner = model.forward

    @functools.wraps(inner)     # generate() reads forward's signature to decide what to pass (position_ids, ...)
    def forward(*args, **kwargs):
        x = tokens_of(args, kwargs)
        # a prefill: any eager forward (generate() compiles only decode steps; a prompt may be one token) or a
        # multi-token one, except rectification's re-encode of the last R tokens (same sequence). The flag is not read
        # while Dynamo traces a one-token step: the read would become a guard of the decode graph.
        eager_or_long = x.shape[1] > 1 or not torch.compiler.is_compiling()
        reencoding = eager_or_long and getattr(model, REENCODING_ATTR, False)
        heat = getattr(model, HEAT_ATTR, None)
        if heat is not None:
            _reset_heat(model, heat, batch=x.shape[0], prefill=eager_or_long and not reencoding)   # keeps its heat
            torch.ops.lychee.bind_state(getattr(model, HEAT_ATTR), "heat")
        desc = getattr(model, QUEST_ATTR, None)
        if desc is not None and torch.compiler.is_compiling():
            if desc.shape[0] != x.shape[0]:
                raise LycheeCompileError(
                    f"the Quest descriptors were built for batch size {desc.shape[0]}, but this decode step has batch "
                    f"size {x.shape[0]}: prefill (an eager forward with the cache) first.")
            torch.ops.lychee.bind_state(desc, "quest")
        torch.ops.lychee.bind_state(getattr(model, KINDS_ATTR), "kinds")
        if hasattr(model, ALL_REDUCE_ATTR):
            torch.ops.lychee.bind_state(getattr(model, ALL_REDUCE_ATTR), "all_reduce")
        announce_linear_groups(model)
        out = inner(*args, **kwargs)
        if keeper is not None and reencoding:
            # the re-encode (compiled or not) rewrote its R keys: their blocks, in this forward (rectify.py)
            keeper.refresh_recent(cache_of(kwargs), kwargs["attention_mask"], x.shape[1])
        elif keeper is not None and not torch.compiler.is_compiling():
            # an eager forward wrote (or overwrote) cache entries outside the decode graph: rebuild the descriptors
            keeper.rebuild(cache_of(kwargs), kwargs.get("attention_mask"))
        return out

    model.forward = forward


def _reset_heat(model, heat: torch.Tensor, batch: int, prefill: bool) -> None:
    if heat.shape[0] != batch:       # a new batch size: a new buffer (a new graph is compiled for it anyway)
        _register(model, HEAT_ATTR, torch.zeros(batch, *heat.shape[1:], device=heat.device))
    elif prefill:                    # a prefill: a new sequence starts with no heat
        heat.zero_()


class QuestDescriptors:
    """Keeps `_lychee_quest` describing the cache the next decode step reads (layout: ops/quest.py)."""

    def __init__(self, model, config, global_layers: list[int]):
        self.model, self.config, self.global_layers = model, config, global_layers
        self.built_for = None          # weakref to the cache the descriptors were last built from

    def before_decode(self, kwargs) -> None:
        """A compiled decode step is about to run: rebuild first if its cache is not the one described."""
        cache = cache_of(kwargs)
        if cache is not None and (self.built_for is None or self.built_for() is not cache):
            self.rebuild(cache, kwargs.get("attention_mask"))

    def refresh_recent(self, cache, padding: torch.Tensor, n: int) -> None:
        """After a rectification re-encode of each row's `n` newest positions (padding [B, T]: the re-encode's mask
        over the whole cache, rectify.written_padding): recompute the blocks holding them, in every global layer, in
        place (ops/quest.fold_recent_keys_); the other blocks' keys did not change. Traceable: inside the compiled
        re-encode it is part of that graph. The descriptors describe this cache already (its decode steps ran
        QuestDescriptors.before_decode)."""
        desc = getattr(self.model, QUEST_ATTR)
        valid = padding.to(torch.bool)
        for slot, layer in enumerate(self.global_layers):
            fold_recent_keys_(desc, slot, cache.layers[layer].keys, valid, self.config.block_size, n)

    @torch.no_grad()
    def rebuild(self, cache, mask) -> None:
        """Every block's descriptor of every global layer from `cache` (keys [B, Hkv, T, D] per layer), valid = the
        positions written so far that the padding mask allows -- what a decode step's mask will say about them."""
        model, bs, global_layers = self.model, self.config.block_size, self.global_layers
        layers = getattr(cache, "layers", None)
        if layers is None or any(getattr(layers[i], "keys", None) is None for i in global_layers):
            return                       # no cache (use_cache=False) or not filled: nothing a decode step could read
        keys = [layers[i].keys for i in global_layers]
        B, hkv, T, D = keys[0].shape
        length = int(layers[global_layers[0]].get_seq_length())
        valid = padding_mask(mask, length, B, keys[0].device).to(torch.bool)
        if valid.shape != (B, length):
            raise LycheeCompileError(f"the attention mask covers {valid.shape[-1]} positions but the cache holds "
                                     f"{length}; pass a 2-D padding mask over every cached position (what generate() "
                                     "does).")
        valid = torch.nn.functional.pad(valid, (0, T - length), value=False)
        # A static cache never grows past its capacity T; a growing one (DynamicCache) is sized for the longest
        # sequence.
        nb = -(-T // bs) if getattr(cache, "is_compileable", False) else _blocks_for_max_positions(model, bs, "Quest")
        if nb * bs < T:
            raise LycheeConfigError(f"the cache holds {T} positions, more than model.config.max_position_embeddings; "
                                    "Quest descriptors are sized by it for caches that grow.")
        buf = getattr(model, QUEST_ATTR, None)
        dtype = descriptor_dtype(keys[0].dtype)
        if (buf is None or buf.shape[0] != B or buf.shape[3] < nb or buf.shape[2] != hkv or buf.shape[5] != D
                or buf.dtype != dtype or buf.device != keys[0].device):
            _register(model, QUEST_ATTR, torch.empty(B, len(keys), hkv, nb, 2, D, dtype=dtype, device=keys[0].device))
            buf = getattr(model, QUEST_ATTR)
        for slot, k in enumerate(keys):  # a reused, larger buffer: the blocks past this cache get +inf / -inf too
            buf[:, slot] = block_descriptors(k, valid, bs, buf.shape[3])
        self.built_for = weakref.ref(cache)
