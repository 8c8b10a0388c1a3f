"""benchmarks/e2e.py's CompilePhases (where a compile's seconds go): it reads private Dynamo/Inductor state, so a
torch upgrade that moves it should fail here, on the CPU, not in a GPU session. No timing is asserted."""
import torch

from tests.harness import compiled, generate_logits, import_benchmarks
from tests.models import make_batch


def test_compile_phases_times_our_passes_and_restores_what_it_wraps():
    import lychee_compile.backend as backend
    from lychee_compile.lowering import inductor_changes
    e2e = import_benchmarks("e2e")[0]
    run_passes, tune, bench = backend.run_passes, inductor_changes._tune, inductor_changes._bench
    ids, mask = make_batch(lengths=(9,))
    # Inductor: the compiled graph runs inside inductor_changes' scope, which must put the wrapped entry points in
    model, state = compiled("llama", "sdpa", budget=8, block_size=4, sink_tokens=4, local_tokens=4,
                            backend="inductor")
    torch._dynamo.reset()
    with e2e.CompilePhases() as phases:
        # the library's tuning entry points are wrapped: every tuned kernel and timed variant is recorded
        assert inductor_changes._tune is not tune and inductor_changes._bench is not bench
        generate_logits(model, ids, mask, steps=2)
    res = phases.result
    assert state.counters.decode_graphs == 1
    assert res["lychee_passes_s"] > 0                      # the pipeline ran inside, and was timed
    assert res["dynamo_timed_s"] and all(v >= 0 for v in res["dynamo_timed_s"].values())
    assert res["coordesc_configs_timed"] == 0 and res["tuning_by_kind"] == {} and res["tuned_kernels"] == []
    # every wrapper is gone afterwards
    assert backend.run_passes is run_passes
    assert inductor_changes._tune is tune and inductor_changes._bench is bench
