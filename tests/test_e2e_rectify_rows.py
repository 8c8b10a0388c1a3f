"""benchmarks/e2e.py's rectification rows: the time of the steps that re-encoded, and the overhead against the same
row without rectification (pure bookkeeping, no model)."""
from tests.harness import import_benchmarks


def test_reencode_time_and_overhead_against_the_row_without_rectification():
    e2e = import_benchmarks("e2e")[0]
    assert e2e.reencode_time([1.0, 1.2, 5.0, 1.0], [False, False, True, False]) == {"reencode_ms": 4.0}
    assert e2e.reencode_time([1.0, 1.0], [False, False]) == {}
    base = dict(model="m", batch=1, context=8, row="h12_64", mean_ms=2.0)
    rect = dict(model="m", batch=1, context=8, row="h12_64_r32", mean_ms=2.2, reencode_ms=6.4)
    out = e2e.rectify_overhead(rect, [dict(base, batch=2), base])
    assert out["base_row"] == "h12_64" and out["base_mean_ms"] == 2.0
    assert abs(out["rectify_overhead"] - 0.1) < 1e-9 and abs(out["reencode_overhead"] - 0.1) < 1e-9
    assert e2e.rectify_overhead(base, [base]) == {} and e2e.rectify_overhead(rect, [dict(base, context=16)]) == {}
    args = e2e.parse_args(["--dry-run", "--rows", "h12_64,h12_64_r32", "--contexts", "128", "--warmup", "1",
                           "--steps", "4"])
    assert e2e.max_cache_len(args) >= 128 + 64, "the first call runs 2R steps at the largest context"


def test_cuda_graph_recordings_are_counted_apart_from_compiles():
    # cudagraph trees fire the compile-start callbacks when they record (a re-encode records at its second call):
    # that is no recompile
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger
    e2e = import_benchmarks("e2e")[0]
    before = e2e.dynamo_counts()
    e2e._on_compile_start(CallbackArgs(CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"))
    recorded = e2e.delta(e2e.dynamo_counts(), before)
    assert recorded["cudagraph_records"] == 1 and recorded["compiles"] == 0 and e2e.recompiles_of(recorded) == 0
    e2e._on_compile_start(CallbackArgs(CallbackTrigger.DYNAMO, "0/1"))
    both = e2e.delta(e2e.dynamo_counts(), before)
    assert both["compiles"] == 1 and e2e.recompiles_of(both) == 1
