"""combo_groups (placed by inductor_changes in Inductor's grouping): for our compiles only, two groups of small kernels are taken from Inductor's scheduler and
each run as one combo kernel -- the input reads (kernels that depend on no other: each layer's head kinds cast from
the head-kinds state) and the tail writes (write-backs of mutated graph inputs that nothing reads: a static cache's
per-layer length counters). CPU: which nodes are found, on Inductor's real scheduler (Inductor's combo grouping
leaves CPU nodes out, so the grouping itself is checked with the nodes' device taken as a GPU). The combo kernels of
a whole decode step are checked on the GPU (last test)."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import KernelOptions
from lychee_compile.lowering import combo_groups, compat, inductor_changes
from lychee_compile.lowering.inductor_changes import Scope


def _counters_step(x, c0, c1, c2, w, kinds):
    # the shape of a decode step's counters: each read by "its layer", then bumped; w's update is also read
    # (Inductor reads the new value from its own buffer, so w's write-back is a tail write too). Each "layer" also
    # casts its row of `kinds` (returned, so realized: as a template input is): small, reads inputs only
    y = x * c0
    c0.add_(1)
    y = y + x * c1
    c1.add_(1)
    y = y * c2
    c2.add_(3)
    w.mul_(2)
    return (y.sum() + w.sum(),) + tuple((kinds[i] != 0).to(torch.int8) for i in range(3))


def _scheduled(fn, args, on_scheduler, grouped: dict | None = None):
    """Compile fn with Inductor (combo kernels on) and call on_scheduler(scheduler) at its combo grouping, and
    record in grouped["groups"] the groups that the grouping in place made; then group nothing (CPU code generation
    has no combo kernels)."""
    from torch._inductor.scheduler import ForeachKernelSchedulerNode
    original = ForeachKernelSchedulerNode.group_algorithm_for_combo_kernels

    def spy(scheduler):
        on_scheduler(scheduler)
        if grouped is not None:
            grouped["groups"] = [[n.get_name() for n in g] for g in original(scheduler)]
        return []

    torch._dynamo.reset()
    ForeachKernelSchedulerNode.set_group_algorithm_for_combo_kernels(spy)
    try:
        with torch._inductor.config.patch({"combo_kernels": True, "fx_graph_cache": False}):
            return torch.compile(fn, backend="inductor", fullgraph=True)(*args)
    finally:
        ForeachKernelSchedulerNode.set_group_algorithm_for_combo_kernels(original)
        torch._dynamo.reset()


def _args():
    # x above INPUT_READ_MAX_NUMEL: its kernels read inputs only too, but are not small
    return (torch.randn(combo_groups.INPUT_READ_MAX_NUMEL + 64), torch.tensor(3), torch.tensor(5), torch.tensor(7),
            torch.randn(64), torch.randint(0, 2, (3, 8)))


def test_tail_writes_are_the_counter_write_backs_only():
    found = []

    def look(scheduler):
        found.append([tuple(sorted(m for buf in n.get_outputs() for m in buf.node.get_mutation_names()))
                      for n in combo_groups.tail_writes(scheduler.nodes)])

    args = _args()
    expect = _counters_step(*[a.clone() for a in args])
    got = _scheduled(_counters_step, args, look)
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)    # a sum over 65K elements, another order
    assert torch.equal(args[1], torch.tensor(4)) and torch.equal(args[3], torch.tensor(10))
    assert len(found) == 1
    mutated = found[0]
    # the three counters and w, each written back by its own node; the reductions (graph output) are not
    assert len(found[0]) == 4 and all(len(names) == 1 for names in mutated), found
    assert len({names[0] for names in mutated}) == 4


def test_input_reads_are_the_small_kernels_that_depend_on_no_other():
    found = []
    _scheduled(_counters_step, _args(), lambda scheduler: found.append(
        [sorted(r.name for r in n.read_writes.reads) for n in combo_groups.input_reads(scheduler.nodes)]))
    assert len(found) == 1
    # one cast of `kinds` per "layer"; the kernels over x (too large) and the counters' write-backs (ordered after
    # their readers) are not input reads
    assert len(found[0]) == 3 and all(len(reads) == 1 for reads in found[0]), found
    assert len({reads[0] for reads in found[0]}) == 1


def _groups(options: KernelOptions, monkeypatch, ours: bool = True) -> dict:
    groups = {}
    monkeypatch.setattr(combo_groups, "_gpu_node", lambda node: True)    # CPU nodes stand in for GPU ones
    inductor = compat.ForeachKernelSchedulerNode.group_algorithm_for_combo_kernels

    def on(scheduler):
        groups["head"] = [n.get_name() for n in combo_groups.input_reads(scheduler.nodes)]
        groups["tail"] = [n.get_name() for n in combo_groups.tail_writes(scheduler.nodes)]
        groups["inductor"] = [[n.get_name() for n in g] for g in inductor(scheduler)]

    with inductor_changes.compiling(Scope(options=options)) if ours else _nothing():
        _scheduled(_counters_step, _args(), on, groups)
    return groups


def _nothing():
    import contextlib
    return contextlib.nullcontext()


def test_our_compiles_group_the_step_ends(monkeypatch):
    g = _groups(KernelOptions(), monkeypatch)
    assert len(g["head"]) == 3 and len(g["tail"]) == 4
    assert g["groups"][-2:] == [g["head"], g["tail"]]
    assert not any(set(x) & set(g["head"] + g["tail"]) for x in g["groups"][:-2])


@pytest.mark.parametrize("options,kept", [(KernelOptions(combo_input_reads=False), "tail"),
                                          (KernelOptions(combo_tail_writes=False), "head"),
                                          (KernelOptions(combo_input_reads=False, combo_tail_writes=False), None)],
                         ids=["no-input-reads", "no-tail-writes", "neither"])
def test_options_turn_each_group_off(options, kept, monkeypatch):
    g = _groups(options, monkeypatch)
    assert g["groups"] == g["inductor"] + ([g[kept]] if kept else [])


def test_other_compiles_keep_inductors_groups(monkeypatch):
    g = _groups(KernelOptions(), monkeypatch, ours=False)
    assert g["groups"] == g["inductor"] and g["head"] not in g["groups"] and g["tail"] not in g["groups"]


def test_grouping_is_ours_only_inside_our_compiles_and_only_with_combo_kernels():
    from lychee_compile import LycheeConfig
    from lychee_compile.lowering.compile import inductor_patches
    F = compat.ForeachKernelSchedulerNode
    inductor = F.__dict__["group_algorithm_for_combo_kernels"]
    with inductor_changes.compiling(Scope()):
        with inductor_changes.compiling(Scope()):
            assert F.group_algorithm_for_combo_kernels is inductor_changes._combo_groups
        assert F.group_algorithm_for_combo_kernels is inductor_changes._combo_groups
    assert F.__dict__["group_algorithm_for_combo_kernels"] is inductor
    assert "combo_kernels" in inductor_patches(True, LycheeConfig())
    assert "combo_kernels" not in inductor_patches(True, LycheeConfig(kernels=KernelOptions(combo_kernels=False)))
    assert "combo_kernels" not in inductor_patches(False, LycheeConfig())


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_tail_writes_leave_inductors_groups(n, monkeypatch):
    def step(x, *cs):
        y = x.sum()
        for c in cs:
            y = y * c
            c.add_(1)
        return y
    seen = {}
    monkeypatch.setattr(combo_groups, "_gpu_node", lambda node: True)
    inductor = compat.ForeachKernelSchedulerNode.group_algorithm_for_combo_kernels

    def on(scheduler):
        seen["inductor"] = [[x.get_name() for x in g] for g in inductor(scheduler)]
    with inductor_changes.compiling(Scope()):
        _scheduled(step, (torch.randn(8),) + tuple(torch.tensor(i + 2) for i in range(n)), on, seen)
    assert seen["groups"] == seen["inductor"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_step_ends_run_as_one_combo_kernel_each_gpu(monkeypatch):
    # a compiled decode step of a static-cache Llama: one write-back per layer at least (transformers' per-layer
    # cumulative_length) and one head-kinds read per layer at least, each set in ONE combo kernel; tokens equal the
    # same model compiled without combo kernels
    from torch._inductor.scheduler import Scheduler

    from lychee_compile import HeadMap, LycheeConfig, lychee_compile
    from tests.harness import generate_logits
    from tests.models import make, make_batch
    from tests.test_sparse_semantics import mixed_map
    cfg = dict(budget=32, block_size=16, sink_tokens=16, local_tokens=16)
    ids, mask = (x.cuda() for x in make_batch(lengths=(90, 71)))

    def run(options=KernelOptions()):
        torch._dynamo.reset()
        model = make("llama", "sdpa").to("cuda", torch.bfloat16)
        lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model),
                       LycheeConfig(kernels=options, **cfg))
        return model, generate_logits(model, ids, mask, 12)

    _, (plain_seq, plain_logits) = run(KernelOptions(combo_kernels=False))
    seen = []
    original = Scheduler.create_combo_kernel_nodes

    def spy(self, *a, **kw):
        ends = (combo_groups.input_reads(self.nodes), combo_groups.tail_writes(self.nodes))
        original(self, *a, **kw)
        if inductor_changes.active() is not None:
            seen.append([(len(g), {id(self.name_to_fused_node[n.get_nodes()[0].get_name()]) for n in g})
                         for g in ends])
    monkeypatch.setattr(Scheduler, "create_combo_kernel_nodes", spy)
    with torch._inductor.config.patch(fx_graph_cache=False):
        model, (seq, logits) = run()
    layers = model.config.num_hidden_layers
    decode = [ends for ends in seen if min(n for n, _ in ends) >= layers]
    assert decode, f"no compile of ours had >= {layers} input reads and tail writes: {seen}"
    assert all(len(fused) == 1 for ends in decode for _, fused in ends), decode
    assert torch.equal(seq, plain_seq)
    assert (logits.float() - plain_logits.float()).abs().max() < 5e-2
