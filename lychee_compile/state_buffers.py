"""Install the cross-step state buffers on a compiled model (layout: ops/state.py) and keep them current.

lychee_compile() registers `_lychee_kinds` (always) and `_lychee_heat` (heat enabled) as non-persistent buffers,
marks them static for Dynamo (one address for the model's life: CUDA graphs replay against it), and wraps the
instance's forward so that every call announces them to the captured graph with lychee::bind_state, and every
prefill zeroes the heat (a new sequence starts with none).
"""
from __future__ import annotations

import functools

import torch

from .config import LycheeConfigError

KINDS_ATTR = "_lychee_kinds"
HEAT_ATTR = "_lychee_heat"


def install_state(model, config, kinds: torch.Tensor) -> None:
    """kinds: bool [Lg, Hkv], the head kinds of the global layers in layer order."""
    _register(model, KINDS_ATTR, kinds.to(device=model.device, dtype=torch.bool))
    if config.heat_blocks > 0:
        _register(model, HEAT_ATTR, torch.zeros(1, *kinds.shape, _heat_blocks(model, config), device=model.device))
    _wrap_forward(model)


def write_kinds(model, kinds: torch.Tensor) -> None:
    """Write new head kinds into the existing buffer, in place (same address, so no recompile / re-capture)."""
    buf = getattr(model, KINDS_ATTR)
    buf.copy_(kinds.to(device=buf.device, dtype=torch.bool))


def _register(model, attr: str, value: torch.Tensor) -> None:
    model.register_buffer(attr, value, persistent=False)
    torch._dynamo.mark_static_address(getattr(model, attr))


def _heat_blocks(model, config) -> int:
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if not max_pos:
        raise LycheeConfigError("heat needs model.config.max_position_embeddings to size its block buffer.")
    return -(-int(max_pos) // config.block_size)


def _wrap_forward(model) -> None:
    inner = model.forward

    @functools.wraps(inner)     # generate() reads forward's signature to decide what to pass (position_ids, ...)
    def forward(*args, **kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x
        heat = getattr(model, HEAT_ATTR, None)
        if heat is not None:
            _reset_heat(model, heat, batch=x.shape[0], prefill=x.shape[1] > 1)
            torch.ops.lychee.bind_state(getattr(model, HEAT_ATTR), "heat")
        torch.ops.lychee.bind_state(getattr(model, KINDS_ATTR), "kinds")
        return inner(*args, **kwargs)

    model.forward = forward


def _reset_heat(model, heat: torch.Tensor, batch: int, prefill: bool) -> None:
    if heat.shape[0] != batch:       # a new batch size: a new buffer (a new graph is compiled for it anyway)
        _register(model, HEAT_ATTR, torch.zeros(batch, *heat.shape[1:], device=heat.device))
    elif prefill:                    # a prefill: a new sequence starts with no heat
        heat.zero_()
