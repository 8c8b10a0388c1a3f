"""Tensor parallelism: which KV heads this rank's attention holds, and ranks that fail together.

A model sharded by transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")` or
`distributed_config=DistributedConfig(...)`, under torchrun) keeps its weights as DTensors: q / k / v projections
sharded by output rows, so each rank computes the attention of some KV heads (and their query heads), and o_proj
sums the ranks' outputs with one all-reduce. lychee's method is rank-local under that split: a sparse head inherits
the selection of its own KV head in the previous global layer, and that head lives on the same rank. So each rank
rewrites its own decode graph with the columns of the (global) head map that belong to its KV heads, and no
collective is added to a decode step.

Which KV heads a rank holds is read from the attention weights' placements (DTensor computes this rank's rows of a
global index tensor, `_owned_rows`), never assumed from the rank number. Refused, on every rank: KV heads split
mid-head (they do not divide by the ranks), a layout whose K rows are not whole heads of one weight (fused q/k/v
projections sharded by rows, GPT-NeoX's query_key_value), a query head away from its KV head's rank, or layers that
place different heads on a rank. Attention that every rank computes whole (Phi3's plan gathers its fused qkv_proj)
uses the whole map on every rank.

`agreed` runs a check on every rank and gathers the outcomes: one rank's error is raised, with the same message, on
all of them -- before the probe's collective forward, and before anything changes -- instead of one rank raising
while the others wait in a collective.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from . import errors
from .errors import LycheeCompileError

log = logging.getLogger("lychee_compile")


@dataclasses.dataclass
class KVShard:
    """This rank's part of a tensor-parallel model's attention. heads: the global KV heads its decode graph holds,
    in the graph's order; all of them where attention is replicated. group: the process group of the ranks that
    share the model; rank / world: this rank's place in it."""
    heads: list[int]
    num_kv_heads: int
    group: object
    rank: int
    world: int

    def columns(self, head_map_rows: torch.Tensor) -> torch.Tensor:
        """bool [layers, num_kv_heads] (a head map, global) -> bool [layers, len(heads)], this rank's KV heads."""
        return head_map_rows[:, self.heads]

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        if len(self.heads) == self.num_kv_heads:
            return (f"tensor parallel over {self.world} ranks, attention replicated: each rank runs all "
                    f"{self.num_kv_heads} KV heads")
        return (f"tensor parallel over {self.world} ranks: each rank rewrites its {len(self.heads)} of "
                f"{self.num_kv_heads} KV heads (rank {self.rank}: {self.heads}); no collective added per step")


def process_group(model):
    """The process group over which the model's weights are sharded, or None (no DTensor parameter, or
    torch.distributed not initialized): the ranks that must call lychee_compile together."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return None
    for p in model.parameters():
        if isinstance(p, dtensor):
            mesh = p.device_mesh
            sharded = [i for i, pl in enumerate(p.placements) if not pl.is_replicate()]
            return mesh.get_group(sharded[0]) if mesh.ndim > 1 and len(sharded) == 1 else _whole_mesh_group(mesh)
    return None


def _whole_mesh_group(mesh):
    if mesh.ndim == 1:
        return mesh.get_group()
    import torch.distributed as dist
    return dist.group.WORLD


def _dtensor_type():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def agreed(group, check, same=None):
    """check() on every rank of `group`; if it raised on any rank, every rank raises the first failing rank's error
    (same class where it is one of lychee_compile's, same message). same(result), if given, must be equal on every
    rank (inputs that must not differ between ranks: the head map, the config). group None: just check()."""
    if group is None:
        return check()
    import torch.distributed as dist
    result, failure = None, None
    try:
        result = check()
    except Exception as exc:   # noqa: BLE001  (any error: the other ranks must not wait for this one in a collective)
        failure = exc
    mine = ((type(failure).__name__, str(failure)) if failure is not None else None,
            same(result) if failure is None and same is not None else None)
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    for rank, (error, _) in enumerate(reports):
        if error is not None:
            cls = getattr(errors, error[0], None)
            cls = cls if isinstance(cls, type) and issubclass(cls, Exception) else LycheeCompileError
            raise cls(f"{error[1]} (tensor-parallel rank {rank} of {len(reports)}; raised on every rank)") from failure
    tokens = {repr(token) for _, token in reports}
    if len(tokens) > 1:
        raise LycheeCompileError(f"the {len(reports)} tensor-parallel ranks were given different head maps or "
                                 f"configs ({sorted(tokens)}); pass the same ones on every rank.")
    return result


def resolved_all_reduce(config, shard: KVShard | None, device):
    """(config with symm_mem_all_reduce decided, the log line, the failure if symmetric memory failed, the buffer).
    On: a tensor-parallel model on CUDA whose torch has the one-shot kernel and where symmetric memory works on the
    group -- checked by making lychee::one_shot_all_reduce's buffer (symmetric_buffer), before anything changes and
    outside any CUDA-graph pool. The same answer on every rank: a failure on any rank raises on all of them in strict
    mode and turns the option off on all of them otherwise (logged as a warning), so no rank waits in a one-shot
    barrier that another rank never reaches."""
    if not config.symm_mem_all_reduce:
        return config, "all-reduces: the process group's own (symm_mem_all_reduce=False)", None, None
    why_not = ("one process" if shard is None or shard.world == 1 else
               f"the model is on {device.type}, not CUDA" if device.type != "cuda" else
               f"torch {torch.__version__} has no symm_mem one-shot all-reduce" if not _has_one_shot() else None)
    buffer = failure = None
    if why_not is None:
        try:
            buffer = symmetric_buffer(shard.group, device)
        except Exception as exc:  # noqa: BLE001  (raised on every rank by `agreed`, with the failing rank's words)
            message = (f"symmetric memory does not work on the tensor-parallel group ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:300]}); pass LycheeConfig(symm_mem_all_reduce=False) to keep "
                       "the process group's all-reduces")
            if config.strict:
                raise LycheeCompileError(message) from exc
            log.warning("lychee_compile: %s -- keeping them", message)
            why_not = failure = message
    if why_not is not None:
        off = dataclasses.replace(config, symm_mem_all_reduce=False)
        return off, f"all-reduces: the process group's own ({why_not})", failure, None
    return config, ("all-reduces of at most 128 KB: one-shot symmetric-memory kernels (lychee::one_shot_all_reduce; "
                    f"symmetric-memory backend {symm_mem_backend(buffer.device)})"), None, buffer


def symm_mem_backend(device) -> str:
    """torch's symmetric-memory backend on `device` (CUDA, NVSHMEM or NCCL): what frees the buffer at exit."""
    from torch.distributed import _symmetric_memory as symm_mem
    get = getattr(symm_mem, "get_backend", None)
    return str(get(device)) if get is not None else "unknown"


def _has_one_shot() -> bool:
    try:
        return hasattr(torch.ops.symm_mem, "one_shot_all_reduce")
    except (AttributeError, RuntimeError):
        return False


def symmetric_buffer(group, device) -> torch.Tensor:
    """lychee::one_shot_all_reduce's buffer (uint8 [ONE_SHOT_BYTES]) on this rank, rendezvoused over `group`. Every
    rank first allocates (one rank's failure raised on all, via `agreed`), and only then do all of them enter the
    rendezvous, a collective that would wait for a rank that failed before it."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = agreed(group, lambda: _allocated(group, device))
    agreed(group, lambda: _rendezvous(buffer, group))
    return buffer


def _allocated(group, device) -> torch.Tensor:
    import warnings
    from torch.distributed import _symmetric_memory as symm_mem
    from .ops.one_shot_all_reduce import ONE_SHOT_BYTES
    with warnings.catch_warnings():     # deprecated in torch 2.13 (not needed there), required on 2.11
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group.group_name)
    return symm_mem.empty(ONE_SHOT_BYTES, dtype=torch.uint8, device=device).zero_()


def _rendezvous(buffer: torch.Tensor, group) -> None:
    from torch.distributed import _symmetric_memory as symm_mem
    symm_mem.rendezvous(buffer, group.group_name)


def kv_shard(model, sites, num_kv_heads: int, group, strict: bool = True) -> KVShard | None:
    """This rank's KV heads, from the probe's global decode sites and their attention modules' weights; None for a
    model in one process. Raises LycheeCompileError for a layout the rewrite cannot serve (in one process, a graph
    whose KV heads are not the map's: strict only -- non-strict, the pass `check` leaves its graphs dense)."""
    graph_heads = {s.kv_heads() for s in sites}
    if len(graph_heads) != 1:
        raise LycheeCompileError(f"the decode graph's global layers hold different numbers of KV heads "
                                 f"({sorted(graph_heads)}); one count per rank is needed.")
    local = graph_heads.pop()
    if group is None:
        if local != num_kv_heads and strict:
            raise LycheeCompileError(f"the graph's global layers have {local} KV heads but the head map has "
                                     f"{num_kv_heads}: this model's attention is not the one its config describes.")
        return None
    import torch.distributed as dist
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if local == num_kv_heads:
        heads = list(range(num_kv_heads))
    else:
        q_heads = int(model.config.num_attention_heads)
        per_layer = {s.layer_idx: _owned_heads(s, num_kv_heads, q_heads) for s in sites}
        heads = per_layer[sites[0].layer_idx]
        if any(h != heads for h in per_layer.values()):
            raise LycheeCompileError(f"the global layers place different KV heads on rank {rank} ({per_layer}); "
                                     "a sparse head inherits from its own KV head in the previous layer, which must "
                                     "be on the same rank.")
        if len(heads) != local:
            raise LycheeCompileError(f"rank {rank}'s attention weights hold KV heads {heads} but its decode graph "
                                     f"computes {local}; the projection's output is laid out another way.")
    return KVShard(heads, num_kv_heads, group, rank, world)


def _owned_heads(site, num_kv_heads: int, q_heads: int) -> list[int]:
    """The global KV heads whose K rows this rank's attention weights hold, checked against V and Q."""
    dtensor = _dtensor_type()
    head_dim = int(site.kv_k.meta["example_value"].shape[-1])
    # q / k / v: the attention's DTensor weights sharded by output rows (o_proj is sharded by input features)
    weights = [(n, p) for n, p in site.module.named_parameters() if isinstance(p, dtensor) and p.dim() == 2
               and _row_sharded(p)]
    where = f"layer {site.layer_idx}"
    kv = [(n, p) for n, p in weights if p.shape[0] == num_kv_heads * head_dim]
    if not kv:
        names = [n for n, _ in weights] or "none"
        raise LycheeCompileError(
            f"{where}: no DTensor weight of the attention holds the K rows of {num_kv_heads} KV heads x {head_dim} "
            f"(sharded weights: {names}). A fused query/key/value projection sharded by rows is not supported under "
            "tensor parallelism: its rows on a rank are not whole KV heads of K. Use a plan that gathers the fused "
            "projection's output (attention replicated), or unfused q/k/v projections.")
    heads = None
    for name, p in kv:
        owned = _whole_heads(_owned_rows(p), head_dim, num_kv_heads, f"{where}: {name}")
        if heads is not None and owned != heads:
            raise LycheeCompileError(f"{where}: {name} holds KV heads {owned} on this rank but {kv[0][0]} holds "
                                     f"{heads}; K and V must be split the same way.")
        heads = owned
    group_size = q_heads // num_kv_heads
    for name, p in weights:
        if p.shape[0] == q_heads * head_dim and q_heads != num_kv_heads:
            q_owned = _whole_heads(_owned_rows(p), head_dim, q_heads, f"{where}: {name}")
            want = [h * group_size + g for h in heads for g in range(group_size)]
            if q_owned != want:
                raise LycheeCompileError(f"{where}: {name} holds query heads {q_owned} on this rank, but its KV "
                                         f"heads {heads} serve query heads {want}; query heads must be on their KV "
                                         "head's rank.")
    return heads


def _row_sharded(weight) -> bool:
    """Sharded, and only along dim 0 (strided shards included): every rank holds whole rows."""
    sharded = [pl for pl in weight.placements if not pl.is_replicate()]
    return bool(sharded) and all(getattr(pl, "dim", None) in (0, -weight.dim()) for pl in sharded)


def _owned_rows(weight) -> list[int]:
    """The global row indices of `weight` (a DTensor sharded by rows) this rank holds, in its local order: DTensor
    shards an index tensor laid out like the weight's rows (no communication: every rank has the same indices)."""
    from torch.distributed.tensor import distribute_tensor
    index = torch.arange(weight.shape[0], device=weight.to_local().device)
    return distribute_tensor(index, weight.device_mesh, weight.placements, src_data_rank=None).to_local().tolist()


def _whole_heads(rows: list[int], head_dim: int, num_heads: int, what: str) -> list[int]:
    """Row indices -> the heads they form; refuses rows that are not whole heads (heads split between ranks)."""
    if len(rows) % head_dim:
        raise LycheeCompileError(f"{what}: this rank holds {len(rows)} rows, not whole heads of {head_dim}: the "
                                 f"{num_heads} heads do not divide evenly by the tensor-parallel size. Use a "
                                 "tensor-parallel size that divides the number of KV heads.")
    heads = [rows[i] // head_dim for i in range(0, len(rows), head_dim)]
    for i, h in enumerate(heads):
        if rows[i * head_dim:(i + 1) * head_dim] != list(range(h * head_dim, (h + 1) * head_dim)):
            raise LycheeCompileError(f"{what}: this rank's rows {rows} are not whole heads of {head_dim}: the "
                                     f"{num_heads} heads do not divide evenly by the tensor-parallel size.")
    return heads


class LocalLinearShards:
    """The compiled calls' view of a tensor-parallel model's nn.Linear weights: their local shards.

    Why: a graph input that is a DTensor costs the host, on every call, a guard on its sharding spec and an unwrap
    to its local tensor (~225 of each for Llama-3-8B's decode step; measured with benchmarks/tp_decode.py
    --profile-rows, docs/tensor-parallel.md) -- as much host time as the GPU's whole step under TP, so the step
    waited on the CPU. transformers' TP runs every nn.Linear on its local shard anyway when no gradient is needed
    (its `should_use_local_tensors`: the weights' `to_local()` inside the forward, all-reduce / gather on the
    outputs), so around a compiled call made without gradients each such weight is swapped for a Parameter on its
    local shard (same storage, no copy) and swapped back after: the graph computes the same products and issues
    the same collectives, with plain tensors as inputs. Nothing else (embeddings, norms) is touched.

    A weight replaced or moved after lychee_compile (a new Parameter; `model.to(...)`, which swaps a DTensor's
    contents in place) is noticed at the next call -- by identity, and by the local tensor's storage, dtype and
    device -- and its shard taken again; in-place updates reach the shard through the shared storage. One call at a
    time per model (the swap is the model's state while it lasts), as generate() makes them."""

    def __init__(self, model):
        self.model = model
        self.swaps = self._collect()
        self.depth, self.active = 0, False         # a call inside a call keeps the outer swap

    def _collect(self) -> list:
        """[(module._parameters, name, the DTensor parameter, a Parameter on its local shard)]"""
        dtensor = _dtensor_type()
        out = []
        with torch.no_grad():
            for module in self.model.modules():
                if not isinstance(module, torch.nn.Linear):
                    continue
                for name, p in module._parameters.items():
                    if dtensor is not None and isinstance(p, dtensor):
                        out.append((module._parameters, name, p,
                                    torch.nn.Parameter(p.to_local(), requires_grad=False)))
        return out

    @staticmethod
    def _stale(current, original, local) -> bool:
        shard = getattr(original, "_local_tensor", None)
        return (current is not original or shard is None or shard.data_ptr() != local.data_ptr()
                or shard.dtype != local.dtype or shard.device != local.device)

    def owners(self) -> dict:
        """id(local-shard Parameter) -> the model's DTensor parameter it stands for."""
        return {id(local): original for _, _, original, local in self.swaps}

    def __len__(self) -> int:
        return len(self.swaps)

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:
            self.active = not torch.is_grad_enabled()
            if self.active:
                if any(self._stale(params.get(name), orig, local) for params, name, orig, local in self.swaps):
                    self.swaps = self._collect()
                for params, name, _, local in self.swaps:
                    params[name] = local
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0 and self.active:
            for params, name, original, _ in self.swaps:
                params[name] = original
            self.active = False
        return False


def local_linear_shards(model) -> LocalLinearShards | None:
    """LocalLinearShards of a model with DTensor nn.Linear weights, else None."""
    shards = LocalLinearShards(model)
    return shards if len(shards) else None
