"""Triton source of the hybrid decode kernels, assembled from the template files under kernels/ (each opens with a
header naming what it holds and the glossary names it uses; glossary.py.jinja defines them) and rendered two ways:

* by Inductor (`torch._inductor.select_algorithm.TritonTemplate`, see lower.py), which supplies `def_kernel`,
  `size`, `stride` and `store_output` (epilogue fusion of the attention output);
* standalone (standalone.py, tests and benchmarks only), which turns the same text into a plain `@triton.jit`
  kernel with explicit size/stride arguments. That is what the TRITON_INTERPRET=1 tests, the sm_90 cross-compile
  checks and the benchmark's "kernel only" timing run. One source, so both paths run the same math.

Two launches per layer (three with DEFER):
  1. SPLIT  grid (NUM_SPLITS,) (kernels/split.py.jinja): flash-decoding over a pooled work list. Every (row b, KV
     head h) is a segment of BLOCK_N-token tiles: a retrieval head's segment is [0, TV) of its cache, streamed
     contiguously (addresses from the tile number; the row's range [lo, hi) masks it, so tiles outside it move no
     KV bytes); a sparse head's segment is its sink blocks, local blocks and its K inherited blocks (gathered rows,
     masked to [lo, hi)). Segment sizes depend on the runtime head kinds (`RETR`), so the pool and its cut into
     NUM_SPLITS equal slices are computed on the device by every program: no host sync, one compiled kernel for
     every layer and head map. A slice writes one partial (max, sum, acc) per segment it touches; retrieval tiles
     also write the log-sum-exp of each KV block per query head (for block scores).
  2. COMBINE grid (B * HKV, G + ceil(NB / KC)) (kernels/combine.py.jinja): programs (seg, g < G) merge query head
     g's partials into the output; for a retrieval head, programs (seg, G + c) turn blocks [c*KC, (c+1)*KC) into
     selection keys (block score = sum over the G query heads of exp2(block lse - row lse), normalised by the row's
     global log-sum-exp rebuilt from the partials) and the last of them to finish (atomic ticket, zeroed by the
     split launch) asks the selection policy (POLICY, PARAM: topk / topp / threshold / ratio, ops/policies.py) how
     many candidates n <= KSEL to keep and selects the top n exactly (kernels/selection_helpers.py.jinja: counting
     passes over the fp32 bit pattern, ties to the lower block), sorted ascending, EMPTY-padded; for a sparse head
     program (seg, G) copies its index row through.
  3. DEFER = 1 only (hybrid_decode(defer_select=True), the default in compiled models): the combine stops after
     writing the keys (4 warps, no ticket), and SELECT = lychee_select_rows (SELECT_SOURCE,
     kernels/select_rows.py.jinja, grid (B * HKV,), the same selection helpers) does the top-n, launched by
     lychee::select_rows on a side stream (deferred.py).

Preconditions (documented, not checked on the device): each row's valid positions are one contiguous range
(left padding: [pad_b, pos+1)); idx_in rows hold distinct blocks (the index-state invariant).

The files' texts are joined with fixed separators below, so the kernels' text does not depend on blank lines at the
files' ends (tests/test_kernel_text.py pins it). codegen_key.codegen_digest hashes the kernels/ files too: a changed
kernel is never served from Inductor's cache.
"""
from __future__ import annotations

import pathlib

KERNELS = pathlib.Path(__file__).parent / "kernels"
SUFFIX = ".py.jinja"
MODULE_PRELUDE = "import triton\nimport triton.language as tl\n\n"     # a standalone kernel module's first lines


def load(name: str) -> str:
    """The text of kernels/<name>.py.jinja without its header comment and without blank lines at either end."""
    text = (KERNELS / (name + SUFFIX)).read_text()
    if text.startswith("{#"):
        text = text[text.index("#}") + 2:]
    return text.strip("\n")


def _join(*pieces: str) -> str:
    """Kernel body and helper files, three blank lines apart."""
    return "\n\n\n\n".join(pieces) + "\n"


GLOSSARY = "\n" + load("glossary") + "\n"
KERNEL_HELPERS = load("kernel_helpers")
SELECTION_HELPERS = load("selection_helpers")
SPLIT_BODY = _join(load("split"), KERNEL_HELPERS)
COMBINE_BODY = _join(load("combine"), SELECTION_HELPERS, KERNEL_HELPERS)
# lychee_select_rows' module, loaded as it is (no Jinja; lowering/deferred.py)
SELECT_SOURCE = MODULE_PRELUDE + "\n" + load("select_rows") + "\n\n\n" + _join(SELECTION_HELPERS, KERNEL_HELPERS)

SPLIT_NAMES = ("Q", "K", "V", "ROWLO", "ROWHI", "TVP", "RETR", "IDX", "PM", "PL", "BLSE", "CNT")
COMBINE_NAMES = ("PACC", "PM", "PL", "BLSE", "VALID", "ROWLO", "ROWHI", "TVP", "RETR", "SEL", "IDX", "IDXO", "KEYS",
                 "CNT")
MASS_NAMES = ("EXTRA", "VBLSE", "MASSO")      # the mass variant's extra inputs, appended to both kernels'
RANKS = {"Q": 4, "K": 4, "V": 4, "ROWLO": 1, "ROWHI": 1, "TVP": 1, "RETR": 1, "IDX": 3, "PM": 3, "PL": 3, "BLSE": 4,
         "CNT": 1, "PACC": 4, "VALID": 2, "SEL": 1, "IDXO": 3, "KEYS": 3, "EXTRA": 3, "VBLSE": 3, "MASSO": 3,
         "OUT": 4}
SPLIT_OUT = ("PACC", 4)       # (name, rank) of the tensor store_output writes
COMBINE_OUT = ("OUT", 4)


def kernel_tensors(kind: str, mass: bool) -> dict:
    """{name: rank} of a kernel's tensor arguments, in def_kernel order."""
    names = (SPLIT_NAMES if kind == "split" else COMBINE_NAMES) + (MASS_NAMES if mass else ())
    return {n: RANKS[n] for n in names}


def _source(names, body, mass: bool) -> str:
    """One kernel's template text: def_kernel over its tensors, the glossary, the body; the mass variant names
    EXTRA / VBLSE / MASSO (the plain one never touches them: its MASS branches are constexpr-dead)."""
    names = names + MASS_NAMES if mass else names
    head = "{{def_kernel(" + ", ".join(f'"{n}"' for n in names) + ")}}\n"
    body = body.replace("{{extra_strides}}", 'stride_xb, stride_xh, stride_xk = {{stride("EXTRA")}}' if mass
                        else "stride_xk = 0")
    return head + GLOSSARY + "\n" + body.replace("{{extra_row}}", "EXTRA + b64 * stride_xb + h64 * stride_xh" if mass
                                                 else "IDX")


SPLIT_SOURCE, SPLIT_MASS_SOURCE = (_source(SPLIT_NAMES, SPLIT_BODY, m) for m in (False, True))
COMBINE_SOURCE, COMBINE_MASS_SOURCE = (_source(COMBINE_NAMES, COMBINE_BODY, m) for m in (False, True))
