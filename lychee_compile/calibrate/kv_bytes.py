"""KV bytes one decode step reads: the K and V rows every head attends, plus the Quest descriptors the Quest modes
read -- not weights, not activations. Nominal counts (the quantity the calibration minimizes), per sequence:

    global layer, retrieval head   the whole context: T positions
    global layer, sparse head      sink + local + the budget's whole blocks (ceil(budget / block) * block), at most T
                                   (+ quest_blocks blocks with quest="sparse")
    Quest heads                    also every block's min/max descriptor: ceil(T / block) x 2 x head_dim values
                                   (quest="all": every head of the layer; "sparse": the sparse heads)
    global layer, streaming head   sink + local, at most T (HeadMap.streaming: the StreamingLLM / Duo baselines)
    other layers (sliding window)  min(T, window), the same with and without lychee
Dense reads T positions in every global layer. Bytes per position: K and V, head_dim values each, of the cache dtype.
"""
from __future__ import annotations

import torch


def head_dim_of(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def bytes_per_step(model_config, effective: torch.Tensor | None, global_layers: list[int], lycfg, context: int,
                   itemsize: int, streaming: torch.Tensor | None = None) -> float:
    """`effective`: bool [num_layers, Hkv], the map the ops use (HeadMap.effective); None: dense. `streaming`: bool
    [num_layers, Hkv], the streaming heads (HeadMap.streaming; a head `effective` makes retrieval counts as one), or
    None."""
    d = head_dim_of(model_config)
    per_pos = 2 * d * itemsize
    n_kv = int(getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads)
    window = getattr(model_config, "sliding_window", None)
    total = 0.0
    for layer in range(model_config.num_hidden_layers):
        if layer not in global_layers:
            total += n_kv * per_pos * min(context, window or context)
            continue
        if effective is None:
            total += n_kv * per_pos * context
            continue
        n_streaming = 0 if streaming is None else int((streaming[layer] & ~effective[layer]).sum())
        total += _global_layer(effective[layer], n_streaming, lycfg, context, per_pos, d * itemsize)
    return total


def _global_layer(retrieval_row: torch.Tensor, n_streaming: int, lycfg, context: int, per_pos: int,
                  desc_bytes: int) -> float:
    n_kv = retrieval_row.numel() - n_streaming        # the heads below: retrieval, sparse (or Quest)
    n_retr = int(retrieval_row.sum())
    extra_blocks = lycfg.quest_blocks if lycfg.quest == "sparse" else 0
    sparse_pos = min(context, lycfg.sink_tokens + lycfg.local_tokens
                     + (lycfg.num_select + extra_blocks) * lycfg.block_size)
    if lycfg.quest == "all":          # every head is a Quest head: none attends the whole context
        n_retr = 0
    kv = per_pos * (n_retr * context + (n_kv - n_retr) * sparse_pos
                    + n_streaming * min(context, lycfg.sink_tokens + lycfg.local_tokens))
    quest_heads = {"off": 0, "all": n_kv, "sparse": n_kv - n_retr}[lycfg.quest]
    descriptors = quest_heads * -(-context // lycfg.block_size) * 2 * desc_bytes
    return float(kv + descriptors)


def mean_bytes(model_config, effective, global_layers, lycfg, contexts: list[int], itemsize: int) -> float:
    """Mean over the context lengths of the range the map is calibrated for."""
    return sum(bytes_per_step(model_config, effective, global_layers, lycfg, t, itemsize) for t in contexts) / len(
        contexts)
