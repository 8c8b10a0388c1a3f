"""The kernels' text, pinned: sha256 digests of every kernel source we ship (the Jinja sources Inductor renders, the
standalone-rendered split / combine modules for fixed constexprs, the deferred selection's module) against
tests/snapshots/kernel-text.txt. A refactoring of how the source is stored or assembled must leave these bytes
alone; an intended kernel change regenerates the file with LYCHEE_UPDATE_SNAPSHOTS=1 (review the diff).
"""
from __future__ import annotations

import ast
import hashlib
import os
import pathlib

import pytest

import lychee_compile
from lychee_compile.lowering import kernel_source
from lychee_compile.lowering.constexprs import kernel_params
from lychee_compile.lowering.standalone import render_text

pytestmark = pytest.mark.single_stack   # text only: no torch / transformers / triton version changes it

SNAPSHOT = pathlib.Path(__file__).parent / "snapshots" / "kernel-text.txt"
# (tag, G, Hkv, D, K_sel, nb_hint): groups of 4 at D=64 and of 8 at D=128, the latter with the NBR register tier in;
# head dims padded inside the kernels: Phi-3's 96 (group 4) and Phi-2's 80 (MHA)
SHAPES = [("g4h2d64", 4, 2, 64, 8, 512), ("g8h4d128", 8, 4, 128, 256, 8192 + 2048), ("g4h2d96", 4, 2, 96, 8, 512),
          ("g1h4d80", 1, 4, 80, 8, 512)]
POLICIES = [("topk", 0, 0.0), ("topp", 1, 0.9)]


def _constexprs(G, Hkv, D, K_sel, nb_hint, policy, param, mass, defer):
    sp, cp = kernel_params(G=G, Hkv=Hkv, D=D, K_sel=K_sel, block_size=16, sink_tokens=16, local_tokens=64,
                           scale=D ** -0.5, num_splits=264, nb_hint=nb_hint, policy=policy, policy_param=param,
                           mass=mass, extra_width=4 if mass else 0, defer=defer)
    return dict(sp, DOT_UPCAST=False), cp      # DOT_UPCAST follows TRITON_INTERPRET: pinned here


def kernel_texts() -> dict[str, str]:
    ks = kernel_source
    texts = {"source-split": ks.SPLIT_SOURCE, "source-split-mass": ks.SPLIT_MASS_SOURCE,
             "source-combine": ks.COMBINE_SOURCE, "source-combine-mass": ks.COMBINE_MASS_SOURCE,
             "select": ks.SELECT_SOURCE}
    for tag, G, Hkv, D, K_sel, nb_hint in SHAPES:
        for pname, policy, param in POLICIES:
            for mass in (False, True):
                for defer in (False, True):
                    sp, cp = _constexprs(G, Hkv, D, K_sel, nb_hint, policy, param, mass, defer)
                    case = f"{tag}-{pname}-mass{int(mass)}-defer{int(defer)}"
                    texts[f"split-{case}"] = render_text("split", sp)[0]
                    texts[f"combine-{case}"] = render_text("combine", cp)[0]
    return texts


def test_kernel_text_is_unchanged():
    lines = [f"{name} {hashlib.sha256(text.encode()).hexdigest()}" for name, text in kernel_texts().items()]
    text = "\n".join(lines) + "\n"
    if os.environ.get("LYCHEE_UPDATE_SNAPSHOTS") == "1" or not SNAPSHOT.exists():
        if os.environ.get("CI") and not SNAPSHOT.exists():
            pytest.fail(f"snapshot {SNAPSHOT.name} missing; create it with LYCHEE_UPDATE_SNAPSHOTS=1 and commit it")
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text(), "kernel text changed; if intended, regenerate with LYCHEE_UPDATE_SNAPSHOTS=1"


def test_the_library_never_imports_the_standalone_launchers():
    # lowering/standalone.py (launchers, cross-compilation) serves tests and benchmarks only: no module of the
    # package imports it, so the library's import graph stays the kernels' text, constexprs and the lowering
    root = pathlib.Path(lychee_compile.__file__).parent
    importers = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
            if any(n.split(".")[-1] == "standalone" for n in names + [module]):
                importers.append(str(path.relative_to(root)))
    assert (root / "lowering" / "standalone.py").exists() and importers == [], importers
