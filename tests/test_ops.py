"""The op contract: opcheck (schema, fake impl, autograd registration), and properties of the eager reference."""
from __future__ import annotations

import math

import pytest
import torch

from lychee_compile.ops import EMPTY, empty_index_state, hybrid_decode_op

OP = hybrid_decode_op()


def inputs(B=2, hkv=2, G=3, T=37, D=16, K=3, dtype=torch.float32, seed=0, pads=(0, 5), lengths=(30, 30)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hkv * G, 1, D, generator=g).to(dtype)
    k = torch.randn(B, hkv, T, D, generator=g).to(dtype)
    v = torch.randn(B, hkv, T, D, generator=g).to(dtype)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        valid[b, pads[b]:lengths[b]] = True
    idx = empty_index_state(B, hkv, K, "cpu")
    return q, k, v, valid, idx


@pytest.mark.parametrize("retrieval", [[True, True], [True, False], [False, False]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(retrieval, dtype):
    q, k, v, valid, idx = inputs(dtype=dtype)
    idx[:, :, 0] = 2
    torch.library.opcheck(OP, (q, k, v, valid, torch.tensor(retrieval), idx, 0.25, 4, 4, 4))


def test_opcheck_with_select():
    q, k, v, valid, idx = inputs(dtype=torch.bfloat16)
    idx[:, :, 0] = 2
    torch.library.opcheck(OP, (q, k, v, valid, torch.tensor([True, False]), idx, 0.25, 4, 4, 4, 0, 0.0, 0, 0,
                               torch.tensor([False, True])))


def test_select_empties_only_unread_retrieval_rows():
    # `select` changes nothing but the index rows of retrieval heads outside it (EMPTY): outputs are identical
    q, k, v, valid, idx = inputs(hkv=3)
    idx[:, :, 0] = 2
    retr = torch.tensor([True, True, False])
    out, full = OP(q, k, v, valid, retr, idx, 0.25, 4, 4, 4)
    out2, part = OP(q, k, v, valid, retr, idx, 0.25, 4, 4, 4, 0, 0.0, 0, 0, torch.tensor([False, True, True]))
    assert torch.equal(out, out2)
    assert (part[:, 0] == EMPTY).all() and (full[:, 0] != EMPTY).any()
    assert torch.equal(part[:, 1:], full[:, 1:])


def test_all_retrieval_is_dense_sdpa():
    q, k, v, valid, idx = inputs()
    out, _ = OP(q, k, v, valid, torch.tensor([True, True]), idx, 0.25, 4, 4, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                           attn_mask=valid[:, None, None, :], scale=0.25)
    assert (out - ref).abs().max() < 1e-5


def test_selection_layout_and_padding_never_selected():
    q, k, v, valid, idx = inputs(K=3)
    _, sel = OP(q, k, v, valid, torch.tensor([True, True]), idx, 0.25, 4, 4, 4)
    assert sel.dtype == torch.int32 and sel.shape == (2, 2, 3)
    for b in range(2):
        for h in range(2):
            row = [x for x in sel[b, h].tolist() if x != EMPTY]
            assert row == sorted(set(row)) and len(row) == 3
            first_valid = int(valid[b].nonzero()[0])
            assert all((blk + 1) * 4 > first_valid for blk in row)        # no all-padding block
            assert 0 not in row or first_valid >= 4                         # sink block (first valid) excluded


def test_sparse_head_copies_state_and_attends_only_its_blocks():
    q, k, v, valid, idx = inputs(B=1, pads=(0,), lengths=(36,), K=2)
    idx[0, :, 0], idx[0, :, 1] = 3, EMPTY
    out, out_idx = OP(q, k, v, valid, torch.tensor([False, False]), idx, 0.25, 4, 0, 0)
    assert torch.equal(out_idx, idx)
    keep = torch.zeros_like(valid)
    keep[0, 12:16] = True                                  # block 3 only (no sink/local)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                           attn_mask=keep[:, None, None, :], scale=0.25)
    assert (out - ref).abs().max() < 1e-5


def test_fewer_candidates_than_budget_selects_all_and_pads_empty():
    q, k, v, valid, idx = inputs(B=1, pads=(0,), lengths=(12,), K=5)
    _, sel = OP(q, k, v, valid, torch.tensor([True, True]), idx, 0.25, 4, 0, 0)
    assert sel[0, 0].tolist() == [0, 1, 2, EMPTY, EMPTY]


def test_ties_go_to_the_lower_block():
    q, k, v, valid, idx = inputs(B=1, pads=(0,), lengths=(32,), K=2)
    k.zero_()     # every score equal -> every block ties
    _, sel = OP(q, k, v, valid, torch.tensor([True, True]), idx, 0.25, 4, 0, 0)
    assert sel[0, 0].tolist() == [0, 1]


def test_query_length_other_than_one_is_rejected():
    q, k, v, valid, idx = inputs()
    with pytest.raises(ValueError, match="query length 1"):
        OP(torch.cat([q, q], 2), k, v, valid, torch.tensor([True, True]), idx, 0.25, 4, 4, 4)


def test_num_select_is_budget_over_block_rounded_up():
    from lychee_compile import LycheeConfig
    assert LycheeConfig(budget=100, block_size=16).num_select == math.ceil(100 / 16)


# --- lychee::dense_decode (the dense speed baseline, attention="flash_dense") -------------------------------------
DENSE = torch.ops.lychee.dense_decode.default


def _queries(q, L):
    """q [B, Hq, 1, D] -> [B, Hq, L, D] (L queries: rectification's re-encode), not contiguous (as a model's)."""
    g = torch.Generator().manual_seed(L)
    B, Hq, _, D = q.shape
    return torch.randn(B, L, Hq, D, generator=g).to(q.dtype).transpose(1, 2)


@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_decode_opcheck(dtype, L):
    q, k, v, valid, _ = inputs(dtype=dtype)
    torch.library.opcheck(DENSE, (_queries(q, L), k, v, valid, 0.25))
    ranges = torch.ops.lychee.valid_ranges(valid)
    torch.library.opcheck(DENSE, (_queries(q, L), k, v, valid, 0.25, ranges))
    plan = torch.ops.lychee.segment_plan(ranges, k.shape[1], q.shape[1] // k.shape[1], k.shape[2], L, 2)
    torch.library.opcheck(DENSE, (_queries(q, L), k, v, valid, 0.25, ranges, plan))


def test_segment_plan_opcheck_and_pieces():
    # rows (b, h): b's range [2, 30) and [0, 9) with 2 KV heads, T 40, L 4 queries, 3 segments of the prefix before
    # them (24 and 5 keys: segments of 8, 8, 8 and 2, 2, 1)
    from lychee_compile.ops.dense_decode import plan_parts
    ranges = torch.tensor([[2, 0], [30, 9]], dtype=torch.int32)
    args = (ranges, 2, 3, 40, 4, 3)
    torch.library.opcheck(torch.ops.lychee.segment_plan.default, args)
    parts = plan_parts(torch.ops.lychee.segment_plan(*args), 4)
    assert parts["seg_used"].tolist() == [8, 8, 8] * 2 + [2, 2, 1] * 2
    assert parts["seg_cu_k"].tolist() == [2, 10, 18, 42, 50, 58, 80, 82, 84, 120, 122, 124, 124]
    assert parts["seg_cu_q"].tolist() == list(range(0, 13 * 12, 12))            # L * G = 12 rows a segment
    assert parts["own_cu_k"].tolist() == [26, 66, 85, 125, 125] and parts["own_used"].tolist() == [4] * 4
    assert parts["own_cu_q"].tolist() == [0, 4, 8, 12, 16]
    assert parts["keys"].tolist() == [[8, 8, 8, 4]] * 2 + [[2, 2, 1, 4]] * 2


def test_valid_ranges_opcheck():
    _, _, _, valid, _ = inputs()
    valid = torch.cat([valid, valid.roll(-5, 1)])                    # rows ending before T too
    torch.library.opcheck(torch.ops.lychee.valid_ranges.default, (valid,))
    ends = [int(torch.nonzero(row).max()) + 1 for row in valid]
    starts = [int(torch.nonzero(row).min()) for row in valid]
    assert torch.ops.lychee.valid_ranges(valid).tolist() == [starts, ends]


@pytest.mark.parametrize("L", [1, 4])
def test_dense_decode_is_masked_sdpa(L):
    # the L queries are each row's L newest valid positions: causal among themselves, every earlier valid key
    q, k, v, valid, _ = inputs()
    q = _queries(q, L)
    out = DENSE(q, k, v, valid, 0.25)
    pos = torch.arange(valid.shape[1])
    end = torch.tensor([30, 30])                                     # inputs(): valid [pad, 30) in both rows
    own = end[:, None] - L + torch.arange(L)                         # [B, L]
    mask = valid[:, None, :] & (pos <= own[:, :, None])              # [B, L, T]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                           attn_mask=mask[:, None], scale=0.25)
    assert out.is_contiguous() and (out - ref).abs().max() < 1e-5


# --- lychee::hybrid_decode_mass (extra blocks for sparse heads + per-block mass: heat and Quest build on it) -------
MASS = torch.ops.lychee.hybrid_decode_mass.default


def _extra(B, hkv, rows):
    return torch.tensor(rows, dtype=torch.int32).expand(B, hkv, len(rows)).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_decode_mass_opcheck(dtype):
    q, k, v, valid, idx = inputs(dtype=dtype)
    idx[:, :, 0] = 2
    torch.library.opcheck(MASS, (q, k, v, valid, torch.tensor([True, False]), idx, _extra(2, 2, [4, EMPTY]), 0.25,
                                 4, 4, 4))


def test_mass_op_without_extra_equals_hybrid_decode_and_mass_is_its_probabilities():
    q, k, v, valid, idx = inputs(hkv=3)
    idx[:, :, 0] = 3
    retr = torch.tensor([True, False, False])
    out, sel = OP(q, k, v, valid, retr, idx, 0.25, 4, 4, 4)
    out2, sel2, mass = MASS(q, k, v, valid, retr, idx, _extra(2, 3, [EMPTY, EMPTY]), 0.25, 4, 4, 4)
    assert torch.equal(out, out2) and torch.equal(sel, sel2)
    assert mass.shape == (2, 3, 10) and mass.dtype == torch.float32
    # every head's probabilities sum to 1 per query head: G = 3 per KV head
    assert torch.allclose(mass.sum(-1), torch.full((2, 3), 3.0), atol=1e-5)
    # a sparse head puts mass only on sink (block 0 / first valid), local and inherited blocks (3)
    attended = mass[:, 1:] > 0
    assert attended[..., 3].all() and not attended[0, :, 5].any()


def test_extra_blocks_are_attended_by_sparse_heads_only_and_not_passed_on():
    q, k, v, valid, idx = inputs(hkv=2)
    retr = torch.tensor([True, False])
    _, sel0, m0 = MASS(q, k, v, valid, retr, idx, _extra(2, 2, [EMPTY]), 0.25, 4, 4, 4)
    out, sel, m = MASS(q, k, v, valid, retr, idx, _extra(2, 2, [4]), 0.25, 4, 4, 4)
    assert (m0[:, 1, 4] == 0).all() and (m[:, 1, 4] > 0).all()          # the sparse head now attends block 4
    assert torch.equal(m[:, 0], m0[:, 0])                                # the retrieval head is unchanged
    assert torch.equal(sel, sel0)                                        # extra picks never reach idx_out
    # the same as inheriting block 4 for that layer (text-relative: row 1's local blocks are 5 and 6)
    idx5 = idx.clone()
    idx5[:, :, 0] = 4
    out5, _ = OP(q, k, v, valid, retr, idx5, 0.25, 4, 4, 4)
    assert torch.equal(out, out5)
