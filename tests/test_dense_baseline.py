"""attention="flash_dense": the dense speed baseline (not lychee). The rewritten model must equal the dense model, the
pass must have replaced every global site by lychee::dense_decode, and on CUDA the FlashAttention varlen path must
equal the op's reference for left-padded rows."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import LycheeConfig, LycheeConfigError
from lychee_compile.ops.dense_decode import dense_decode_reference
from tests.harness import EXACT_TOL, batch, compiled, generate_logits, max_logit_diff
from tests.models import make


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen2_gqa7", "eager"), ("gemma3", "sdpa")])
def test_flash_dense_model_matches_dense(arch, attn):
    ids, mask = batch(2)
    dense_seq, dense_logits = generate_logits(make(arch, attn), ids, mask, 5)
    model, state = compiled(arch, attn, attention="flash_dense")
    seq, logits = generate_logits(model, ids, mask, 5)
    assert state.counters.sites_rewritten >= len(state.global_layers) > 0
    snap = state.snapshots[0]
    assert snap.count(" dense_decode ") == len(state.global_layers) and "hybrid_decode" not in snap
    assert "idx_in" not in snap
    # every layer's op is given the valid ranges (computed once per graph: passes/rewrite.py shares the node)
    ops = [line for line in snap.splitlines() if " dense_decode " in line]
    assert all("ranges=valid_ranges(" in line for line in ops), ops[:1]
    assert max_logit_diff(logits, dense_logits) < EXACT_TOL and torch.equal(seq, dense_seq)


def test_flash_dense_refuses_sparse_options():
    with pytest.raises(LycheeConfigError, match="flash_dense"):
        LycheeConfig(attention="flash_dense", heat_blocks=2)
    with pytest.raises(LycheeConfigError, match="'hybrid' or 'flash_dense'"):
        LycheeConfig(attention="sparse")


def _varlen_semantics(rows, k_flat, v_flat, cu_q, cu_k, used, max_q, max_k, causal, scale):
    """FlashAttention-2 varlen's contract, written out on the CPU: sequence i's queries rows[cu_q[i]:cu_q[i+1]] attend
    keys cu_k[i] ... cu_k[i] + used[i] - 1, causal aligned to the last key; a sequence with no key gives 0 and an
    infinite log-sum-exp."""
    outs, lses = [], []
    for i in range(len(used)):
        q = rows[cu_q[i]:cu_q[i + 1]].float()                              # [Lq, G, D]
        kk = k_flat[cu_k[i]:cu_k[i] + used[i], 0].float()                  # [u, D]
        vv = v_flat[cu_k[i]:cu_k[i] + used[i], 0].float()
        Lq, u = q.shape[0], kk.shape[0]
        scores = torch.einsum("lgd,ud->glu", q, kk) * scale
        if causal:
            allowed = torch.arange(u)[None, :] <= torch.arange(Lq)[:, None] + (u - Lq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        if u == 0:
            outs.append(torch.zeros(Lq, q.shape[1], q.shape[2]))
            lses.append(torch.full((q.shape[1], Lq), float("inf")))
            continue
        outs.append(torch.einsum("glu,ud->lgd", scores.softmax(-1), vv))
        lses.append(scores.logsumexp(-1))
    return torch.cat(outs).to(rows.dtype), torch.cat(lses, 1)


@pytest.mark.parametrize("segments", [1, 3, 16])
@pytest.mark.parametrize("L", [1, 5])
def test_key_segments_merge_to_the_reference(monkeypatch, segments, L):
    """The flash path's own logic on the CPU: the L queries' keys cut into segments (some short or empty), each a
    varlen sequence, merged by log-sum-exp, equal the reference (the kernel call itself: the GPU test below)."""
    import importlib
    dd = importlib.import_module("lychee_compile.ops.dense_decode")   # the module (the package exports the op)
    monkeypatch.setattr(dd, "KEY_SEGMENTS", segments)
    B, Hkv, G, T, D = 4, 2, 3, 40, 8
    g = torch.Generator().manual_seed(segments * 10 + L)
    q = torch.randn(B, Hkv * G, L, D, generator=g)
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, (lo, hi) in enumerate([(0, T), (7, 30), (10, 10 + L), (3, 3 + L + 2)]):   # prefix T - L ... 0 ... 2 keys
        valid[b, lo:hi] = True
    out = dd._flash_varlen(q, k, v, valid, D ** -0.5, attend=_varlen_semantics)
    ref = dense_decode_reference(q, k, v, valid, D ** -0.5)
    assert out.shape == ref.shape and (out - ref).abs().max() < 1e-5
    given = dd._flash_varlen(q, k, v, valid, D ** -0.5, attend=_varlen_semantics, ranges=dd.valid_ranges(valid))
    assert torch.equal(given, out)                   # the rewrite's once-per-graph ranges: the same sequences
    if L > 1:                                        # and its once-per-graph segment plan
        plan = dd.segment_plan(dd.valid_ranges(valid), Hkv, G, T, L, segments)
        assert torch.equal(dd._flash_varlen(q, k, v, valid, D ** -0.5, attend=_varlen_semantics, plan=plan), out)
    assert dd.valid_ranges(valid).tolist() == [[0, 7, 10, 3], [T, 30, 10 + L, 5 + L]]


def test_reencode_flash_path_launches_few_eager_ops():
    """Each eager op of the re-encode's L > 1 flash path is a kernel per layer per re-encode (a CUDA-graph node, or
    a host launch without graphs: ~1,500 at Llama-3-8B's 32 layers). Counted on the CPU (bf16 as on CUDA), the two
    FlashAttention calls left out: ops that are not views. With the plan the rewrite computes once per graph, the
    merge alone is left per layer: 56 ops before the metadata and the merge were folded, 46 after, 23 with the
    plan given (4 of them launch nothing: two _unsafe_view, two scalar_tensor), 24 computing it (lychee::segment_plan
    counts as one op here; its own ~25 run once per graph)."""
    import importlib
    from torch.utils._python_dispatch import TorchDispatchMode
    dd = importlib.import_module("lychee_compile.ops.dense_decode")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.paused = [], False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.paused and not func.is_view and torch.Tag.view_copy not in func.tags:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    counted = Ops()

    def attend(*args):
        counted.paused = True
        try:
            return _varlen_semantics(*args)
        finally:
            counted.paused = False
    B, Hkv, G, L, T, D = 2, 2, 2, 4, 64, 8
    q = torch.randn(B, Hkv * G, L, D).bfloat16()
    k, v = torch.randn(B, Hkv, T, D).bfloat16(), torch.randn(B, Hkv, T, D).bfloat16()
    valid = torch.ones(B, T, dtype=torch.bool)
    ranges = dd.valid_ranges(valid)
    with counted:
        out = dd._flash_varlen(q, k, v, valid, D ** -0.5, attend=attend, ranges=ranges)
    assert out.dtype == q.dtype and out.is_contiguous()
    assert (out.float() - dense_decode_reference(q, k, v, valid, D ** -0.5).float()).abs().max() < 2e-2
    assert len(counted.ops) <= 24, counted.ops       # the plan computed inside: one opaque op more
    plan = dd.segment_plan(ranges, Hkv, G, T, L, dd.KEY_SEGMENTS)
    counted.ops = []
    with counted:
        given = dd._flash_varlen(q, k, v, valid, D ** -0.5, attend=attend, plan=plan)
    assert torch.equal(given, out) and len(counted.ops) <= 23, "\n".join(counted.ops)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("G,D,L", [(4, 128, 1), (7, 64, 1), (1, 256, 1), (4, 128, 32), (7, 64, 5)])
def test_flash_varlen_matches_reference_gpu(G, D, L):
    # L > 1: rectification's re-encode (the L newest valid positions, causal among themselves)
    B, Hkv, T = 3, 2, 4096 + 33
    g = torch.Generator(device="cuda").manual_seed(G * D + L)
    q = torch.randn(B, L, Hkv * G, D, device="cuda", generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(B, Hkv, T, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, Hkv, T, D, device="cuda", generator=g).bfloat16()
    valid = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    for b, (lo, hi) in enumerate([(0, T), (901, T - 5), (17, 17 + L)]):      # the last row: only the queries
        valid[b, lo:hi] = True
    out = torch.ops.lychee.dense_decode(q, k, v, valid, D ** -0.5)
    ref = dense_decode_reference(q, k, v, valid, D ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.float() - ref.float()).abs().max() < 2e-2
    from lychee_compile.ops.dense_decode import valid_ranges
    assert torch.equal(torch.ops.lychee.dense_decode(q, k, v, valid, D ** -0.5, valid_ranges(valid)), out)
