"""CUDA runtime of the deferred selection (ops/deferred_select.py): one side stream per device, the fork that
launches lychee_select_rows on it, and the join.

The fork: the side stream waits for the current stream (the combine that wrote the keys), runs the kernel, and
records an event, kept under (device, address of the index state). The join (index_ready): the current stream
waits for that event. Captured in a CUDA graph (cudagraph trees), the pair becomes two parallel branches that
meet at the join; eager, the same calls overlap the streams. The side stream has the highest priority so that its
one program per selecting head gets an SM while the main stream's products fill the GPU.
"""
from __future__ import annotations

import torch

from .template import launch_select, selection_constexprs

_SIDE: dict[int, torch.cuda.Stream] = {}
_PENDING: dict[tuple[int, int], torch.cuda.Event] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        high = torch.cuda.Stream.priority_range()[1] if hasattr(torch.cuda.Stream, "priority_range") else -1
        _SIDE[index] = torch.cuda.Stream(device=index, priority=high)
    return _SIDE[index]


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
