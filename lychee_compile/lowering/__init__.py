"""Inductor lowering of `torch.ops.lychee.hybrid_decode` to generated Triton kernels (issue 4).

    from lychee_compile.lowering import register
    register()          # idempotent; call before torch.compile(..., backend="inductor") compiles the graph

After `register()`, every `lychee::hybrid_decode` node that Inductor compiles for CUDA (or for CPU with
`torch._inductor.config.cpu_backend = "triton"`, tests only) with bf16/fp16 q/k/v becomes two Triton kernels
(split + combine/select, see template.py; every selection policy); anything else (fp32, other devices, Quest modes)
keeps the eager reference as an extern kernel. `unregister()` restores the default (extern) handling.
"""
from __future__ import annotations

_state = {"registered": False, "previous": None}


def register() -> None:
    from . import compat
    from .lower import OP, hybrid_decode_lowering
    if is_registered():
        return
    _state["previous"] = compat.lowerings.get(OP)
    compat.register_lowering(OP, type_promotion_kind=None)(hybrid_decode_lowering)
    compat.lowerings[OP]._lychee_hybrid_decode = True   # register_lowering stores a wrapper: mark it
    _state["registered"] = True


def unregister() -> None:
    from . import compat
    from .lower import OP
    prev = _state["previous"]
    if prev is None:
        compat.lowerings.pop(OP, None)
    else:
        compat.lowerings[OP] = prev
    _state["registered"] = False


def is_registered() -> bool:
    from . import compat
    from .lower import OP
    return bool(getattr(compat.lowerings.get(OP), "_lychee_hybrid_decode", False))


__all__ = ["register", "unregister", "is_registered"]
