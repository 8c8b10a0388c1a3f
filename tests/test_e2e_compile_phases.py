"""benchmarks/e2e.py's CompilePhases (where a compile's seconds go): it reads private Dynamo/Inductor state, so a
torch upgrade that moves it should fail here, on the CPU, not in a GPU session. No timing is asserted."""
import torch

from tests.harness import compiled, generate_logits, import_benchmarks
from tests.models import make_batch


def test_compile_phases_times_our_passes_and_restores_what_it_wraps():
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    import lychee_compile.backend as backend
    e2e = import_benchmarks("e2e")[0]
    run_passes = backend.run_passes
    ids, mask = make_batch(lengths=(9,))
    model, state = compiled("llama", "sdpa", budget=8, block_size=4, sink_tokens=4, local_tokens=4)
    torch._dynamo.reset()
    from lychee_compile.lowering import compat
    compat.install_tuning_filter()      # as CompilePhases does first: the library's wrappers are in place before
    bench = CachingAutotuner.bench
    with e2e.CompilePhases() as phases:
        wrapped = CachingAutotuner.coordinate_descent_tuning
        assert CachingAutotuner.bench is not bench          # every timed variant is recorded
        generate_logits(model, ids, mask, steps=2)
    res = phases.result
    assert state.counters.decode_graphs == 1
    assert res["lychee_passes_s"] > 0                      # the pipeline ran inside, and was timed
    assert res["dynamo_timed_s"] and all(v >= 0 for v in res["dynamo_timed_s"].values())
    assert res["coordesc_configs_timed"] == 0 and res["tuning_by_kind"] == {} and res["tuned_kernels"] == []
    # both wrappers are gone afterwards: the pass pipeline is the library's own again, and the tuning entry point
    # is what it was before (the library's reductions-only filter, installed first, stays)
    assert backend.run_passes is run_passes
    assert wrapped is not CachingAutotuner.coordinate_descent_tuning
    assert CachingAutotuner.coordinate_descent_tuning is compat._coordesc_reductions_only
    assert CachingAutotuner.bench is bench is compat._bench_alone_for_ours
