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
    assert e2e.max_cache_len(args) >= 128 + 32, "the first call runs R steps at the largest context"
