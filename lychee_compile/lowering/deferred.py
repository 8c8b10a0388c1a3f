"""CUDA runtime of the deferred selection (ops/deferred_select.py): its kernel lychee_select_rows (select_kernel,
launch_select), one side stream per device, the fork that launches the kernel on it, and the join.

The fork: the side stream waits for the current stream (the combine that wrote the keys), runs the kernel, and
records an event, kept under (device, address of the index state). The join (index_ready): the current stream
waits for that event. Captured in a CUDA graph (cudagraph trees), the pair becomes two parallel branches that
meet at the join; eager, the same calls overlap the streams. The side stream has the highest priority so that its
one program per selecting head gets an SM while the main stream's products fill the GPU.
"""
from __future__ import annotations

import functools

import torch

from .constexprs import SELECT_CONSTEXPRS, selection_constexprs
from .kernel_module import load_module
from .kernel_source import SELECT_SOURCE

_SIDE: dict[int, torch.cuda.Stream] = {}
_PENDING: dict[tuple[int, int], torch.cuda.Event] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        high = torch.cuda.Stream.priority_range()[1] if hasattr(torch.cuda.Stream, "priority_range") else -1
        _SIDE[index] = torch.cuda.Stream(device=index, priority=high)
    return _SIDE[index]


@functools.lru_cache(maxsize=None)
def select_kernel():
    """The deferred selection's @triton.jit kernel lychee_select_rows (kernels/select_rows.py.jinja plus the
    selection helpers), loaded from a file (Triton's JIT needs the source on disk)."""
    return load_module("select", SELECT_SOURCE).lychee_select_rows


def launch_select(keys, rowlo, rowhi, tvp, retr8, sel8, idx_out, cp: dict, num_warps: int = 16):
    """lychee_select_rows over grid (B * Hkv,) with the combine's constexprs `cp` (kernel_params).
    keys int32 [B, Hkv, NB] contiguous; idx_out int32 [B, Hkv, K] (any strides)."""
    B, Hkv, nb = keys.shape
    select_kernel()[(B * Hkv,)](keys, rowlo, rowhi, tvp, retr8, sel8, idx_out, nb, *idx_out.stride(),
                                **{c: cp[c] for c in SELECT_CONSTEXPRS}, num_warps=num_warps, num_stages=1)


def launch_select_rows(keys, idx, rowlo, rowhi, tvp, retrieval, select, block_size, group, policy, policy_param,
                       nb_hint):
    cp = selection_constexprs(G=group, Hkv=keys.shape[1], K_sel=idx.shape[-1], block_size=block_size,
                              nb_hint=nb_hint, policy=policy, policy_param=policy_param)
    main = torch.cuda.current_stream(keys.device)
    side = side_stream(keys.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        launch_select(keys, rowlo, rowhi, tvp, retrieval, select, idx, cp)
        done = torch.cuda.Event()
        done.record(side)
    _PENDING[(keys.device.index, idx.data_ptr())] = done


def wait_select_rows(idx) -> None:
    done = _PENDING.pop((idx.device.index, idx.data_ptr()), None)
    if done is not None:
        torch.cuda.current_stream(idx.device).wait_event(done)
