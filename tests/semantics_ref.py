"""An independent, deliberately plain re-implementation of the spine's semantics, for tests only.

It does not import lychee_compile: it is written from the issue's text, loops over rows and heads, and plugs into
transformers as an attention function ("lychee_semantics") so an uncompiled model runs the semantics directly.

    Retrieval head (first global layer, or retrieval[l, h]): full attention over valid positions; token score =
      sum over the G query heads of softmax probs; block score = sum of its valid tokens' scores; candidates = valid
      blocks that are neither sink nor local; select top ceil(budget/bs) by score, ties to the lower block; top-k
      compares scores as fp32 with the low 11 mantissa bits cleared (12 significant bits: closer scores tie).
    Sparse head: attention over valid tokens of S[l'][h] (previous global layer) plus sink and local blocks;
      S[l][h] = S[l'][h].
    Blocks: a row's blocks start at its first valid position lo (its text, not the cache slot): block j is
      positions lo + j*bs .. lo + (j+1)*bs - 1, so padding in front of a prompt never moves a block boundary.
    Sink blocks: blocks of the first sink_tokens valid positions; local: of the last local_tokens valid positions.
    Selection policy (LycheeConfig.selection): a prefix of the same ranking -- topk: K blocks; topp: the shortest
      prefix whose mass (group-mean probability) plus the sink/local mass reaches p; threshold: blocks of mass >= tau;
      ratio: ceil(theta * valid blocks); never more than K.
    Streaming head (streaming[l, h]): sink and local blocks only; S[l][h] = {} (it passes nothing on).
    first_layer_retrieval=False: the first global layer follows the map like any other (baselines).
    Prefill and non-global layers: dense.
"""
from __future__ import annotations

import math
import struct

import torch

NAME = "lychee_semantics"


def _twelve_bits(x: float) -> float:
    """x as fp32 with the low 11 mantissa bits cleared (rounded toward zero to 12 significant bits)."""
    bits = struct.unpack("<i", struct.pack("<f", x))[0] & ~0x7FF
    return struct.unpack("<f", struct.pack("<i", bits))[0]


class Semantics:
    def __init__(self, retrieval, global_layers, budget, block_size, sink_tokens, local_tokens, streaming=None,
                 first_layer_retrieval=True, selection="topk", selection_param=0.0):
        self.policy, self.param = selection, selection_param
        self.retrieval = retrieval.tolist()
        self.streaming = streaming.tolist() if streaming is not None else [[False] * len(r) for r in self.retrieval]
        self.first_forced = first_layer_retrieval
        self.global_layers = list(global_layers)
        self.k = math.ceil(budget / block_size)
        self.bs, self.sink, self.local = block_size, sink_tokens, local_tokens
        self.selection = {}     # (row, kv head) -> list of selected blocks of the previous global layer
        self.decode_calls = 0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        B, Hq, L, D = query.shape
        Hkv, T = key.shape[1], key.shape[2]
        G = Hq // Hkv
        scale = scaling if scaling is not None else D ** -0.5
        layer = module.layer_idx
        out = torch.zeros(B, Hq, L, D, dtype=torch.float32)
        for b in range(B):
            for i in range(L):
                allowed = self._allowed(attention_mask, b, i, L, T)
                for h in range(Hkv):
                    qs = [query[b, h * G + g, i].float() for g in range(G)]
                    if L > 1 or layer not in self.global_layers:
                        attend = allowed
                    else:
                        attend = self._decode_head(layer, b, h, qs, key[b, h].float(), allowed, scale)
                    for g in range(G):
                        out[b, h * G + g, i] = _attend(qs[g], key[b, h].float(), value[b, h].float(), attend, scale)
        if L == 1 and layer in self.global_layers:
            self.decode_calls += 1
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    @staticmethod
    def _allowed(mask, b, i, L, T):
        if mask is None:
            # transformers skips the mask only when SDPA's is_causal can stand in for it: for L > 1 that is
            # top-left aligned causal attention (query i sees keys 0..i); a single query sees every key.
            return [t for t in range(T) if t <= i] if L > 1 else list(range(T))
        row = mask[b if mask.shape[0] > 1 else 0, 0, i]
        if row.dtype == torch.bool:
            return [t for t in range(T) if bool(row[t])]
        return [t for t in range(T) if float(row[t]) == 0.0]

    def _block(self, t, valid):
        """Block of position t in a row whose valid positions are `valid` (counted from the first of them)."""
        return (t - valid[0]) // self.bs

    def _decode_head(self, layer, b, h, qs, keys, valid, scale):
        blk_of = lambda t: self._block(t, valid)  # noqa: E731
        sink_blocks = {blk_of(t) for t in valid[:self.sink]}
        local_blocks = {blk_of(t) for t in valid[len(valid) - self.local:]} if self.local > 0 else set()
        is_retrieval = (self.first_forced and layer == self.global_layers[0]) or self.retrieval[layer][h]
        if is_retrieval:
            token_score = {t: 0.0 for t in valid}
            for q in qs:
                logits = [float(q @ keys[t]) * scale for t in valid]
                m = max(logits)
                e = [math.exp(x - m) for x in logits]
                z = sum(e)
                for t, x in zip(valid, e):
                    token_score[t] += x / z
            block_score = {}
            for t in valid:
                block_score[blk_of(t)] = block_score.get(blk_of(t), 0.0) + token_score[t]
            candidates = [blk for blk in sorted(block_score) if blk not in sink_blocks and blk not in local_blocks]
            rank = (lambda x: _twelve_bits(x)) if self.policy == "topk" else (lambda x: x)
            ranked = sorted(candidates, key=lambda blk: (-rank(block_score[blk]), blk))
            self.selection[(b, h)] = sorted(ranked[:self._keep(ranked, block_score, sink_blocks | local_blocks,
                                                               len(qs), len(block_score))])
            return valid
        if self.streaming[layer][h] or layer == self.global_layers[0]:
            self.selection[(b, h)] = []
        keep = set(self.selection[(b, h)]) | sink_blocks | local_blocks
        return [t for t in valid if blk_of(t) in keep]


    def _keep(self, ranked, block_score, fixed_blocks, group, n_valid_blocks):
        mass = [block_score[blk] / group for blk in ranked]
        if self.policy == "topk":
            n = self.k
        elif self.policy == "topp":
            need = self.param - sum(block_score[blk] for blk in fixed_blocks if blk in block_score) / group
            n, total = (0, 0.0) if need <= 0 else (len(ranked), 0.0)
            if need > 0:
                for i, m in enumerate(mass):
                    total += m
                    if total >= need - 1e-6:
                        n = i + 1
                        break
        elif self.policy == "threshold":
            n = sum(m >= self.param for m in mass)
        else:
            n = math.ceil(self.param * n_valid_blocks)
        return min(n, self.k)


def _attend(q, keys, values, positions, scale):
    if not positions:   # a pad query in prefill: nothing allowed, and no real token ever reads its output
        return torch.zeros(values.shape[-1])
    logits = torch.stack([q @ keys[t] for t in positions]) * scale
    p = torch.softmax(logits, dim=0)
    return (p[:, None] * values[positions]).sum(0)


def register(semantics: Semantics) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(NAME, semantics)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def global_layers_of(config, cache_len: int) -> list[int]:
    """Global per the spine: layer_types says full, or no window, or the window is at least the cache length."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    out = []
    for layer in range(config.num_hidden_layers):
        windowed = ("sliding" in layer_types[layer]) if layer_types is not None else window is not None
        if not windowed or (window is not None and window > cache_len):
            out.append(layer)
    return out


class HeatSemantics(Semantics):
    """Semantics plus EvoSparse heat, written from the issue: per (row, layer, KV head) a heat value per block,
    h_t = decay * h_{t-1} + (probability the head computed this step on the block, summed over its G query heads);
    a sparse head additionally attends its `heat_blocks` hottest warm (h > 0) blocks that it would not attend
    otherwise (ties to the lower block); the index passed on is unchanged. Heat resets at every prefill."""

    def __init__(self, *args, heat_blocks, heat_decay, **kwargs):
        super().__init__(*args, **kwargs)
        self.heat_blocks, self.decay = heat_blocks, heat_decay
        self.heat = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if query.shape[2] > 1:
            self.heat = {}
        return super().__call__(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    def _decode_head(self, layer, b, h, qs, keys, valid, scale):
        attend = super()._decode_head(layer, b, h, qs, keys, valid, scale)
        heat = self.heat.setdefault((b, layer, h), {})
        is_retrieval = (self.first_forced and layer == self.global_layers[0]) or self.retrieval[layer][h]
        blk_of = lambda t: self._block(t, valid)  # noqa: E731
        if not is_retrieval:
            have = {blk_of(t) for t in attend}
            warm = sorted((blk for blk in {blk_of(t) for t in valid} if heat.get(blk, 0.0) > 0 and blk not in have),
                          key=lambda blk: (-heat[blk], blk))[:self.heat_blocks]
            attend = [t for t in valid if blk_of(t) in have | set(warm)]
        for blk in list(heat):
            heat[blk] *= self.decay
        for q in qs:
            logits = torch.stack([q @ keys[t] for t in attend]) * scale
            for t, p in zip(attend, torch.softmax(logits, dim=0).tolist()):
                heat[blk_of(t)] = heat.get(blk_of(t), 0.0) + p
        return attend


class QuestSemantics(Semantics):
    """Semantics with Quest bounds, from the issue: per block, element-wise min/max of its valid keys; bound of the
    group's mean query q: sum_i max(q_i*kmin_i, q_i*kmax_i). mode "all": every head attends sink + local + its own
    top-K candidate blocks by the bound (ties to the lower block); mode "sparse": a sparse head adds its top
    `quest_blocks` candidate blocks not already attended."""

    def __init__(self, *args, quest, quest_blocks, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode, self.quest_blocks = quest, quest_blocks

    def _bound_ranking(self, qs, keys, valid, exclude):
        qbar = torch.stack(qs).mean(0)
        blocks = sorted({self._block(t, valid) for t in valid} - exclude)
        bound = {}
        for blk in blocks:
            ks = torch.stack([keys[t] for t in valid if self._block(t, valid) == blk])
            bound[blk] = float(torch.maximum(qbar * ks.min(0).values, qbar * ks.max(0).values).sum())
        return sorted(blocks, key=lambda blk: (-bound[blk], blk))

    def _decode_head(self, layer, b, h, qs, keys, valid, scale):
        blk_of = lambda t: self._block(t, valid)  # noqa: E731
        sink = {blk_of(t) for t in valid[:self.sink]}
        local = {blk_of(t) for t in valid[len(valid) - self.local:]} if self.local > 0 else set()
        if self.mode == "all":
            own = self._bound_ranking(qs, keys, valid, sink | local)[:self.k]
            return [t for t in valid if blk_of(t) in sink | local | set(own)]
        attend = super()._decode_head(layer, b, h, qs, keys, valid, scale)
        is_retrieval = (self.first_forced and layer == self.global_layers[0]) or self.retrieval[layer][h]
        if is_retrieval:
            return attend
        have = {blk_of(t) for t in attend}
        extra = self._bound_ranking(qs, keys, valid, sink | local | have)[:self.quest_blocks]
        return [t for t in valid if blk_of(t) in have | set(extra)]
