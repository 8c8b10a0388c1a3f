"""Cross-compile every kernel configuration we ship for CUDA sm_90 on a machine without a GPU
(`triton.compile(..., target=GPUTarget("cuda", 90, 32))`, triton's bundled ptxas), and check tokens of the PTX.

Runs in a subprocess: TRITON_INTERPRET=1 (set by the interpreter tests in this process) turns @triton.jit into the
interpreter and triton.compile needs the real JIT.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CONFIGS = [
    # G, Hkv, D, K_sel, dtype, nb_hint, policy (policies.POLICIES), policy param[, extra width KX: the mass variant]
    (4, 8, 128, 256, "bf16", 8192, 0, 0.0),   # Llama-3-8B, budget 4096, 128K
    (1, 4, 64, 64, "fp16", 2048, 0, 0.0),
    (3, 2, 256, 32, "bf16", 512, 0, 0.0),
    (7, 2, 128, 64, "bf16", 4096, 0, 0.0),
    (8, 1, 128, 128, "fp16", 16384, 0, 0.0),
    (4, 8, 128, 256, "bf16", 8192, 1, 0.9),   # the selection policies in the combine kernel
    (3, 2, 128, 64, "fp16", 1024, 2, 0.01),
    (1, 4, 64, 64, "bf16", 2048, 3, 0.3),
    (4, 8, 128, 256, "bf16", 8192, 0, 0.0, 32),   # the mass variant (heat picks / Quest picks as EXTRA)
    (2, 4, 64, 64, "fp16", 2048, 0, 0.0, 0),
    (4, 8, 96, 128, "bf16", 8192, 0, 0.0),     # Phi-3's head dim 96 (tiles padded to 128 lanes inside)
    (1, 32, 80, 64, "fp16", 2048, 0, 0.0, 8),  # Phi-2's 80, MHA, the mass variant
]

SCRIPT = r"""
import json, sys
from lychee_compile.lowering.constexprs import kernel_params
from lychee_compile.lowering.standalone import cross_compile
res = []
for G, Hkv, D, K, dt, nb, policy, param, *kx in json.loads(sys.argv[1]):
    sp, cp = kernel_params(G=G, Hkv=Hkv, D=D, K_sel=K, block_size=16, sink_tokens=16, local_tokens=64,
                           scale=D ** -0.5, num_splits=264, nb_hint=nb, policy=policy, policy_param=param,
                           mass=bool(kx), extra_width=kx[0] if kx else 0)
    a = cross_compile("split", sp, dtype=dt, num_warps=4, num_stages=3)
    b = cross_compile("combine", cp, dtype=dt, num_warps=8, num_stages=1)
    r = dict(split_ptx=a.asm["ptx"], combine_ptx=b.asm["ptx"], split_cubin=len(a.asm["cubin"]),
             combine_cubin=len(b.asm["cubin"]), split_smem=a.metadata.shared)
    if not kx:    # the deferred selection: the combine without the top-k (4 warps) and lychee_select_rows (16)
        _, cd = kernel_params(G=G, Hkv=Hkv, D=D, K_sel=K, block_size=16, sink_tokens=16, local_tokens=64,
                              scale=D ** -0.5, num_splits=264, nb_hint=nb, policy=policy, policy_param=param,
                              defer=True)
        r["deferred_combine_ptx"] = cross_compile("combine", cd, dtype=dt, num_warps=4, num_stages=1).asm["ptx"]
        r["select_ptx"] = cross_compile("select", cd, num_warps=16, num_stages=1).asm["ptx"]
        if not res:   # programmatic dependent launch (PDL=1, what the lowering sets on sm_90+): the first config
            r["pdl_split_ptx"] = cross_compile("split", dict(sp, PDL=1), dtype=dt, num_warps=4,
                                               num_stages=3).asm["ptx"]
            r["pdl_combine_ptx"] = cross_compile("combine", dict(cd, PDL=1), dtype=dt, num_warps=4,
                                                 num_stages=1).asm["ptx"]
    res.append(r)
print("RESULT" + json.dumps(res))
"""


def test_cross_compile_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CONFIGS)], capture_output=True, text=True, env=env,
                       timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.split("RESULT", 1)[1])
    assert len(res) == len(CONFIGS) and "pdl_split_ptx" in res[0]
    for (G, Hkv, D, K, dt, nb, policy, *_), r in zip(CONFIGS, res):
        sp = r["split_ptx"]
        assert ".target sm_90" in sp  # sm_90 or sm_90a
        assert r["split_cubin"] > 0 and r["combine_cubin"] > 0
        t = {"bf16": "bf16", "fp16": "f16"}[dt]
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"
        assert mma in sp, "tensor-core dot missing"
        assert "cp.async.cg.shared.global" in sp, "K/V tiles should be 16-byte async copies (pipelined)"
        assert "atom.global" in r["combine_ptx"] and "bar.sync" in r["combine_ptx"]
        if policy in (1, 2):   # masses are score / G with IEEE division, as the reference's (not div.full.f32)
            assert "div.rn.f32" in r["combine_ptx"]
        if policy in (1, 3):   # topp's tie count and ratio's ceil(theta * valid blocks) round towards zero
            assert "cvt.rzi.s32.f32" in r["combine_ptx"]
        for kernel in ("split", "combine"):    # PDL=0 (standalone, interpreter, no PDL): no grid-dependency control
            assert "griddepcontrol" not in r[f"{kernel}_ptx"]
        if "pdl_split_ptx" in r:    # PDL=1: both wait; the split releases its dependents after the wait
            for kernel in ("split", "combine"):
                assert "griddepcontrol.wait" in r[f"pdl_{kernel}_ptx"], kernel
            ps = r["pdl_split_ptx"]
            assert -1 < ps.find("griddepcontrol.wait") < ps.find("griddepcontrol.launch_dependents")
            assert "griddepcontrol.launch_dependents" not in r["pdl_combine_ptx"]
        if "select_ptx" in r:
            # DEFER: no ticket (the top-k's atomic) in the combine; the top-k kernel's block-wide counting passes
            assert "atom.global" not in r["deferred_combine_ptx"] and ".target sm_90" in r["select_ptx"]
            assert "bar.sync" in r["select_ptx"] and "atom.global" not in r["select_ptx"]
            if policy in (1, 3):
                assert "cvt.rzi.s32.f32" in r["select_ptx"]
