"""Inductor lowering of `torch.ops.lychee.hybrid_decode` to generated Triton kernels.

    from lychee_compile.lowering import register
    register()          # idempotent; call before torch.compile(..., backend="inductor") compiles the graph

After `register()`, every `lychee::hybrid_decode` (and `lychee::hybrid_decode_mass`, the variant heat and Quest
build on) node that Inductor compiles for CUDA (or for CPU with
`torch._inductor.config.cpu_backend = "triton"`, tests only) with bf16/fp16 q/k/v becomes two Triton kernels
(split + combine/select, see kernel_source.py; every selection policy); anything else (fp32, other devices, Quest modes)
keeps the eager reference as an extern kernel. `unregister()` restores the default (extern) handling.
"""
from __future__ import annotations

_registration = {"registered": False, "previous": {}}


def _ops():
    from .lower import (INDEX_READY_OP, MASS_OP, OP, hybrid_decode_lowering, hybrid_decode_mass_lowering,
                        index_ready_lowering)
    return {OP: hybrid_decode_lowering, MASS_OP: hybrid_decode_mass_lowering, INDEX_READY_OP: index_ready_lowering}


def register() -> None:
    from . import compat
    if is_registered():
        return
    for op, lowering in _ops().items():
        _registration["previous"][op] = compat.lowerings.get(op)
        compat.register_lowering(op, type_promotion_kind=None)(lowering)
        compat.lowerings[op]._lychee_hybrid_decode = True   # register_lowering stores a wrapper: mark it
    _registration["registered"] = True


def unregister() -> None:
    from . import compat
    for op, prev in _registration["previous"].items():
        if prev is None:
            compat.lowerings.pop(op, None)
        else:
            compat.lowerings[op] = prev
    _registration["previous"] = {}
    _registration["registered"] = False


def is_registered() -> bool:
    from . import compat
    from .lower import OP
    return bool(getattr(compat.lowerings.get(OP), "_lychee_hybrid_decode", False))


__all__ = ["register", "unregister", "is_registered"]
