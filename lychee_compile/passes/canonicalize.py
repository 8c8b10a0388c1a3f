"""Pass `canonicalize`: bring every site to one canonical description.

- K/V: peel repeat_kv back to the KV-head cache tensor [B, Hkv, T, D]:
      x[:, :, None].expand(B, Hkv, r, T, D).reshape(B, Hkv*r, T, D)   (HF's repeat_kv under compile)
      x.repeat_interleave(r, dim=1)
  or take x as is when the call has enable_gqa=True or there is no replication (MHA).
  Both spellings map query head j to KV head j // r, the op's GQA layout.
- Mask: none | bool (True = may attend) | additive float (0 = may attend, a large negative = masked). The mask must
  have one head row ([B|1, 1, L, T]); a per-head bias was refused by `detect`.
- Scale: a number; SDPA's default (None) becomes 1/sqrt(D).

The graph-side helpers at the bottom are inserted as call_function nodes by `rewrite`: they are plain torch code, so
every backend (eager FX, AOTAutograd + Inductor) traces them like model code.
"""
from __future__ import annotations

import math

import torch
import torch.fx

from .context import PassContext, Site
from .graph_query import arg, dtype, is_op, shape


def canonicalize_sites(ctx: PassContext) -> None:
    for site in ctx.sites:
        if site.refusal is None:
            _canonicalize(site)


def _canonicalize(site: Site) -> None:
    q_shape = shape(site.q)
    if q_shape is None or len(q_shape) != 4:
        site.refusal = "query is not a 4-D [B, H, L, D] tensor"
        return
    hq, head_dim = q_shape[1], q_shape[3]
    site.kv_k, chain_k = peel_repeat_kv(site.k)
    site.kv_v, chain_v = peel_repeat_kv(site.v)
    k_shape, v_shape = shape(site.kv_k), shape(site.kv_v)
    if k_shape is None or v_shape is None or len(k_shape) != 4 or k_shape[:3] != v_shape[:3]:
        site.refusal = "keys and values are not matching 4-D [B, Hkv, T, D] tensors"
        return
    hkv = k_shape[1]
    if not isinstance(hkv, int) or not isinstance(hq, int) or hq % hkv:
        site.refusal = f"query heads ({hq}) are not a multiple of KV heads ({hkv})"
        return
    if hkv != hq and not site.enable_gqa and not chain_k:
        site.refusal = "keys have fewer heads than queries but no repeat_kv or enable_gqa was found"
        return
    if v_shape[3] != head_dim:
        site.refusal = f"value head dim {v_shape[3]} differs from query head dim {head_dim}"
        return
    site.matched.extend(chain_k + chain_v)
    if site.scale is None:
        site.scale = 1.0 / math.sqrt(head_dim)
    site.scale = float(site.scale)
    site.mask_kind = _mask_kind(site)


def _mask_kind(site: Site) -> str | None:
    if site.mask is None:
        return "none"
    mask_shape = shape(site.mask)
    if mask_shape is None or len(mask_shape) != 4 or mask_shape[1] != 1:
        site.refusal = f"attention mask of shape {mask_shape}; expected [B, 1, L, T]"
        return None
    if dtype(site.mask) == torch.bool:
        return "bool"
    if dtype(site.mask) is not None and dtype(site.mask).is_floating_point:
        return "additive"
    site.refusal = f"attention mask of dtype {dtype(site.mask)}"
    return None


def peel_repeat_kv(node):
    """(the KV-head tensor, the replication nodes peeled) -- ([], node itself) when there is no replication."""
    chain, x = [], node
    while is_op(x, "contiguous"):
        chain.append(x)
        x = x.args[0]
    if is_op(x, "repeat_interleave") and arg(x, 2, "dim") == 1:
        return x.args[0], chain + [x]
    if is_op(x, "reshape"):
        expand = x.args[0]
        if is_op(expand, "expand") and is_op(expand.args[0], "getitem"):
            source, index = expand.args[0].args
            src_shape, exp_shape = shape(source), shape(expand)
            if (isinstance(index, tuple) and len(index) >= 3 and index[2] is None and src_shape is not None
                    and exp_shape is not None and len(exp_shape) == 5 and exp_shape[:2] == src_shape[:2]):
                return source, chain + [x, expand, expand.args[0]]
    return node, []


# --- graph-side helpers (inserted as call_function nodes) ------------------------------------------------------
def valid_from_bool_mask(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """mask bool [B|1, 1, L, T] -> valid bool [B, T] for the last (decode) query."""
    return mask[:, 0, -1, :].expand(q.shape[0], -1)


def valid_from_additive_mask(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """additive mask [B|1, 1, L, T] (0 = attend, large negative = masked) -> valid bool [B, T]."""
    return (mask[:, 0, -1, :] == 0).expand(q.shape[0], -1)


def valid_everywhere(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """No mask: every cached position is valid. -> bool [B, T]."""
    return torch.ones(1, k.shape[2], dtype=torch.bool, device=k.device).expand(q.shape[0], -1)


VALID_FROM = {"bool": valid_from_bool_mask, "additive": valid_from_additive_mask}
