"""The kernels' text, pinned: sha256 digests of every kernel source we ship (the Jinja sources Inductor renders, the
standalone-rendered split / combine modules for fixed constexprs, the deferred selection's module) against
tests/snapshots/kernel-text.txt. A refactoring of how the source is stored or assembled must leave these bytes
alone; an intended kernel change regenerates the file with LYCHEE_UPDATE_SNAPSHOTS=1 (review the diff).
"""
from __future__ import annotations

import hashlib
import os
import pathlib

import pytest

from lychee_compile.lowering import template

pytestmark = pytest.mark.single_stack   # text only: no torch / transformers / triton version changes it

SNAPSHOT = pathlib.Path(__file__).parent / "snapshots" / "kernel-text.txt"
# (tag, G, Hkv, D, K_sel, nb_hint): Llama-like GQA 2 at D=64 and GQA 8 at D=128 with the NBR register tier in
SHAPES = [("g4h2d64", 4, 2, 64, 8, 512), ("g8h4d128", 8, 4, 128, 256, 8192 + 2048)]
POLICIES = [("topk", 0, 0.0), ("topp", 1, 0.9)]


def _constexprs(G, Hkv, D, K_sel, nb_hint, policy, param, mass, defer):
    sp, cp = template.kernel_params(G=G, Hkv=Hkv, D=D, K_sel=K_sel, block_size=16, sink_tokens=16, local_tokens=64,
                                    scale=D ** -0.5, num_splits=264, nb_hint=nb_hint, policy=policy,
                                    policy_param=param, mass=mass, extra_width=4 if mass else 0, defer=defer)
    return dict(sp, DOT_UPCAST=False), cp      # DOT_UPCAST follows TRITON_INTERPRET: pinned here


def _rendered(kind, constexprs) -> str:
    mass = bool(constexprs["MASS"])
    out = template.SPLIT_OUT if kind == "split" else template.COMBINE_OUT
    name = f"lychee_hybrid_{kind}"
    source = {("split", False): template.SPLIT_SOURCE, ("split", True): template.SPLIT_MASS_SOURCE,
              ("combine", False): template.COMBINE_SOURCE, ("combine", True): template.COMBINE_MASS_SOURCE}
    r = template._StandaloneRenderer(name, template.kernel_tensors(kind, mass), out, constexprs)
    src, _ = r.render(source[kind, mass])
    return "import triton\nimport triton.language as tl\n\n" + src


def kernel_texts() -> dict[str, str]:
    texts = {"source-split": template.SPLIT_SOURCE, "source-split-mass": template.SPLIT_MASS_SOURCE,
             "source-combine": template.COMBINE_SOURCE, "source-combine-mass": template.COMBINE_MASS_SOURCE,
             "select": "import triton\nimport triton.language as tl\n\n" + template.SELECT_KERNEL_SOURCE
             + template.SELECTION_HELPERS_SOURCE}
    for tag, G, Hkv, D, K_sel, nb_hint in SHAPES:
        for pname, policy, param in POLICIES:
            for mass in (False, True):
                for defer in (False, True):
                    sp, cp = _constexprs(G, Hkv, D, K_sel, nb_hint, policy, param, mass, defer)
                    case = f"{tag}-{pname}-mass{int(mass)}-defer{int(defer)}"
                    texts[f"split-{case}"] = _rendered("split", sp)
                    texts[f"combine-{case}"] = _rendered("combine", cp)
    return texts


def test_kernel_text_is_unchanged():
    lines = [f"{name} {hashlib.sha256(text.encode()).hexdigest()}" for name, text in kernel_texts().items()]
    text = "\n".join(lines) + "\n"
    if os.environ.get("LYCHEE_UPDATE_SNAPSHOTS") == "1" or not SNAPSHOT.exists():
        if os.environ.get("CI") and not SNAPSHOT.exists():
            pytest.fail(f"snapshot {SNAPSHOT.name} missing; create it with LYCHEE_UPDATE_SNAPSHOTS=1 and commit it")
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text(), "kernel text changed; if intended, regenerate with LYCHEE_UPDATE_SNAPSHOTS=1"
