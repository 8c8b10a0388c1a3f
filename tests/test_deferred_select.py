"""The deferred selection (ops/deferred_select.py, passes/defer_selection.py, lowering/deferred.py).

The op pair's contract (opcheck), the Triton select kernel against the combine's own selection and the eager
reference (interpreter on CPU), the lowering's fork / join in Inductor's code, and on the GPU the side stream inside
a CUDA graph against the non-deferred kernels.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from lychee_compile.lowering.constexprs import interpreting  # noqa: E402
from lychee_compile.lowering.standalone import hybrid_decode_triton, make_launchers, row_extent, workspace  # noqa: E402
from lychee_compile.ops.deferred_select import select_rows_reference  # noqa: E402
from tests.test_kernel_hybrid import make_case  # noqa: E402
from tests.test_lowering import _case  # noqa: E402

SELECT_ROWS = torch.ops.lychee.select_rows.default
INDEX_READY = torch.ops.lychee.index_ready.default


def _keys_case(B=2, Hkv=3, nb=40, K=5, seed=0):
    """Keys as the combine writes them: candidates' fp32 score bits (some tied), -score bits for sink / local
    blocks, -1 for the rest; rows with different valid ranges."""
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(B, Hkv, nb, generator=g) / nb
    score[..., 7] = score[..., 9]                                    # a tie: the lower block wins
    keys = score.view(torch.int32).clone()
    keys[..., :2] = (-score[..., :2]).view(torch.int32)              # sink blocks
    keys[..., -3:] = -1                                              # past the valid range
    keys[1, :, 30:] = -1
    rowlo = torch.tensor([0, 0], dtype=torch.int32)
    rowhi = torch.tensor([nb * 16, 30 * 16], dtype=torch.int32)
    tvp = rowhi.amax().reshape(1)
    idx = torch.full((B, Hkv, K), 77, dtype=torch.int32)            # rows not selected must keep this
    return keys, idx, rowlo, rowhi, tvp


@pytest.mark.parametrize("policy,param", [(0, 0.0), (1, 0.5), (2, 0.02), (3, 0.1)])
def test_opcheck_select_rows(policy, param):
    keys, idx, rowlo, rowhi, tvp = _keys_case()
    retr, sel = torch.tensor([1, 1, 0], dtype=torch.int8), torch.tensor([1, 0, 1], dtype=torch.int8)
    torch.library.opcheck(SELECT_ROWS, (keys, idx.clone(), rowlo, rowhi, tvp, retr, sel, 16, 2, policy, param, 64))
    out = idx.clone()
    SELECT_ROWS(keys, out, rowlo, rowhi, tvp, retr, sel, 16, 2, policy, param, 64)
    # only head 0 (retrieval and read) changed; heads 1 (unread) and 2 (sparse) kept their rows
    assert torch.equal(out[:, 1:], idx[:, 1:])
    assert not torch.equal(out[:, 0], idx[:, 0])
    if policy == 0:   # top-5 by score among the candidates, ascending; block 7 beats its tie at 9
        for b in range(2):
            k = keys[b, 0].clone()
            cand = torch.nonzero(k >= 0).flatten()
            top = cand[torch.sort(k[cand].view(torch.float32), descending=True, stable=True).indices[:5]]
            assert out[b, 0].tolist() == sorted(top.tolist())


def test_opcheck_index_ready():
    idx = torch.arange(12, dtype=torch.int32).reshape(1, 3, 4)
    torch.library.opcheck(INDEX_READY, (idx.clone(), [torch.zeros(2)]))
    before = idx.clone()
    INDEX_READY(idx, [])
    assert torch.equal(idx, before)      # a join: the data never changes


@pytest.mark.parametrize("policy,param", [(0, 0.0), (1, 0.6), (2, 0.01), (3, 0.3)])
def test_select_kernel_matches_combine_selection_and_reference(policy, param):
    """lychee_select_rows (DEFER=1) writes exactly what the combine's own selection writes, and what the eager
    reference picks from the same keys; the attention output is the same."""
    if not torch.cuda.is_available() and not interpreting():
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, valid, retr, idx_in = make_case(2, 4, 2, 64, 400, torch.bfloat16, 16, 6, 16, 32, [(0, 400), (37, 300)],
                                             [True, False, True, True], device=dev)
    sel = torch.tensor([True, True, False, True], device=dev)
    args = (q, k, v, valid, retr, idx_in, 0.125, 16, 16, 32)
    kw = dict(policy=policy, policy_param=param, select=sel, num_splits=6)
    out0, idx0 = hybrid_decode_triton(*args, **kw)
    split, combine, out1, idx1, _ = make_launchers(*args, defer=True, **kw)
    idx1.fill_(-5)                                   # poison: every row must be written
    split()
    combine()
    assert torch.equal(out0, out1)
    assert torch.equal(idx0, idx1)
    assert (idx1 >= -1).all()
    # the eager reference from the keys the combine wrote (make_launchers' workspace is internal: rebuild it)
    ws = workspace(2, 4, 2, 64, 400, 16, 6, q.device)
    split, combine, _, idx2, _ = make_launchers(*args, defer=True, ws=ws, **kw)
    split()
    combine()
    ext = row_extent(valid)
    ref = idx2.cpu()
    selecting = (retr & sel).cpu()
    ref[:, selecting] = -7                           # the reference must write every selecting row
    select_rows_reference(ws["KEYS"].cpu(), ref, ext["ROWLO"].cpu(), ext["ROWHI"].cpu(), ext["TVP"].cpu(),
                          retr.cpu(), sel.cpu(), 16, 2, policy, param)
    assert torch.equal(ref, idx2.cpu())


def _two_layers(q, k, v, valid, retr, idx, defer):
    o1, i1 = torch.ops.lychee.hybrid_decode(q, k, v, valid, torch.ones_like(retr), idx, 0.125, 16, 16, 32,
                                            0, 0.0, 0, 0, None, defer)
    o1 = o1 * 2          # the products the selection overlaps
    if defer:
        torch.ops.lychee.index_ready(i1, [])
    o2, i2 = torch.ops.lychee.hybrid_decode(q, k, v, valid, retr, i1, 0.125, 16, 16, 32)
    return o1 + o2, i2


def test_lowering_forks_and_joins(inductor_triton_on_cpu):
    """Inductor's code for two layers, the first deferred: its combine has no ticket (DEFER = 1), select_rows
    follows it, index_ready holds the keys and comes before the second layer's split; values equal eager."""
    from torch._inductor.utils import run_and_get_code
    from lychee_compile.lowering import register
    register()
    args = _case()
    (out, idx), codes = run_and_get_code(
        torch.compile(lambda *a: _two_layers(*a, True), backend="inductor", fullgraph=True), *args)
    ref_out, ref_idx = _two_layers(*args, False)
    assert torch.equal(idx, ref_idx)
    assert ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item() < 1.5e-2
    code = "\n".join(codes)
    assert "DEFER : tl.constexpr = 1" in code and "DEFER : tl.constexpr = 0" in code
    call = code.split("def call(")[-1]
    fork, join = call.index("torch.ops.lychee.select_rows.default("), call.index("torch.ops.lychee.index_ready.default(")
    splits = [i for i in range(len(call)) if call.startswith("triton_tem_fused_hybrid_decode", i)
              and ".run(" in call[i:i + 80]]
    assert fork < join, "the join follows the fork"
    later = [s for s in splits if s > join]
    assert later, "the second layer's kernels come after the join"
    join_line = call[join:call.index("\n", join)]
    assert join_line.count("buf") >= 3, join_line       # idx + held keys, retrieval, select buffers


def test_config_turns_deferral_off():
    from tests.harness import compiled, generate_logits
    from tests.models import make, make_batch
    from tests.test_sparse_semantics import mixed_map
    runs = {}
    for defer in (True, False):
        model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama", "sdpa")), budget=8, block_size=4,
                                sink_tokens=4, local_tokens=4, defer_selection=defer)
        runs[defer] = generate_logits(model, *make_batch(lengths=(12, 7)), steps=2)
        assert state.counters.selections_deferred == (len(state.global_layers) - 1 if defer else 0)
        assert ("index_ready(" in state.snapshots[0]) == defer
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_in_cuda_graph():
    """The fork and join captured in a CUDA graph (cudagraph trees) and replayed on fresh inputs: the same output
    and index state as the eager reference, every replay; the side stream exists."""
    from lychee_compile.lowering import deferred, register
    register()
    torch._dynamo.reset()
    args = [a.cuda() for a in _case(B=1, Hkv=8, G=4, D=128, T=8192, K=64)]
    fn = torch.compile(lambda *a: _two_layers(*a, True), backend="inductor", fullgraph=True, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        for a in args[:3]:
            a.copy_(torch.randn(a.shape, generator=g, device="cuda").to(a.dtype))
        out, idx = fn(*args)
        ref_out, ref_idx = _two_layers(*args, False)
        assert torch.equal(idx, ref_idx), step
        err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        assert err < 1.5e-2, (step, err)
    assert deferred._SIDE, "no side stream was used"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache,cuda_graphs", [("static", True), ("static", False), ("dynamic", False)])
def test_deferred_model_equals_inline_on_cuda(cache, cuda_graphs):
    """The whole compiled model (bf16, batch 2 with a left-padded row, a mixed head map, streaming heads too) with
    the top-k on the side stream against the same model selecting inline: the same tokens, logits within bf16
    noise (the two combines merge in another order); static cache with and without CUDA graphs, DynamicCache."""
    from torch._dynamo.utils import counters
    from lychee_compile import HeadMap, LycheeConfig, lychee_compile
    from lychee_compile.api import state_of
    from tests.harness import generate_logits
    from tests.models import make, make_batch
    from tests.test_sparse_semantics import mixed_map
    ids, mask = (x.cuda() for x in make_batch(lengths=(90, 71)))
    runs = {}
    for defer in (True, False):
        torch._dynamo.reset()
        model = make("llama", "sdpa").to("cuda", torch.bfloat16)
        retrieval = mixed_map(model)
        streaming = torch.zeros_like(retrieval)
        streaming[-1, -1] = not retrieval[-1, -1]        # a streaming head: its first reader is drop_inherited
        cfg = LycheeConfig(budget=32, block_size=16, sink_tokens=16, local_tokens=16, cuda_graphs=cuda_graphs,
                           defer_selection=defer)
        lychee_compile(model, HeadMap(retrieval, streaming=streaming).with_model_metadata(model), cfg)
        skips = counters["inductor"]["cudagraph_skips"]
        runs[defer] = generate_logits(model, ids, mask, 24, cache=cache)
        c = state_of(model).counters
        assert (c.selections_deferred > 0) == defer
        assert counters["inductor"]["cudagraph_skips"] == skips, "Inductor skipped CUDA graphs"
    (seq, logits), (ref_seq, ref_logits) = runs[True], runs[False]
    assert torch.equal(seq, ref_seq)
    assert (logits.float() - ref_logits.float()).abs().max() < 5e-2
