"""Tensor parallelism: lychee_compile on models sharded by transformers' own TP (2 CPU ranks, gloo), against the same
model in one process. Each rank runs its KV heads' columns of the global head map (lychee_compile/tensor_parallel.py).

Every job runs on both ranks of one launcher (tests/tp_ranks.py) with a timeout. Models are tests/models.py's tiny
ones, saved to a folder and loaded on each rank with `tp_plan="auto"` or `distributed_config=DistributedConfig(...)`.
"""
from __future__ import annotations

import collections

import pytest
import torch

from lychee_compile import HeadMap, HeadMapError, LycheeCompileError, LycheeConfig, lychee_compile, set_head_map
from lychee_compile.api import state_of
from lychee_compile.ops import sparsity
from tests.harness import EXACT_TOL, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import LEVELS, mixed_map
from tests.tp_ranks import RankError, Ranks

STEPS = 4
LENGTHS = (26, 17)
SPARSE = dict(LEVELS["block"], backend="eager")
JOB_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def ranks():
    launcher = Ranks(2)
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> a folder holding make(arch), saved once per module."""
    folders: dict = {}

    def folder(arch: str) -> str:
        if arch not in folders:
            folders[arch] = str(tmp_path_factory.mktemp(arch))
            make(arch).save_pretrained(folders[arch])
        return folders[arch]
    return folder


# --- jobs: run on every rank ------------------------------------------------------------------------------------

def _load(folder: str, api: str):
    from transformers import AutoModelForCausalLM
    if api == "tp_plan":
        kwargs = dict(tp_plan="auto")
    else:
        from transformers.distributed import DistributedConfig
        kwargs = dict(distributed_config=DistributedConfig(tp_plan="auto"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None
    return model


def _compiled(folder, api, retrieval, config):
    model = _load(folder, api)
    head_map = HeadMap.for_model(model) if retrieval is None else HeadMap(retrieval).with_model_metadata(model)
    lychee_compile(model, head_map, LycheeConfig(**config))
    return model


def _run(model, steps=STEPS):
    """What a rank's generate() gives and holds: tokens, logits, the KV heads of its cache, its op calls' attended
    tokens and index state (the eager reference's sparsity side channel)."""
    ids, mask = make_batch(lengths=LENGTHS)
    recorder = _Recorder()
    sparsity.ACTIVE = recorder
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
    finally:
        sparsity.ACTIVE = None
    return dict(seq=out.sequences, logits=torch.stack(out.logits), attend=recorder.attend, idx=recorder.idx,
                cache_heads=out.past_key_values.layers[0].keys.shape[1])


class _Recorder(sparsity.SparsityCollector):
    def __init__(self):
        super().__init__()
        self.attend, self.idx = [], []

    def record(self, attend, valid, is_retrieval, idx_out, select):
        self.attend.append(attend.clone())
        self.idx.append(idx_out.clone())


def job_generate(folder, api, retrieval, config, swap=None):
    model = _compiled(folder, api, retrieval, config)
    state = state_of(model)
    first = _run(model)
    result = dict(first, heads=state.shard.heads, kinds=tuple(model._lychee_kinds.shape),
                  counters=state.counters.as_dict(), dtensor_params=_dtensor_params(model),
                  in_group_buffers=_in_group_buffers(model))
    if swap is not None:
        graphs = state.counters.graphs
        set_head_map(model, HeadMap(swap).with_model_metadata(model))
        result.update(swapped=_run(model), new_graphs=state.counters.graphs - graphs)
    return result


def _dtensor_params(model) -> dict:
    """{'linear': DTensor weights of nn.Linear modules, 'other': other DTensor parameters} (after generate())."""
    from torch.distributed.tensor import DTensor
    out = collections.Counter()
    for module in model.modules():
        for p in module._parameters.values():
            if isinstance(p, DTensor):
                out["linear" if isinstance(module, torch.nn.Linear) else "other"] += 1
    return dict(out)


def _in_group_buffers(model) -> int:
    """How many nn.Linear DTensor weights hold their local shard in a fused group buffer (fuse_linears)."""
    from lychee_compile.linear_groups import GROUPS_ATTR
    buffers = {getattr(model, w_attr).untyped_storage().data_ptr() for _, w_attr, _ in getattr(model, GROUPS_ATTR)}
    return sum(m.weight._local_tensor.untyped_storage().data_ptr() in buffers
               for m in model.modules() if isinstance(m, torch.nn.Linear) and hasattr(m.weight, "_local_tensor"))


def job_local_shards(folder):
    """LocalLinearShards on a sharded model: swapped in only without gradients, kept by a nested call, restored."""
    from torch.distributed.tensor import DTensor
    from lychee_compile.tensor_parallel import local_linear_shards
    model = _load(folder, "tp_plan")
    shards = local_linear_shards(model)
    weight = model.model.layers[0].self_attn.q_proj._parameters
    out = dict(n=len(shards), before=isinstance(weight["weight"], DTensor))
    with torch.no_grad(), shards:
        with shards:
            out["nested"] = isinstance(weight["weight"], DTensor)
        out["inner_exit"] = isinstance(weight["weight"], DTensor)
        local = weight["weight"]
    out["after"] = isinstance(weight["weight"], DTensor)
    out["same_storage"] = local.data_ptr() == weight["weight"].to_local().data_ptr()
    with torch.enable_grad(), shards:
        out["with_grad"] = isinstance(weight["weight"], DTensor)
    model.to(torch.float64)                             # swaps the DTensors' contents in place: a new shard
    with torch.no_grad(), shards:
        out["moved"] = weight["weight"].dtype == torch.float64 and not isinstance(weight["weight"], DTensor)
    return out


def job_collectives_per_step(folder):
    """The collectives one decode step issues (the gloo backend's own operation records, which a compiled graph's
    functional collectives reach as well), of transformers' TP model and of the same model through lychee_compile."""
    per_step = {}
    for name in ("transformers", "lychee"):
        torch._dynamo.reset()
        model = _load(folder, "tp_plan")
        if name == "lychee":
            lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager"))
        ids, mask = make_batch(lengths=LENGTHS)

        def generate(n):
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               cache_implementation="static")
        generate(2)                                   # compiles the decode step (lychee) outside the count
        one, five = _collectives(lambda: generate(1)), _collectives(lambda: generate(5))
        per_step[name] = {k: (five[k] - one[k]) / 4 for k in five}
    return per_step


def _collectives(fn) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))


def job_one_shot_all_reduce(folder):
    """symm_mem_all_reduce's pass and op, wired on CPU ranks: lychee_compile with the resolution forced on and a plain
    buffer (off CUDA lychee::one_shot_all_reduce runs its reference, the functional all-reduce on gloo), against the
    same model keeping the process group's all-reduces; and the op's opcheck on this group."""
    import torch.distributed as dist
    from lychee_compile import api
    from lychee_compile.ops.one_shot_all_reduce import ONE_SHOT_BYTES
    out = {}
    for name in ("kept", "one_shot"):
        torch._dynamo.reset()
        model = _load(folder, "tp_plan")
        resolve = api.resolved_all_reduce
        if name == "one_shot":
            api.resolved_all_reduce = lambda config, shard, device: (
                config, "forced on", None, torch.zeros(ONE_SHOT_BYTES, dtype=torch.uint8))
        try:
            # the one-shot model through Inductor: AOT functionalization and Inductor's reinplacing of the op's
            # mutated buffer (one graph input shared by every call) are part of what runs on a GPU
            lychee_compile(model, HeadMap.for_model(model),
                           LycheeConfig(backend="inductor" if name == "one_shot" else "eager",
                                        symm_mem_all_reduce=name == "one_shot"))
        finally:
            api.resolved_all_reduce = resolve
        run = _run(model)
        ids, mask = make_batch(lengths=LENGTHS)

        def generate(n):
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        one, five = _collectives(lambda: generate(1)), _collectives(lambda: generate(5))
        out[name] = dict(logits=run["logits"], seq=run["seq"], counters=state_of(model).counters.as_dict(),
                         per_step={k: (five[k] - one[k]) / 4 for k in five})
    group = dist.group.WORLD.group_name
    x = torch.randn(2, 1, 64)
    torch.library.opcheck(torch.ops.lychee.one_shot_all_reduce.default,
                          (x, torch.zeros(ONE_SHOT_BYTES, dtype=torch.uint8), group))
    expected = x.clone()
    dist.all_reduce(expected)
    out["op"] = torch.equal(torch.ops.lychee.one_shot_all_reduce(x, torch.zeros(16, dtype=torch.uint8), group),
                            expected)
    return out


def job_symmetric_buffer_failure(strict: bool, failing_rank: int | None):
    """resolved_all_reduce on CPU ranks pretending to be CUDA ones: the allocation raises on `failing_rank` (None: on
    no rank; the rendezvous is then skipped, a CPU tensor cannot join one). (config flag, failure, buffer given) or
    the error raised."""
    import torch.distributed as dist
    from lychee_compile import tensor_parallel as tp
    from lychee_compile.tensor_parallel import KVShard, resolved_all_reduce

    def allocated(group, device):
        if dist.get_rank() == failing_rank:
            raise RuntimeError("no symmetric memory here")
        return torch.zeros(16, dtype=torch.uint8)
    saved = tp._has_one_shot, tp._allocated, tp._rendezvous
    tp._has_one_shot, tp._allocated, tp._rendezvous = (lambda: True), allocated, (lambda buffer, group: None)
    shard = KVShard([0, 1], 4, dist.group.WORLD, dist.get_rank(), 2)
    try:
        config, _, failure, buffer = resolved_all_reduce(LycheeConfig(symm_mem_all_reduce=True, strict=strict),
                                                         shard, torch.device("cuda", 0))
        return config.symm_mem_all_reduce, failure, buffer is not None
    except LycheeCompileError as exc:
        return str(exc)
    finally:
        tp._has_one_shot, tp._allocated, tp._rendezvous = saved


def job_refusals(folder):
    """(error of a wrong-size map, error of maps that differ between ranks, model left unchanged by both)."""
    import torch.distributed as dist
    model = _load(folder, "tp_plan")
    before = model.generation_config.compile_config
    errors = []
    for retrieval in (torch.ones(2, 3, dtype=torch.bool), mixed_map(model) | (dist.get_rank() == 1)):
        try:
            lychee_compile(model, HeadMap(retrieval).with_model_metadata(model), LycheeConfig(backend="eager"))
            errors.append(None)
        except Exception as exc:  # noqa: BLE001
            errors.append((type(exc).__name__, str(exc)))
    unchanged = getattr(model, "_lychee_state", None) is None and model.generation_config.compile_config is before
    return errors, unchanged


def job_lychee_compile(folder, api="tp_plan"):
    _compiled(folder, api, None, dict(backend="eager"))


# --- tests ------------------------------------------------------------------------------------------------------

def _one_process(arch, retrieval=None, **config):
    """The same model in one process: dense (config None) or through lychee_compile."""
    model = make(arch)
    if config:
        head_map = HeadMap.for_model(model) if retrieval is None else HeadMap(retrieval).with_model_metadata(model)
        lychee_compile(model, head_map, LycheeConfig(**config))
    return _run(model)


def _assert_heads_split(per_rank, n_kv):
    heads = [r["heads"] for r in per_rank]
    assert sorted(h for hs in heads for h in hs) == list(range(n_kv)) and all(len(h) == n_kv // 2 for h in heads)
    for r in per_rank:
        assert r["cache_heads"] == n_kv // 2, "each rank's KV cache holds only its own heads"
        assert r["kinds"][1] == n_kv // 2
        assert r["counters"]["sites_rewritten"] > 0 and r["counters"]["graphs_left_dense"] == 0
        # the decode graph took the Linear weights' local shards (no per-call DTensor guard / unwrap), and the
        # model holds its DTensors again after generate()
        assert r["dtensor_params"].get("linear", 0) > 0
        assert r["counters"]["dtensor_inputs"] <= r["dtensor_params"].get("other", 0)
        # fuse_linears under TP: the sibling linears' local shards live in group buffers (the DTensors' local tensors
        # re-pointed, no copy kept) and the decode graph multiplies each group once
        assert r["in_group_buffers"] > 0 and r["counters"]["linears_fused"] >= r["in_group_buffers"]


def _transformers_before(version: str) -> bool:
    import transformers
    from packaging.version import Version
    return Version(transformers.__version__) < Version(version)


QWEN3_HOOKS = pytest.mark.skipif(
    _transformers_before("5.23"),
    reason="transformers 5.17's TP plan puts Qwen3's q_norm / k_norm under ReplicatedWithGradAllReduce, which "
           "registers a module full backward hook; Dynamo cannot trace it ('Module-level backwards hooks require "
           "compiled autograd.') in the one graph lychee_compile's probe and decode step need (fullgraph)")


@pytest.mark.parametrize("arch,api", [("llama", "tp_plan"), ("llama", "distributed_config"),
                                      ("qwen2_gqa7", "distributed_config"),
                                      pytest.param("qwen3", "tp_plan", marks=QWEN3_HOOKS)])
def test_all_retrieval_equals_one_process_dense(ranks, saved, arch, api):
    per_rank = ranks.run(job_generate, saved(arch), api, None, dict(backend="eager"), timeout=JOB_TIMEOUT_S)
    dense = _one_process(arch)
    for r in per_rank:
        assert not isinstance(r, RankError), r
        assert max_logit_diff(r["logits"], dense["logits"]) < EXACT_TOL and torch.equal(r["seq"], dense["seq"])
    _assert_heads_split(per_rank, make(arch).config.num_key_value_heads)


def _assert_equals_one_process(per_rank, single):
    """Each rank: the one-process run's logits and tokens, and its own KV heads' columns of what every op call
    attended and selected."""
    assert len(per_rank[0]["attend"]) == len(single["attend"]) > 0
    for r in per_rank:
        assert max_logit_diff(r["logits"], single["logits"]) < EXACT_TOL and torch.equal(r["seq"], single["seq"])
        for mine, whole in zip(r["attend"], single["attend"]):
            assert torch.equal(mine, whole[:, r["heads"]])
        for mine, whole in zip(r["idx"], single["idx"]):
            assert torch.equal(mine, whole[:, r["heads"]])


def test_sparse_map_equals_one_process_lychee(ranks, saved):
    arch = "qwen2_gqa7"
    retrieval = mixed_map(make(arch))
    per_rank = ranks.run(job_generate, saved(arch), "tp_plan", retrieval, SPARSE, timeout=JOB_TIMEOUT_S)
    assert not any(isinstance(r, RankError) for r in per_rank), per_rank
    single = _one_process(arch, retrieval, **SPARSE)
    _assert_equals_one_process(per_rank, single)
    assert max_logit_diff(single["logits"], _one_process(arch)["logits"]) > 1e-3, "the map must make attention sparse"


def test_local_linear_shards_swap_and_restore(ranks, saved):
    per_rank = ranks.run(job_local_shards, saved("llama"), timeout=JOB_TIMEOUT_S)
    for r in per_rank:
        assert not isinstance(r, RankError), r
        assert r["n"] > 0 and r["before"] and r["after"] and r["with_grad"]
        assert not r["nested"] and not r["inner_exit"] and r["same_storage"] and r["moved"]


def test_set_head_map_under_tensor_parallel(ranks, saved):
    arch = "llama"
    retrieval = mixed_map(make(arch))
    per_rank = ranks.run(job_generate, saved(arch), "tp_plan", None, SPARSE, retrieval, timeout=JOB_TIMEOUT_S)
    assert not any(isinstance(r, RankError) for r in per_rank), per_rank
    _assert_equals_one_process([dict(r["swapped"], heads=r["heads"]) for r in per_rank],
                               _one_process(arch, retrieval, **SPARSE))
    assert all(r["new_graphs"] == 0 for r in per_rank), "set_head_map must not cause a new graph"


def test_decode_step_issues_transformers_collectives(ranks, saved):
    per_rank = ranks.run(job_collectives_per_step, saved("llama"), timeout=JOB_TIMEOUT_S)
    for r in per_rank:
        assert not isinstance(r, RankError), r
        # llama, 3 layers: o_proj and down_proj all-reduce per layer, lm_head's gather (transformers 5.23: and the
        # vocabulary-sharded embedding's sum: 7 all-reduces; 5.17: 6)
        assert r["transformers"]["gloo:all_reduce"] >= 6 and r["transformers"]["gloo:all_gather"] == 1
        assert r["lychee"] == r["transformers"]


def test_one_shot_all_reduce_pass_on_cpu_ranks(ranks, saved):
    per_rank = ranks.run(job_one_shot_all_reduce, saved("llama"), timeout=JOB_TIMEOUT_S)
    for r in per_rank:
        assert not isinstance(r, RankError), r
        kept, one_shot = r["kept"], r["one_shot"]
        # 3 layers: o_proj and down_proj per layer (and, transformers 5.23, the vocabulary-sharded embedding's sum)
        assert one_shot["counters"]["all_reduces_one_shot"] >= 6 and one_shot["counters"]["all_reduces_kept"] == 0
        assert kept["counters"]["all_reduces_one_shot"] == 0
        assert max_logit_diff(one_shot["logits"], kept["logits"]) < EXACT_TOL and torch.equal(one_shot["seq"],
                                                                                             kept["seq"])
        # the op's reference is the same gloo all-reduce: one step issues the same collectives either way
        assert one_shot["per_step"] == kept["per_step"] and kept["per_step"]["gloo:all_reduce"] >= 6
        assert r["op"]


def test_symmetric_buffer_failure_on_one_rank_is_every_rank_s(ranks):
    """One rank failing to allocate: strict raises on both (the failing rank named), non-strict turns the option off
    on both -- never one rank in a one-shot barrier the other does not reach."""
    for r in ranks.run(job_symmetric_buffer_failure, True, 1, timeout=JOB_TIMEOUT_S):
        assert "no symmetric memory here" in r and "rank 1 of 2" in r
    for on, failure, has_buffer in ranks.run(job_symmetric_buffer_failure, False, 1, timeout=JOB_TIMEOUT_S):
        assert not on and "no symmetric memory here" in failure and not has_buffer
    for r in ranks.run(job_symmetric_buffer_failure, True, None, timeout=JOB_TIMEOUT_S):
        assert r == (True, None, True)


def test_symm_mem_all_reduce_resolves_off_without_cuda():
    from lychee_compile.tensor_parallel import KVShard, resolved_all_reduce
    shard, on = KVShard([0, 1], 4, None, 0, 2), LycheeConfig(symm_mem_all_reduce=True)
    config, line, failure, buffer = resolved_all_reduce(on, shard, torch.device("cpu"))
    assert not config.symm_mem_all_reduce and "not CUDA" in line and failure is None and buffer is None
    config, line, _, _ = resolved_all_reduce(on, None, torch.device("cuda"))
    assert not config.symm_mem_all_reduce and "one process" in line
    config, line, _, _ = resolved_all_reduce(LycheeConfig(), shard, torch.device("cuda"))     # off by default
    assert not config.symm_mem_all_reduce and "symm_mem_all_reduce=False" in line
    # asked for in one process: lychee_compile goes on, the option resolved off
    model = make("llama")
    lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager", symm_mem_all_reduce=True))
    assert not state_of(model).config.symm_mem_all_reduce and state_of(model).shard is None


def test_wrong_head_map_fails_in_lychee_compile_on_every_rank(ranks, saved):
    per_rank = ranks.run(job_refusals, saved("llama"), timeout=JOB_TIMEOUT_S)
    for errors, unchanged in per_rank:
        assert errors[0][0] == HeadMapError.__name__ and "does not match the model" in errors[0][1]
        assert errors[1][0] == LycheeCompileError.__name__ and "different head maps" in errors[1][1]
        assert unchanged
    assert per_rank[0][0] == per_rank[1][0], "the same error on every rank"


def test_fused_qkv_sharded_by_rows_is_refused_on_every_rank(ranks, saved):
    per_rank = ranks.run(job_lychee_compile, saved("gpt_neox"), timeout=JOB_TIMEOUT_S)
    assert all(isinstance(r, RankError) and r.kind == LycheeCompileError.__name__ for r in per_rank), per_rank
    assert "fused query/key/value projection" in per_rank[0].message
    assert per_rank[0].message == per_rank[1].message


def test_rows_that_are_not_whole_heads_are_refused():
    from lychee_compile.tensor_parallel import _whole_heads
    assert _whole_heads(list(range(32, 64)), 16, 4, "k_proj") == [2, 3]
    assert _whole_heads(list(range(16, 32)) + list(range(48, 64)), 16, 4, "k_proj") == [1, 3]    # strided shards
    with pytest.raises(LycheeCompileError, match="do not divide evenly"):
        _whole_heads(list(range(24)), 16, 3, "k_proj")        # 3 heads of 16 rows on 2 ranks: 24 rows each
    with pytest.raises(LycheeCompileError, match="not whole heads"):
        _whole_heads(list(range(8, 24)), 16, 4, "k_proj")
