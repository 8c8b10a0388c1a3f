"""The hybrid decode Triton kernels (lychee_compile/lowering/kernels/, launched by lowering/standalone.py) against the
eager reference.

CPU: TRITON_INTERPRET=1 (set before triton is imported) runs the kernels on CPU tensors, small shapes.
GPU (@pytest.mark.gpu): the same checks on CUDA at a realistic size.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must happen before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from lychee_compile.ops.reference import (block_any, block_sum, hybrid_decode_reference, masked_softmax,  # noqa: E402
                                          sink_local_blocks)
from lychee_compile.ops.index_state import empty_index_state  # noqa: E402
from lychee_compile.ops.policies import RANK_DROP_BITS, rank_score  # noqa: E402
from lychee_compile.lowering.constexprs import interpreting, kernel_params  # noqa: E402
from lychee_compile.lowering.standalone import hybrid_decode_triton  # noqa: E402

ON_CPU = interpreting()


def reference_block_scores(q, k, valid, scale, block_size):
    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G = Hq // Hkv
    nb = -(-T // block_size)
    s = torch.einsum("bhgd,bhtd->bhgt", q.float().reshape(B, Hkv, G, D), k.float()) * scale
    p = masked_softmax(s, valid[:, None, None, :])
    return block_sum(p.sum(dim=2), block_size, nb)


def make_case(B, Hkv, G, D, T, dtype, block_size, K, sink, local, pads, retr, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(device)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, (lo, hi) in enumerate(pads):
        valid[b, lo:hi] = True
    valid = valid.to(device)
    retrieval = torch.tensor(retr, dtype=torch.bool, device=device)
    # a realistic index state: what an all-retrieval layer selects on other data
    q0 = torch.randn(B, Hkv * G, 1, D, generator=g).to(dtype).to(device)
    _, idx_in = hybrid_decode_reference(q0, k, v, valid, torch.ones(Hkv, dtype=torch.bool, device=device),
                                        empty_index_state(B, Hkv, K, device), 0.5, block_size, sink, local)
    return q, k, v, valid, retrieval, idx_in


def check(q, k, v, valid, retrieval, idx_in, scale, block_size, sink, local, policy=0, policy_param=0.0,
          exact_idx=False, **kw):
    """Kernel vs reference. exact_idx: index states must be equal; otherwise only a tie at the threshold may differ."""
    if q.device.type == "cpu" and not ON_CPU:
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1, set on machines without CUDA)")
    out, idx_out = hybrid_decode_triton(q, k, v, valid, retrieval, idx_in, scale, block_size, sink, local,
                                        policy=policy, policy_param=policy_param, **kw)
    sel = kw.get("select")
    ref_out, ref_idx = hybrid_decode_reference(q.cpu(), k.cpu(), v.cpu(), valid.cpu(), retrieval.cpu(), idx_in.cpu(),
                                               scale, block_size, sink, local, policy, policy_param,
                                               select=None if sel is None else sel.cpu())
    out, idx_out = out.cpu(), idx_out.cpu()
    assert torch.isfinite(out.float()).all()
    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-12)).item()
    assert err < 1.5e-2, err
    assert (out.float() - ref_out.float()).abs().max().item() < 5e-2
    assert_same_selection(idx_out, ref_idx, q, k, valid, retrieval, scale, block_size, exact_idx, policy,
                          policy_param)
    return out, idx_out


def assert_same_selection(idx_out, ref_idx, q, k, valid, retrieval, scale, block_size, exact_idx=False, policy=0,
                          policy_param=0.0):
    """Index states equal, except (exact_idx False) where the reference's scores tie at the selection threshold."""
    mismatch = idx_out != ref_idx
    assert not (exact_idx and mismatch.any()), (policy, policy_param, idx_out, ref_idx)
    if mismatch.any():
        # allowed only where the reference's scores tie (to fp32 rounding) at the selection threshold
        sc = reference_block_scores(q.cpu(), k.cpu(), valid.cpu(), scale, block_size)
        B, Hkv, _ = idx_out.shape
        for b in range(B):
            for h in range(Hkv):
                if not mismatch[b, h].any():
                    continue
                assert bool(retrieval[h]), "sparse head must copy idx_in through"
                a = set(idx_out[b, h].tolist()) - {-1}
                r = set(ref_idx[b, h].tolist()) - {-1}
                assert len(a) == len(r)
                assert sorted(idx_out[b, h].tolist()[:len(a)]) == idx_out[b, h].tolist()[:len(a)]
                diff = sorted(a ^ r)
                vals = sc[b, h, diff]
                assert (vals.max() - vals.min()).item() <= 1e-5 * max(vals.abs().max().item(), 1e-30), (diff, vals)


CASES = [
    # B, Hkv, G, D, T, dtype, bs, K, sink, local, pads, retr, num_splits
    (1, 2, 1, 64, 160, torch.bfloat16, 16, 3, 16, 32, [(0, 160)], [True, False], 5),
    (2, 2, 2, 64, 300, torch.float16, 16, 4, 16, 32, [(0, 300), (37, 290)], [False, True], 7),
    (2, 3, 3, 64, 200, torch.bfloat16, 16, 4, 8, 16, [(5, 200), (60, 200)], [True, False, True], 3),
    (1, 2, 4, 128, 256, torch.bfloat16, 16, 6, 16, 64, [(0, 256)], [True, False], 1),
    (2, 2, 7, 64, 192, torch.bfloat16, 16, 3, 16, 32, [(0, 192), (100, 170)], [False, True], 64),
    (1, 2, 8, 64, 256, torch.float16, 32, 3, 16, 32, [(3, 250)], [True, True], 4),
    (1, 2, 2, 256, 128, torch.bfloat16, 16, 2, 16, 16, [(0, 128)], [True, False], 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}G{c[2]}D{c[3]}T{c[4]}{str(c[5])[6:]}")
def test_kernel_matches_reference(case):
    B, Hkv, G, D, T, dtype, bs, K, sink, local, pads, retr, ns = case
    args = make_case(B, Hkv, G, D, T, dtype, bs, K, sink, local, pads, retr)
    check(*args, D ** -0.5, bs, sink, local, num_splits=ns)


# head dims that are no power of two (Phi-2 80, Phi-3 96) or below the tile minimum (8): the kernels pad the head dim
# to DP lanes inside (constexprs.head_dim_tile), strides and buffers keep the true D
PADDED_HEAD_DIMS = [(80, torch.bfloat16), (80, torch.float16), (96, torch.bfloat16), (96, torch.float16),
                    (8, torch.bfloat16)]


@pytest.mark.parametrize("D,dtype", PADDED_HEAD_DIMS, ids=lambda x: str(x)[6:] if isinstance(x, torch.dtype) else f"D{x}")
def test_kernel_padded_head_dim(D, dtype):
    # rows of different extents, a retrieval and a sparse head, GQA 3; poisoned outputs: every lane < D is written
    from lychee_compile.lowering.constexprs import head_dim_tile
    _, cp = kernel_params(G=3, Hkv=2, D=D, K_sel=4, block_size=16, sink_tokens=16, local_tokens=32, scale=0.1,
                          num_splits=5, nb_hint=13)
    assert cp["D"] == D and cp["DP"] == head_dim_tile(D) > D
    args = make_case(2, 2, 3, D, 200, dtype, 16, 4, 16, 32, [(0, 200), (30, 190)], [True, False], seed=D)
    out = torch.full_like(args[0], float("nan"))
    check(*args, D ** -0.5, 16, 16, 32, num_splits=5, out=out)


def test_kernel_chunked_selection_path():
    # NB > NBR forces the looped (scratch-memory) top-k path; block_n=32 exercises a different tile
    args = make_case(2, 2, 2, 64, 400, torch.bfloat16, 16, 5, 16, 32, [(0, 400), (21, 391)], [True, False], seed=3)
    check(*args, 0.125, 16, 16, 32, num_splits=6, nbr_max=16, block_n=32)


@pytest.mark.parametrize("tiers", [(32, 64), (16, 32), (8, 16)], ids=["tier1", "tier2", "tier3"])
def test_kernel_selection_width_tiers(tiers):
    # 25 blocks of keys: tiers (32, 64) hold them in the narrowest register row, (16, 32) in the middle one, (8, 16)
    # in the widest (NBR = 32); the radix select's result must not depend on the width
    _, cp = kernel_params(G=2, Hkv=2, D=64, K_sel=5, block_size=16, sink_tokens=16, local_tokens=32, scale=0.125,
                          num_splits=6, nb_hint=25, nbr_max=32, select_tiers=tiers)
    assert (cp["NR1"], cp["NR2"], cp["NRT"], cp["NBR"]) == (min(tiers[0], 32), min(tiers[1], 32),
                                                             min(tiers[1], 32) // 8, 32)
    args = make_case(2, 2, 2, 64, 400, torch.bfloat16, 16, 5, 16, 32, [(0, 400), (21, 391)], [True, False], seed=4)
    check(*args, 0.125, 16, 16, 32, num_splits=6, nbr_max=32, select_tiers=tiers)


@pytest.mark.parametrize("nb_hint, nbr", [(8192, 8192), (8208, 8192), (9216, 8192), (9217, 16384), (20000, 16384)])
def test_widest_register_tier_only_where_the_cache_can_need_it(nb_hint, nbr):
    # a 128K + 256 token cache (8,208 blocks) never outgrows NR2 + its tail (8,192 + 1,024): the 16,384-key register
    # tier is left out of the kernel (compiled in, it alone capped the 16-warp combine's registers and made it spill)
    _, cp = kernel_params(G=4, Hkv=8, D=128, K_sel=256, block_size=16, sink_tokens=16, local_tokens=64, scale=0.1,
                          num_splits=264, nb_hint=nb_hint)
    assert (cp["NR2"], cp["NRT"], cp["NBR"]) == (8192, 1024, nbr)


@pytest.mark.parametrize("block_n", [16, 64])
def test_kernel_blse_by_masked_sums(block_n):
    # the BLSE_SUMS=1 tuning variant (per-block masked row sums instead of a reshape) computes the same block scores
    args = make_case(2, 2, 4, 64, 300, torch.bfloat16, 16, 4, 16, 32, [(0, 300), (45, 290)], [True, False], seed=13)
    check(*args, 0.125, 16, 16, 32, num_splits=5, block_n=block_n, blse_sums=1)


@pytest.mark.parametrize("cost,splits", [(2, 5), (3, 7), (4, 64)])
def test_kernel_sparse_tile_cost(cost, splits):
    # weighting gathered tiles in the work pool moves the cut between splits, never the result
    args = make_case(2, 3, 3, 64, 300, torch.float16, 16, 5, 16, 32, [(0, 300), (41, 280)], [False, True, False],
                     seed=19)
    check(*args, 0.125, 16, 16, 32, num_splits=splits, sparse_cost=cost)


@pytest.mark.parametrize("sparse_bn,block_n", [(None, 64), (32, 16), (64, 32), (128, 64)])
def test_kernel_wide_gathered_tiles(sparse_bn, block_n):
    # gathered tiles wider than streamed ones (SBN > BLOCK_N: more K/V bytes in flight per index round trip) cut the
    # sparse segments differently, never the result
    args = make_case(2, 3, 3, 64, 300, torch.bfloat16, 16, 5, 16, 32, [(0, 300), (41, 280)], [False, True, False],
                     seed=23)
    check(*args, 0.125, 16, 16, 32, num_splits=7, block_n=block_n, sparse_bn=sparse_bn, sparse_cost=3)


def test_kernel_unread_selection_is_skipped():
    # a retrieval head whose selection nobody reads (select False) writes an EMPTY row; the others are unchanged
    args = make_case(2, 3, 2, 64, 200, torch.bfloat16, 16, 4, 16, 32, [(0, 200), (30, 190)], [True, True, False],
                     seed=17)
    select = torch.tensor([False, True, True])
    out, idx = check(*args, 0.125, 16, 16, 32, num_splits=4, select=select)
    assert (idx[:, 0] == -1).all() and (idx[:, 1] >= 0).any()


def test_kernel_no_sink_no_local_and_empty_row():
    args = make_case(2, 2, 2, 64, 128, torch.bfloat16, 16, 3, 0, 0, [(0, 128), (0, 0)], [True, False], seed=5)
    out, idx = check(*args, 0.125, 16, 0, 0, num_splits=3)
    assert (out[1].float() == 0).all()
    assert (idx[1, 0] == -1).all()


def test_kernel_rows_far_shorter_than_the_cache():
    # a static cache much longer than every row (the usual decode case): work and selection stop at the longest row
    # end (TVP); the block-score workspace beyond it holds NaN poison that must never be read
    from lychee_compile.lowering import standalone
    args = make_case(2, 2, 2, 64, 512, torch.bfloat16, 16, 3, 16, 16, [(0, 70), (5, 33)], [True, False], seed=9)
    ws = standalone.workspace(2, 2, 2, 64, 512, 16, 3, args[0].device)
    for name in ("BLSE", "PM", "PL", "PACC"):
        ws[name].fill_(float("nan"))
    out, idx = check(*args, 0.125, 16, 16, 16, num_splits=3, ws=ws)
    assert idx.max() < 70 // 16 + 1
    ext = standalone.row_extent(args[3])
    assert ext["ROWLO"].tolist() == [0, 5] and ext["ROWHI"].tolist() == [70, 33] and ext["TVP"].tolist() == [70]


def test_kernel_fewer_candidates_than_slots():
    # short row: fewer candidate blocks than K -> all candidates, EMPTY padded
    args = make_case(1, 2, 2, 64, 128, torch.bfloat16, 16, 8, 16, 32, [(40, 128)], [True, False], seed=7)
    out, idx = check(*args, 0.125, 16, 16, 32, num_splits=2)
    assert (idx[0, 0] == -1).any()


def test_kernel_head_map_is_runtime_data():
    # one kernel configuration serves two different head maps (no recompilation keyed on `retrieval`)
    from lychee_compile.lowering import standalone
    before = standalone._standalone.cache_info().currsize
    for retr in ([True, False, False, True], [False, True, True, False]):
        args = make_case(1, 4, 2, 64, 128, torch.bfloat16, 16, 2, 16, 16, [(0, 128)], retr, seed=11)
        check(*args, 0.125, 16, 16, 16, num_splits=4)
    assert standalone._standalone.cache_info().currsize - before <= 2


# selection policies: every policy at several parameter values, on one case per dtype and group size
POLICY_PARAMS = [("topp", 0.3), ("topp", 0.6), ("topp", 0.9), ("threshold", 0.01), ("threshold", 0.05),
                 ("ratio", 0.1), ("ratio", 0.3), ("ratio", 1.0)]


def check_policies(args, scale, bs, sink, local, **kw):
    """Every policy of POLICY_PARAMS on one case, outputs poisoned first; index states must equal the reference's.
    Returns how many blocks each (policy, row, head) kept, so callers can see the policies really differ."""
    from lychee_compile.ops.policies import POLICIES
    q, idx_in = args[0], args[5]
    kept = {}
    for name, param in POLICY_PARAMS:
        out = torch.full_like(q, float("nan"))
        idx_out = torch.full_like(idx_in, 7777)
        _, idx = check(*args, scale, bs, sink, local, POLICIES[name], param, exact_idx=True, out=out,
                       idx_out=idx_out, **kw)
        kept[name, param] = (idx >= 0).sum(-1)
    return kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("G", [1, 3, 4])
def test_kernel_policies_match_reference(G, dtype):
    # 16 blocks of 16, left padding in row 1; a sharp-ish score (scale 0.3) so masses differ between blocks
    args = make_case(2, 2, G, 64, 256, dtype, 16, 8, 16, 32, [(0, 256), (37, 246)], [True, False], seed=G)
    kept = check_policies(args, 0.3, 16, 16, 32, num_splits=5)
    retr_kept = torch.stack([n[:, 0] for n in kept.values()])
    assert (retr_kept < 8).any() and (retr_kept > 0).any() and len(set(retr_kept.flatten().tolist())) > 3
    assert (kept["ratio", 0.1][:, 0] == torch.tensor([2, 2])).all()      # ceil(.1 * 16), ceil(.1 * 14)


def test_kernel_policies_padded_head_dim():
    # the selection reads block scores only, but they come from the padded head dim's dots
    args = make_case(2, 2, 2, 96, 256, torch.bfloat16, 16, 8, 16, 32, [(0, 256), (37, 246)], [True, False], seed=9)
    kept = check_policies(args, 0.3, 16, 16, 32, num_splits=5)
    assert len({tuple(n[:, 0].tolist()) for n in kept.values()}) > 1, kept


def test_kernel_policies_chunked_selection_path():
    # NB > NBR: the policies' passes walk the keys in NBR chunks (and a short cache row 1)
    args = make_case(2, 2, 3, 64, 400, torch.bfloat16, 16, 12, 16, 32, [(0, 400), (21, 391)], [True, True], seed=3)
    check_policies(args, 0.3, 16, 16, 32, num_splits=6, nbr_max=16, block_n=32)


def test_kernel_policies_empty_row_and_no_sink_local():
    # an empty row keeps nothing under every policy; without sink/local blocks topp's fixed mass is 0
    args = make_case(2, 2, 2, 64, 128, torch.float16, 16, 5, 0, 0, [(0, 128), (0, 0)], [True, False], seed=5)
    kept = check_policies(args, 0.3, 16, 0, 0, num_splits=3)
    assert all((n[1] == 0).all() for n in kept.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or ON_CPU, reason="needs CUDA (and TRITON_INTERPRET unset)")
@pytest.mark.parametrize("G,D", [(4, 128), (1, 64), (7, 128), (8, 256)])
def test_kernel_gpu(G, D):
    T = 8192 + 77
    args = make_case(2, 4, G, D, T, torch.bfloat16, 16, 64, 16, 64, [(0, T), (901, T)],
                     [True, False, False, True], device="cuda")
    check(*args, D ** -0.5, 16, 16, 64)


def tie_case(K):
    """Identical keys -> every full candidate block has exactly the same score. Valid positions [8, 256) in blocks
    of 16 counted from position 8 (text-relative): block 0 holds the 16 sink tokens, 13-15 the 32 local ones (15 is
    half full), candidates 1..12 each hold mass 16/248."""
    B, Hkv, G, D, T = 1, 2, 2, 64, 256
    q = torch.randn(B, Hkv * G, 1, D).to(torch.bfloat16)
    k = torch.randn(1, 1, 1, D).expand(B, Hkv, T, D).contiguous().to(torch.bfloat16)
    v = torch.randn(B, Hkv, T, D).to(torch.bfloat16)
    valid = torch.zeros(B, T, dtype=torch.bool)
    valid[:, 8:] = True
    retr = torch.tensor([True, False])
    return q, k, v, valid, retr, torch.full((B, Hkv, K), -1, dtype=torch.int32)


def test_kernel_ties_prefer_lower_blocks():
    out, idx = check(*tie_case(4), 0.125, 16, 16, 32, num_splits=3)
    # the lower candidates win the tie
    assert idx[0, 0].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("policy,param,want", [(1, 0.6, [1, 2, 3, 4, 5, 6]), (2, 0.05, list(range(1, 9))),
                                               (3, 0.3, [1, 2, 3, 4, 5])], ids=["topp", "threshold", "ratio"])
def test_kernel_policies_ties_prefer_lower_blocks(policy, param, want):
    # topp: fixed mass 56/248, need .374 -> 6 tied blocks (far from a boundary); threshold: all 12 pass, capped at
    # K = 8; ratio: ceil(.3 * 16 valid blocks) = 5. Ties: the lower blocks.
    out, idx = check(*tie_case(8), 0.125, 16, 16, 32, policy, param, exact_idx=True, num_splits=3)
    assert idx[0, 0].tolist() == want + [-1] * (8 - len(want))


SELECT_PROBE = '''
import triton
import triton.language as tl
from {module} import _lychee_select


@triton.jit
def probe(KEYS, OUT, NB, n, KSEL: tl.constexpr, KP: tl.constexpr, NBR: tl.constexpr, NR1: tl.constexpr,
          NR2: tl.constexpr, NRT: tl.constexpr, LOWB: tl.constexpr):
    _lychee_select(KEYS, NB, OUT, 1, n, KSEL, KP, NBR, NR1, NR2, NRT, LOWB)
'''


def test_select_exact_on_crafted_keys(tmp_path, monkeypatch):
    # the combine kernel's top-n alone, on key rows built to be hard: many exact ties, non-candidates (-1), sink /
    # local keys (other negative ints), n = 0 and n > candidates, every width tier and the chunked path; the result
    # must equal a plain sort (larger key first, ties to the lower block), ascending, EMPTY-padded
    if not ON_CPU:
        pytest.skip("runs the selection alone under the Triton interpreter")
    from lychee_compile.lowering.standalone import render_standalone
    _, cp = kernel_params(G=2, Hkv=2, D=64, K_sel=8, block_size=16, sink_tokens=16, local_tokens=32, scale=0.1,
                          num_splits=4, nb_hint=16)
    fn, _, _ = render_standalone("combine", cp)
    (tmp_path / "select_probe.py").write_text(SELECT_PROBE.format(module=fn.fn.__module__))
    monkeypatch.syspath_prepend(str(tmp_path))
    import select_probe
    gen = torch.Generator().manual_seed(0)
    checked = tails = 0
    for trial in range(60):
        NB = int(torch.randint(1, 100, (), generator=gen))
        keys = torch.rand(NB, generator=gen) ** 8
        if trial % 3 == 0:
            keys = (keys * 4).floor() / 4                                   # ties
        ik = rank_score(keys).view(torch.int32).clone()                      # keys as the key programs form them
        if trial % 7 == 0:     # scores apart by less than 2^-11 (relative) are ties at the ranked resolution
            ik[: NB // 2] = rank_score(torch.full((NB // 2,), 0.3)).view(torch.int32)
            ik[NB // 4: NB // 2] = (torch.full((NB // 2 - NB // 4,), 0.3) * (1 + 2 ** -13)).view(torch.int32) \
                & -(1 << RANK_DROP_BITS)
        ik[torch.rand(NB, generator=gen) < 0.2] = -1                         # not candidates
        if trial % 5 == 0:
            ik[torch.rand(NB, generator=gen) < 0.3] = (-keys[:1]).view(torch.int32)   # sink / local (-score bits)
        n = int(torch.randint(0, 9, (), generator=gen))
        cand = sorted(((-int(ik[i]), i) for i in range(NB) if ik[i] >= 0))
        ref = sorted(i for _, i in cand[:n])
        ref += [-1] * (8 - len(ref))
        # (NBR, NR1, NR2, NRT): NB in (NR2, NR2 + NRT] takes the two-row (NR2 + tail) path
        for nbr, t1, t2, tail in ((64, 16, 32, 4), (16, 16, 16, 2), (128, 32, 64, 8), (32, 8, 16, 2), (128, 4, 32, 64)):
            out = torch.full((8,), -5, dtype=torch.int32)
            select_probe.probe[(1,)](ik, out, NB, n, 8, 8, nbr, t1, t2, tail, RANK_DROP_BITS)
            out0 = torch.full((8,), -5, dtype=torch.int32)                   # LOWB = 0: the exact path too
            select_probe.probe[(1,)](ik, out0, NB, n, 8, 8, nbr, t1, t2, tail, 0)
            assert out0.tolist() == ref, (nbr, t1, t2, NB, n, ik.tolist())
            assert out.tolist() == ref, (nbr, t1, t2, NB, n, ik.tolist())
            checked += 1
            tails += int(t2 < NB <= t2 + tail and nbr > t2)
    assert checked == 60 * 5 and tails >= 5, tails


# --- the mass variant (lychee::hybrid_decode_mass): extra blocks for sparse heads, per-block mass out -------------
def random_extra(idx_in, nb, width, seed):
    """int32 [B, Hkv, width]: distinct blocks outside idx_in's row (the op's precondition), some EMPTY, some past
    the cache (ignored), some inside the sink / local range (read once)."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, _ = idx_in.shape
    extra = torch.full((B, Hkv, width), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv):
            taken = set(idx_in[b, h].tolist())
            pool = [x for x in torch.randperm(nb + 2, generator=g).tolist() if x not in taken]
            mid = next(x for x in pool if 2 <= x < nb - 3)          # first slot: a block no other rule reads
            pool = [mid] + [x for x in pool if x != mid]
            n = int(torch.randint(1, width + 1, (), generator=g))
            extra[b, h, :n] = torch.tensor(pool[:n], dtype=torch.int32)
    return extra.to(idx_in.device)


MASS_CASES = [
    # B, Hkv, G, D, T, dtype, bs, K, sink, local, pads, retr, num_splits, KX
    (2, 3, 2, 64, 300, torch.bfloat16, 16, 4, 16, 32, [(0, 300), (37, 290)], [True, False, False], 7, 3),
    (1, 2, 4, 64, 256, torch.float16, 16, 3, 0, 0, [(0, 250)], [False, False], 4, 2),
    (2, 2, 3, 128, 200, torch.bfloat16, 16, 2, 8, 16, [(5, 200), (0, 0)], [False, True], 3, 1),
]


@pytest.mark.parametrize("case", MASS_CASES, ids=lambda c: f"B{c[0]}H{c[1]}G{c[2]}KX{c[-1]}")
def test_kernel_mass_variant_matches_reference(case):
    check_mass(*case, device="cpu", seed=21)


@pytest.mark.parametrize("D,dtype", [(96, torch.bfloat16), (80, torch.float16)], ids=["D96-bfloat16", "D80-float16"])
def test_kernel_mass_variant_padded_head_dim(D, dtype):
    check_mass(2, 3, 2, D, 300, dtype, 16, 4, 16, 32, [(0, 300), (37, 290)], [True, False, False], 7, 3,
               device="cpu", seed=24)


def test_kernel_mass_variant_wide_gathered_tiles():
    # per-virtual-block sums of a gathered tile of 4 blocks (SBN 64 over BLOCK_N 16)
    check_mass(*MASS_CASES[0], device="cpu", seed=22, block_n=16, sparse_bn=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", [31, 32])
def test_kernel_mass_variant_gpu(seed):
    # fresh random inputs each seed, 8K-token rows in a longer cache, the Llama-8B group and head dim
    T = 8192 + 77
    check_mass(2, 4, 4, 128, T + 300, torch.bfloat16, 16, 64, 16, 64, [(0, T), (901, T)], [True, False, False, True],
               None, 16, device="cuda", seed=seed)


def check_mass(B, Hkv, G, D, T, dtype, bs, K, sink, local, pads, retr, ns, kx, device, seed, **kw):
    """The mass variant vs the reference: outputs, index state (exact), per-block mass (poisoned first, so every
    element must be written), the same attended blocks."""
    from lychee_compile.lowering import standalone
    if device == "cpu" and not ON_CPU:
        pytest.skip("CPU tensors need the Triton interpreter")
    q, k, v, valid, retrieval, idx_in = make_case(B, Hkv, G, D, T, dtype, bs, K, sink, local, pads, retr,
                                                  device=device, seed=seed)
    nb = -(-T // bs)
    extra = random_extra(idx_in.cpu(), nb, kx, seed=seed + 1)
    ns = ns or standalone._default_num_splits(q.device)
    ws = standalone.workspace(B, Hkv, G, D, T, bs, ns, q.device)
    ws["MASSO"] = torch.full((B, Hkv, nb), float("nan"), device=q.device)         # every element must be written
    out, idx_out, mass = hybrid_decode_triton(q, k, v, valid, retrieval, idx_in, D ** -0.5, bs, sink, local,
                                              num_splits=ns, extra=extra.to(q.device), ws=ws, **kw)
    ref_out, ref_idx, ref_mass = hybrid_decode_reference(q.cpu(), k.cpu(), v.cpu(), valid.cpu(), retrieval.cpu(),
                                                         idx_in.cpu(), D ** -0.5, bs, sink, local, extra=extra,
                                                         with_mass=True)
    out, idx_out, mass = out.cpu().float(), idx_out.cpu(), mass.cpu()
    assert torch.isfinite(mass).all() and torch.isfinite(out).all()
    assert ((out - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-12)).item() < 1.5e-2
    assert_same_selection(idx_out, ref_idx, q.cpu(), k.cpu(), valid.cpu(), retrieval.cpu(), D ** -0.5, bs,
                          exact_idx=device == "cpu")
    assert (mass - ref_mass).abs().max().item() < 2e-2          # bf16 scores: probabilities to ~1e-2
    assert torch.equal(mass > 0, ref_mass > 1e-30) or torch.equal(mass > 0, ref_mass > 0)  # the attended blocks
    # the extra blocks changed what the sparse heads read (else the test would not test them)
    _, _, plain_mass = hybrid_decode_reference(q.cpu(), k.cpu(), v.cpu(), valid.cpu(), retrieval.cpu(), idx_in.cpu(),
                                               D ** -0.5, bs, sink, local, with_mass=True)
    assert not torch.equal(plain_mass > 0, ref_mass > 0)


def test_kernel_mass_without_extra_equals_plain_kernel():
    # the mass variant with no extra slots computes exactly what the plain kernels do, plus the mass
    args = make_case(2, 2, 2, 64, 200, torch.bfloat16, 16, 4, 16, 32, [(0, 200), (30, 190)], [True, False], seed=23)
    if args[0].device.type == "cpu" and not ON_CPU:
        pytest.skip("CPU tensors need the Triton interpreter")
    out, idx = hybrid_decode_triton(*args, 0.125, 16, 16, 32, num_splits=4)
    out2, idx2, mass = hybrid_decode_triton(*args, 0.125, 16, 16, 32, num_splits=4, with_mass=True)
    assert torch.equal(out, out2) and torch.equal(idx, idx2)
    assert torch.allclose(mass.sum(-1).cpu(), torch.full((2, 2), 2.0), atol=1e-3)   # G = 2 query heads per KV head
