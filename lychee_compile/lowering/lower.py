"""Inductor lowering of `lychee::hybrid_decode` (and `lychee::hybrid_decode_mass`, the mass variant heat and Quest
build on) to the two Triton templates of kernel_source.py (kernels/*.py.jinja).

Private Inductor names come only through compat.py. Sizes: B (batch) and T (cache length) stay symbolic (kernel
arguments; the grids are symbolic in them); Hq, Hkv, D and the index width K are guarded static (they are
constexprs of the kernels, model constants in practice). The head kinds (`retrieval`) are a runtime tensor, so one
compiled kernel pair serves every layer and head map.
"""
from __future__ import annotations

import torch

from ..ops.op_arguments import arg_names, bind
from . import compat
from .compile import pdl_templates, sparse_tile
from .constexprs import combine_num_warps, interpreting, kernel_params
from .kernel_path import refusal
from .kernel_source import COMBINE_MASS_SOURCE, COMBINE_SOURCE, SPLIT_MASS_SOURCE, SPLIT_SOURCE

OP = torch.ops.lychee.hybrid_decode.default
MASS_OP = torch.ops.lychee.hybrid_decode_mass.default     # heat and Quest build on it (ops/heat.py, quest_decode.py)
SELECT_ROWS_OP = torch.ops.lychee.select_rows.default      # the deferred selection (ops/deferred_select.py)
INDEX_READY_OP = torch.ops.lychee.index_ready.default


@compat.SymbolicGridFn
def _split_grid(b, meta):
    return (meta["NUM_SPLITS"], 1, 1)


@compat.SymbolicGridFn
def _combine_grid(b, t, meta, *, cdiv):
    return (b * meta["HKV"], meta["G"] + cdiv(cdiv(t, meta["BS"]), meta["KC"]), 1)


_TEMPLATES = {}


def templates(mass: bool = False):
    """(split, combine) TritonTemplates; mass: the variant with extra blocks and per-block mass."""
    if not _TEMPLATES:
        for m, tag, (split, combine) in ((False, "", (SPLIT_SOURCE, COMBINE_SOURCE)),
                                         (True, "_mass", (SPLIT_MASS_SOURCE, COMBINE_MASS_SOURCE))):
            _TEMPLATES[m] = (compat.TritonTemplate(name=f"lychee_hybrid_split{tag}", grid=_split_grid, source=split),
                             compat.TritonTemplate(name=f"lychee_hybrid_combine{tag}", grid=_combine_grid,
                                                   source=combine))
    return _TEMPLATES[mass]


def _fallback(op, *args):
    """The op's eager reference as an extern kernel (inputs the templates do not handle)."""
    return _extern(op, *args)


def _extern(op, *args):
    """An extern call that is part of the lowering itself (the deferred selection's fork and join), not a
    fallback from it."""
    return compat.fallback_handler(op, add_to_fallback_set=False)(*args)


def supported(q, k, quest_mode: int = 0) -> str | None:
    """None if the Triton path handles these inputs (IR nodes), else why not (the eager reference then runs as an
    extern): kernel_path.refusal, the predicate the backend applies to the same sites before Inductor runs."""
    Hq, Hkv, D = (compat.static_int(x) for x in (q.get_size()[1], k.get_size()[1], q.get_size()[3]))
    return refusal(q.get_dtype(), k.get_dtype(), q.get_device(), Hq, Hkv, D, quest_mode)


def _row_inputs(valid, T, device):
    """(VALID as int8, [ROWLO, ROWHI, TVP]) for a valid mask, built once per graph: the rewrite pass gives every
    layer the same valid node, so a 32-layer step reduces the mask once instead of 32 times."""
    memo = compat.graph_memo()
    hit = memo.get(("row_inputs", id(valid)))
    if hit is not None and hit[0] is valid:
        return hit[1]
    res = (compat.realize(compat.to_dtype(valid, torch.int8)), _row_extent(valid, T, device))
    memo[("row_inputs", id(valid))] = (valid, res)      # holds `valid`, so its id cannot be reused meanwhile
    return res


def _row_extent(valid, T, device):
    """ROWLO, ROWHI int32 [B] (first valid position, one past the last; (0, 0) for an empty row) and TVP int32 [1]
    (the longest row end) as Inductor IR: reductions over VALID once per graph (_row_inputs) instead of every kernel
    program scanning the row. standalone.row_extent is the eager twin."""
    # The reductions run in int64, the index type of a looped reduction's positions: with int32 accumulators,
    # Inductor (torch 2.11) emitted a looped reduction (rows of >= 8K positions) whose accumulator starts int32 and
    # is re-assigned int64 in the loop, which Triton refuses to compile.
    aten, L = torch.ops.aten, compat.lowerings
    pos = L[torch.ops.prims.iota.default](T, start=0, step=1, dtype=torch.int64, device=device,
                                          requires_grad=False)                              # [T]
    hi = L[aten.amax.default](L[aten.where.self](valid, L[aten.add.Tensor](pos, 1), _int64(0, device)), [1])
    lo = L[aten.amin.default](L[aten.where.self](valid, pos, _int64(2**30, device)), [1])
    lo = L[aten.minimum.default](lo, hi)                                                    # empty row: 0
    lo, hi = (compat.to_dtype(x, torch.int32) for x in (lo, hi))
    return [compat.realize(x) for x in (lo, hi, L[aten.amax.default](hi, [0], True))]


def _int64(value: int, device):
    return compat.lowerings[torch.ops.aten.scalar_tensor.default](value, dtype=torch.int64, device=device)


def hybrid_decode_lowering(*args, **kwargs):
    # The templates implement every selection policy (a constexpr of the combine kernel) but no Quest bounds;
    # Quest and unsupported inputs run the reference (extern), with all of the op's arguments (its idx_out is
    # then complete on return, deferred or not).
    a = bind(OP, args, kwargs)           # name -> value, as the op's schema names them, defaults filled
    if supported(a["q"], a["k"], a["quest_mode"]) is not None:
        return _fallback(OP, *a.values())
    return _lower(**_template_args(a), defer=bool(a["defer_select"]))


def index_ready_lowering(idx, hold=()):
    """The join of a deferred selection: an extern call that makes the current stream wait for it, holding the
    buffers the side stream reads (so Inductor cannot reuse their memory before the join). The entry was left by
    the lowering of the op that produced `idx`. If a deferred selection is pending but `idx` is not its buffer
    (Inductor copied the index state instead of joining in place), the copy could read a half-written row: refuse
    to compile rather than race."""
    memo = compat.graph_memo().setdefault("deferred", {})
    name = compat.realize(idx).get_name()
    entry = memo.pop(name, None)
    if entry is None and memo:
        raise RuntimeError(f"lychee: index_ready on {name}, but the deferred selections pending are on "
                           f"{sorted(memo)}: the index state was copied before its join (please report this "
                           "with your torch version; LycheeConfig(defer_selection=False) avoids it)")
    return _extern(INDEX_READY_OP, idx, list(entry or ()) + list(hold))


def hybrid_decode_mass_lowering(*args, **kwargs):
    a = bind(MASS_OP, args, kwargs)
    if supported(a["q"], a["k"]) is not None:
        return _fallback(MASS_OP, *a.values())
    return _lower(**_template_args(a))


def _template_args(a: dict) -> dict:
    """What the templates take of a decode op's arguments, by name: the mass op's (hybrid_decode has no `extra`)."""
    return {name: a.get(name) for name in arg_names(MASS_OP)}


def _lower(q, k, v, valid, retrieval, idx_in, extra, scale, block_size, sink_tokens, local_tokens, policy,
           policy_param, select, defer=False):
    """The two templates for one site: (out, idx_out), or with `extra` given (the mass variant) (out, idx_out,
    mass). defer: the combine only writes the keys and a lychee::select_rows extern selects on a side stream
    (its join, index_ready_lowering, finds what to hold in the graph memo)."""
    mass = extra is not None
    B, Hq, _, D = q.get_size()
    T = k.get_size()[2]
    Hq, Hkv, D, K_sel = (compat.static_int(x) for x in (Hq, k.get_size()[1], D, idx_in.get_size()[2]))
    G = Hq // Hkv
    device = q.get_device()
    num_splits = 2 * compat.sm_count(device)
    nb_hint = -(-compat.size_hint(T) // int(block_size))
    sp, cp = kernel_params(G=G, Hkv=Hkv, D=D, K_sel=K_sel, block_size=int(block_size), sink_tokens=int(sink_tokens),
                           local_tokens=int(local_tokens), scale=float(scale), num_splits=num_splits,
                           nb_hint=nb_hint, policy=int(policy), policy_param=float(policy_param), mass=mass,
                           **sparse_tile(),
                           extra_width=compat.static_int(extra.get_size()[2]) if mass else 0, defer=defer)
    pdl = pdl_templates(device)       # both launches with programmatic dependent launch (template PDL)
    sp, cp = dict(sp, DOT_UPCAST=interpreting(), PDL=int(pdl)), dict(cp, PDL=int(pdl))
    launch = dict(triton_meta={"launch_pdl": True}) if pdl else {}
    NB = compat.CeilDiv(T, int(block_size))
    f32, i32 = torch.float32, torch.int32
    q, k, v, idx_in = (compat.realize(x) for x in (q, k, v, idx_in))
    valid8, ext = _row_inputs(valid, T, device)             # int8 [B, T]; [ROWLO, ROWHI, TVP]
    retr8 = compat.realize(compat.to_dtype(retrieval, torch.int8))
    sel8 = retr8 if select is None else compat.realize(compat.to_dtype(select, torch.int8))   # SEL [Hkv]
    pm = compat.empty_strided([B * Hkv, num_splits, G], None, dtype=f32, device=device)
    pl = compat.empty_strided([B * Hkv, num_splits, G], None, dtype=f32, device=device)
    blse = compat.empty_strided([B, Hkv, G, NB], None, dtype=f32, device=device)
    keys = compat.empty_strided([B, Hkv, NB], None, dtype=i32, device=device)
    cnt = compat.empty_strided([B * Hkv], None, dtype=i32, device=device)
    idx_out = compat.empty_strided(list(idx_in.get_size()), None, dtype=i32, device=device)
    mass_in, mass_out = [], []
    if mass:     # EXTRA, VBLSE, MASSO (see the template glossary); MASSO is zeroed by the split launch
        masso = compat.empty_strided([B, Hkv, NB], None, dtype=f32, device=device)
        vblse = compat.empty_strided([B * Hkv, G, sp["NVB"]], None, dtype=f32, device=device)
        mass_in, mass_out = [compat.realize(extra), vblse, masso], [masso]
    split_t, combine_t = templates(mass)

    acc_layout = compat.fixed_layout(device, f32, [B * Hkv, num_splits, G, D])
    split_inputs = [q, k, v, *ext, retr8, idx_in, pm, pl, blse, cnt, *mass_in]
    choices = []
    err = split_t.maybe_append_choice(choices, input_nodes=split_inputs, layout=acc_layout,
                                      mutated_inputs=[pm, pl, blse, cnt, *mass_in[1:]], call_sizes=[B],
                                      num_stages=3, num_warps=4, **launch, **sp)
    if not choices:
        raise RuntimeError(f"lychee hybrid_decode split template failed: {err}")
    pacc = compat.select_one(split_t.name, choices, split_inputs, acc_layout)

    out_layout = compat.fixed_layout(device, q.get_dtype(), [B, Hq, 1, D])
    combine_inputs = [pacc, pm, pl, blse, valid8, *ext, retr8, sel8, idx_in, idx_out, keys, cnt, *mass_in]
    choices = []
    err = combine_t.maybe_append_choice(choices, input_nodes=combine_inputs, layout=out_layout,
                                        mutated_inputs=[idx_out, keys, cnt, *mass_out], call_sizes=[B, T],
                                        num_stages=1, num_warps=combine_num_warps(defer), **launch, **cp)
    if not choices:
        raise RuntimeError(f"lychee hybrid_decode combine template failed: {err}")
    out = compat.select_one(combine_t.name, choices, combine_inputs, out_layout)
    if defer:
        _extern(SELECT_ROWS_OP, keys, idx_out, *ext, retr8, sel8, int(block_size), G, int(policy),
                  float(policy_param), nb_hint)
        compat.graph_memo().setdefault("deferred", {})[idx_out.get_name()] = (keys, retr8, sel8)
    return (out, idx_out, masso) if mass else (out, idx_out)
