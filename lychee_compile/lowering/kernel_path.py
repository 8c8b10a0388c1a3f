"""Which rewritten decode sites run on the Triton kernels and which on the op's eager reference, and why.

One predicate, `refusal`, decides it. The lowering (lower.py) applies it to Inductor's IR of each lychee::hybrid_decode
/ hybrid_decode_mass call; the backend applies it, before Inductor runs, to the tensor metadata of each site the
rewrite made (`site_refusal`), so the two cannot disagree, and Inductor's FX-graph cache (which skips the lowering)
does not hide the choice. `account_sites` counts each site one way or the other (Counters.sites_on_kernel /
sites_on_reference / reference_reasons) and, in strict mode, refuses a CUDA site that would run the reference before
any decode step runs (on CUDA the reference is a slow path and cannot be captured in a CUDA graph).
"""
from __future__ import annotations

import logging

import torch

from ..errors import LycheeCompileError
from ..ops.op_arguments import get_arg

log = logging.getLogger("lychee_compile")

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256      # the split's fp32 accumulator and K / V tiles grow with the head dim's tile (constexprs.py)


def refusal(dtype, kv_dtype, device, Hq: int, Hkv: int, D: int, quest_mode: int = 0) -> str | None:
    """None if the Triton templates take a decode op call with these properties, else why not (the op's eager
    reference then runs as an extern kernel). Any head dim up to MAX_HEAD_DIM: the kernels pad it inside
    (constexprs.head_dim_tile)."""
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (the kernels take bf16 / fp16; fp32 runs the reference)"
    if kv_dtype != dtype:
        return f"q is {dtype} but k / v are {kv_dtype}"
    if not _triton_device(device):
        return f"device {device} has no Triton code generation (CUDA, or CPU with Inductor's cpu_backend='triton')"
    if D > MAX_HEAD_DIM:
        return f"head_dim {D} > {MAX_HEAD_DIM}"
    if Hq % Hkv != 0:
        return f"{Hq} query heads are not a multiple of {Hkv} KV heads"
    if quest_mode != 0:
        return "Quest bounds recomputed from the cache (quest_mode != 0) have no template"
    return None


def _triton_device(device) -> bool:
    from . import compat     # Inductor's config: imported where a compile is under way, not with the backend
    return compat.triton_device_ok(device)


def site_refusal(op_node: torch.fx.Node) -> str | None:
    """`refusal` for the decode call a rewritten site became (lychee::hybrid_decode, or a composite around
    hybrid_decode_mass / hybrid_decode: its q and k are the inner call's), from the Dynamo graph's metadata."""
    q, k = (get_arg(op_node, name).meta["example_value"] for name in ("q", "k"))
    # the composites call the decode ops with quest_mode 0 (their Quest state is their own argument)
    quest_mode = get_arg(op_node, "quest_mode") if op_node.target is torch.ops.lychee.hybrid_decode.default else 0
    return refusal(q.dtype, k.dtype, site_device(op_node), _hint(q.shape[1]), _hint(k.shape[1]), _hint(q.shape[3]),
                   quest_mode)


def site_device(op_node: torch.fx.Node) -> torch.device:
    """The device a rewritten site's decode call runs on (its q's)."""
    return get_arg(op_node, "q").meta["example_value"].device


def _hint(size) -> int:
    """A size's value without guarding on it (the lowering guards head counts and head dim static itself)."""
    return size if isinstance(size, int) else int(size.node.hint)


def refuse_probe_sites(sites: list, config) -> None:
    """lychee_compile's early form of account_sites' strict refusal: the probe's global sites (not rewritten; q and the
    un-expanded K carry the dtype, device and head sizes the decode call will get) checked before the model is
    changed and before any prefill. Strict mode, the Inductor backend and hybrid attention only."""
    if not config.strict or config.backend == "eager" or config.attention != "hybrid":
        return
    by_reason = {}
    for site in sites:
        q, k = (node.meta["example_value"] for node in (site.q, site.kv_k if site.kv_k is not None else site.k))
        if q.device.type != "cuda":
            continue
        why = refusal(q.dtype, k.dtype, q.device, _hint(q.shape[1]), _hint(k.shape[1]), _hint(q.shape[3]))
        if why is not None:
            by_reason.setdefault(why, []).append(site.layer_idx)
    if by_reason:
        raise LycheeCompileError("; ".join(f"the decode sites of layers {layers} would run the op's eager reference, "
                                           f"not the Triton kernels: {why}" for why, layers in by_reason.items())
                                 + " (strict mode; strict=False runs the reference there, logged and counted)")


def account_sites(sites: list, config, counters) -> None:
    """Count every rewritten site of a decode graph as on the kernels or on the reference; the reference's sites
    once per reason in reference_reasons (their layers named), logged (a warning on CUDA). Strict: CUDA sites on the
    reference raise LycheeCompileError before the graph is compiled. backend='eager' runs every site's reference by
    choice: counted, never refused."""
    by_reason = {}                     # (why, on CUDA) -> layers
    for site in sites:
        if site.op_node is None:       # attention="flash_dense": the dense baseline, no hybrid decode call
            continue
        why = "backend='eager'" if config.backend == "eager" else site_refusal(site.op_node)
        if why is None:
            counters.sites_on_kernel += 1
            continue
        counters.sites_on_reference += 1
        by_reason.setdefault((why, site_device(site.op_node).type == "cuda"), []).append(site.layer_idx)
    refused = []
    for (why, on_cuda), layers in by_reason.items():
        message = f"the decode sites of layers {layers} run the op's eager reference, not the Triton kernels: {why}"
        if config.strict and on_cuda and config.backend != "eager":
            refused.append(message)
        elif message not in counters.reference_reasons:
            counters.reference_reasons.append(message)
            log.log(logging.WARNING if on_cuda else logging.INFO, "lychee_compile: %s", message)
    if refused:
        raise LycheeCompileError("; ".join(refused) + " (strict mode; strict=False runs the reference there, "
                                 "logged and counted in Counters.sites_on_reference)")
