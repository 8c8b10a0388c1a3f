"""Standalone launchers of the hybrid decode kernels, for tests and benchmarks only: the library never imports this
module (tests/test_kernel_text.py checks). The same Jinja text Inductor renders (kernel_source.py) becomes a plain
`@triton.jit` kernel with explicit size / stride arguments: what the TRITON_INTERPRET=1 kernel tests, the sm_90
cross-compile checks (cross_compile) and the benchmarks' "kernel only" timings (make_launchers) run.
"""
from __future__ import annotations

import functools

import jinja2
import torch

from .constexprs import SELECT_CONSTEXPRS, combine_num_warps, kernel_params
from .deferred import launch_select, select_kernel
from .kernel_module import load_module
from .kernel_source import (COMBINE_MASS_SOURCE, COMBINE_OUT, COMBINE_SOURCE, MODULE_PRELUDE, RANKS,
                            SPLIT_MASS_SOURCE, SPLIT_OUT, SPLIT_SOURCE, kernel_tensors)


class _StandaloneRenderer:
    def __init__(self, name, tensors, out, constexprs):
        self.name, self.tensors, self.out, self.constexprs = name, tensors, out, constexprs
        self.scalars: list[str] = []

    def def_kernel(self, *names):
        assert tuple(names) == tuple(self.tensors), names
        return "<DEF_KERNEL>"

    def _scalar(self, s):
        if s not in self.scalars:
            self.scalars.append(s)
        return s

    def size(self, name, index):
        return self._scalar(f"size_{name}_{index}")

    def stride(self, name, index=None):
        if index is not None:
            return self._scalar(f"stride_{name}_{index}")
        return ", ".join(self._scalar(f"stride_{name}_{i}") for i in range(self.tensors[name]))

    def store_output(self, indices, val, mask=None, indent_width=4, **_):
        oname, rank = self.out
        offs = " + ".join(f"({ix}) * {self._scalar(f'stride_{oname}_{i}')}" for i, ix in enumerate(indices))
        m = f", mask={mask}" if mask else ""
        return f"tl.store({oname} + {offs}, ({val}).to({oname}.dtype.element_ty){m})"

    def render(self, source):
        # the constexprs reach the Jinja text too, as Inductor renders it (the head dim's padding branches on DP)
        body = jinja2.Template(source).render(def_kernel=self.def_kernel, size=self.size, stride=self.stride,
                                              store_output=self.store_output, **self.constexprs)
        args = list(self.tensors) + [self.out[0]] + self.scalars
        defines = "".join(f"    {k}: tl.constexpr = {v!r}\n" for k, v in sorted(self.constexprs.items()))
        header = f"@triton.jit\ndef {self.name}({', '.join(args)}):\n" + defines
        return body.replace("<DEF_KERNEL>", header.rstrip("\n"), 1), args


def render_text(kind: str, constexprs: dict) -> tuple[str, list]:
    """(module text, argument names) of one kernel configuration ("split" or "combine"), not loaded."""
    mass = bool(constexprs.get("MASS", 0))
    if kind == "split":
        r = _StandaloneRenderer("lychee_hybrid_split", kernel_tensors(kind, mass), SPLIT_OUT, constexprs)
        src, args = r.render(SPLIT_MASS_SOURCE if mass else SPLIT_SOURCE)
    else:
        r = _StandaloneRenderer("lychee_hybrid_combine", kernel_tensors(kind, mass), COMBINE_OUT, constexprs)
        src, args = r.render(COMBINE_MASS_SOURCE if mass else COMBINE_SOURCE)
    return MODULE_PRELUDE + src, args


@functools.lru_cache(maxsize=None)
def _standalone(kind: str, constexpr_items: tuple):
    text, args = render_text(kind, dict(constexpr_items))
    return getattr(load_module(kind, text), f"lychee_hybrid_{kind}"), args, text


def render_standalone(kind: str, constexprs: dict):
    """(jit function, argument names, module text) of one kernel configuration."""
    return _standalone(kind, tuple(sorted(constexprs.items())))


def _default_num_splits(device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def workspace(B, Hkv, G, D, T, block_size, num_splits, device):
    nb = -(-T // block_size)
    f32 = torch.float32
    return dict(
        PM=torch.empty(B * Hkv, num_splits, G, dtype=f32, device=device),
        PL=torch.empty(B * Hkv, num_splits, G, dtype=f32, device=device),
        BLSE=torch.empty(B, Hkv, G, nb, dtype=f32, device=device),
        PACC=torch.empty(B * Hkv, num_splits, G, D, dtype=f32, device=device),
        KEYS=torch.empty(B, Hkv, nb, dtype=torch.int32, device=device),
        CNT=torch.empty(B * Hkv, dtype=torch.int32, device=device),
    )


def _arg_values(args, tensors):
    vals = []
    for a in args:
        if a in tensors:
            vals.append(tensors[a])
        elif a.startswith("size_"):
            name, i = a[5:].rsplit("_", 1)
            vals.append(tensors[name].shape[int(i)])
        elif a.startswith("stride_"):
            name, i = a[7:].rsplit("_", 1)
            vals.append(tensors[name].stride(int(i)))
        else:
            raise KeyError(a)
    return vals


def make_launchers(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens, out=None,
                   idx_out=None, num_splits=None, block_n=64, nbr_max=16384, ws=None, split_warps=4,
                   split_stages=3, combine_warps=None, blse_sums=0, sparse_cost=3, sparse_bn=128, sparse_stages=2,
                   select=None,
                   policy=0, policy_param=0.0, select_tiers=(1024, 8192), extra=None, with_mass=False,
                   sel_probe=0, defer=False, defer_launch=True, slot_chunk=64, pdl=0):
    """Bind both kernels to fixed buffers: returns (split(), combine(), out, idx_out, mass or None). Nothing is
    allocated per call, so the pair can be captured in a CUDA graph. extra / with_mass: the mass variant
    (lychee::hybrid_decode_mass). defer: the combine leaves the top-k to lychee_select_rows, which combine() then
    launches right after it on the same stream (the lowering puts it on a side stream); defer_launch=False
    (benchmarks only: the combine's critical path alone) leaves it out, and the selecting heads' index rows
    unwritten. pdl=1 launches both with programmatic dependent launch (CUDA sm_90+), as the lowering does there.
    sel_probe (benchmarks only): a timing probe of the selection's stages (SEL_PROBE in the combine: 1 stops after
    the ticket, 2 after reloading the keys; index rows are then WRONG); kernel_params always sets 0."""
    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G = Hq // Hkv
    K_sel = idx_in.shape[-1]
    if num_splits is None:
        num_splits = _default_num_splits(q.device)
    nb = -(-T // block_size)
    sp, cp = kernel_params(G=G, Hkv=Hkv, D=D, K_sel=K_sel, block_size=block_size, sink_tokens=sink_tokens,
                           local_tokens=local_tokens, scale=float(scale), num_splits=num_splits, nb_hint=nb,
                           block_n=block_n, nbr_max=nbr_max, blse_sums=blse_sums, sparse_cost=sparse_cost,
                           sparse_bn=sparse_bn, sparse_stages=sparse_stages,
                           policy=policy, policy_param=policy_param, select_tiers=tuple(select_tiers),
                           mass=with_mass or extra is not None, extra_width=0 if extra is None else extra.shape[-1],
                           defer=defer, slot_chunk=slot_chunk)
    if ws is None:
        ws = workspace(B, Hkv, G, D, T, block_size, num_splits, q.device)
    mass_ws = {}
    if sp["MASS"]:
        extra = torch.full((B, Hkv, 0), -1, dtype=torch.int32, device=q.device) if extra is None else extra
        mass_ws = dict(EXTRA=extra, VBLSE=torch.empty(B * Hkv, G, sp["NVB"], dtype=torch.float32, device=q.device),
                       MASSO=torch.empty(B, Hkv, nb, dtype=torch.float32, device=q.device))
        mass_ws.update({n: ws[n] for n in ("VBLSE", "MASSO") if n in ws})     # tests poison them
    ws = {n: t for n, t in ws.items() if n not in mass_ws}
    out = torch.empty_like(q) if out is None else out
    idx_out = torch.empty_like(idx_in) if idx_out is None else idx_out
    valid8 = valid.to(torch.int8)
    ext = row_extent(valid)
    retr8 = retrieval.to(torch.int8)
    sel8 = retr8 if select is None else select.to(torch.int8)
    sp, cp = dict(sp, PDL=int(pdl)), dict(cp, PDL=int(pdl), SEL_PROBE=int(sel_probe))
    launch = dict(launch_pdl=True) if pdl else {}     # pdl=1: as the lowering launches them on sm_90+
    ks, kargs, _ = render_standalone("split", sp)
    kc, cargs, _ = render_standalone("combine", cp)
    v1 = _arg_values(kargs, dict(Q=q, K=k, V=v, **ext, RETR=retr8, IDX=idx_in, **ws, **mass_ws))
    v2 = _arg_values(cargs, dict(PACC=ws["PACC"], PM=ws["PM"], PL=ws["PL"], BLSE=ws["BLSE"], VALID=valid8,
                                 **ext, RETR=retr8, SEL=sel8, IDX=idx_in, IDXO=idx_out, KEYS=ws["KEYS"], CNT=ws["CNT"],
                                 OUT=out, **mass_ws))
    combine_grid = (B * Hkv, G + -(-nb // cp["KC"]))

    def split():
        ks[(num_splits,)](*v1, num_warps=split_warps, num_stages=split_stages, **launch)

    warps = combine_warps or combine_num_warps(defer)

    def combine():
        kc[combine_grid](*v2, num_warps=warps, num_stages=1, **launch)
        if defer and defer_launch:
            launch_select(ws["KEYS"], ext["ROWLO"], ext["ROWHI"], ext["TVP"], retr8, sel8, idx_out, cp)

    return split, combine, out, idx_out, mass_ws.get("MASSO")


def row_extent(valid):
    """{ROWLO, ROWHI: int32 [B], TVP: int32 [1]} from valid bool [B, T]: each row's first valid position and one
    past its last ((0, 0) for an empty row), and the longest row end.
    The standalone launcher's twin of lower.py's `_row_extent` (Inductor IR); the kernel tests compare both paths
    with the reference."""
    T = valid.shape[1]
    pos = torch.arange(T, dtype=torch.int32, device=valid.device)
    hi = torch.where(valid, pos + 1, 0).amax(1).to(torch.int32)
    lo = torch.minimum(torch.where(valid, pos, T).amin(1).to(torch.int32), hi)
    return dict(ROWLO=lo.contiguous(), ROWHI=hi.contiguous(), TVP=hi.amax().reshape(1))


def hybrid_decode_triton(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens, **kw):
    """Standalone launcher of the two kernels (same source as the Inductor lowering). Returns (out, idx_out), or
    (out, idx_out, mass) with extra= / with_mass=True (lychee::hybrid_decode_mass)."""
    split, combine, out, idx_out, mass = make_launchers(q, k, v, valid, retrieval, idx_in, scale, block_size,
                                                        sink_tokens, local_tokens, **kw)
    split()
    combine()
    return (out, idx_out) if mass is None else (out, idx_out, mass)


def cross_compile(kind: str, constexprs: dict, dtype: str = "bf16", num_warps: int = 4, num_stages: int = 3,
                  arch: int = 90):
    """Compile one kernel configuration for CUDA sm_`arch` without a GPU (triton's bundled ptxas); kind "split",
    "combine" or "select" (the deferred top-k, lychee_select_rows, from the combine's constexprs). Returns the
    CompiledKernel (asm["ptx"], asm["cubin"], n_regs, n_spills). Must run without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if kind == "select":     # lychee_select_rows: explicit arguments, the selection constexprs by name
        names = ("KEYS", "ROWLO", "ROWHI", "TVP", "RETR", "SEL", "IDXO")
        types = ("*i32", "*i32", "*i32", "*i32", "*i8", "*i8", "*i32")
        signature = dict(zip(names, types), NB="i32", stride_ob="i32", stride_oh="i32", stride_ok="constexpr",
                         **{c: "constexpr" for c in SELECT_CONSTEXPRS})
        consts = dict({c: constexprs[c] for c in SELECT_CONSTEXPRS}, stride_ok=1)
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
        src = ASTSource(select_kernel(), signature, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    fn, args, _ = render_standalone(kind, dict(constexprs, DOT_UPCAST=False) if kind == "split" else constexprs)
    ptr_types = {"Q": dtype, "K": dtype, "V": dtype, "VALID": "i8", "ROWLO": "i32", "ROWHI": "i32", "TVP": "i32",
                 "RETR": "i8", "SEL": "i8", "IDX": "i32", "IDXO": "i32", "KEYS": "i32", "CNT": "i32", "PM": "fp32",
                 "PL": "fp32", "BLSE": "fp32", "PACC": "fp32", "OUT": dtype, "EXTRA": "i32", "VBLSE": "fp32",
                 "MASSO": "fp32"}
    signature, consts, attrs = {}, {}, {}
    rank = RANKS
    for i, a in enumerate(args):
        if a in ptr_types:
            signature[a] = "*" + ptr_types[a]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a.startswith("stride_") and a.endswith(f"_{rank[a[7:].rsplit('_', 1)[0]] - 1}"):
            signature[a] = "constexpr"   # innermost stride 1, as the runtime specialises it
            consts[a] = 1
        else:
            signature[a] = "i32"
            if a.startswith("stride_"):   # outer strides: multiples of 16 elements for D in (64, 128, 256)
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
