"""What a compiled decode step launches around one layer's attention, read from Inductor's output code.

    python benchmarks/probes/step_kernels.py DIR [--layer N]

DIR: an Inductor cache directory (TORCHINDUCTOR_CACHE_DIR of a run made with `e2e.py --warm-cache`). Picks the
generated module with the most launches of our template (the decode step), lists its launches between the
N-th and (N+1)-th split template launch (Triton kernels, templates, extern calls, our custom ops), then the source of
each Inductor Triton kernel in that window, and the launches after the last layer. A reading tool, not a benchmark:
it times nothing."""
from __future__ import annotations

import argparse
import os
import re

LAUNCH = re.compile(r"^\s*(?:(\w+)\.run\(|(extern_kernels\.\w+)\(|(torch\.ops\.\w+\.\w+)(?:\.default)?\()")
KERNEL_SRC = re.compile(r"async_compile\.triton\('(\w+)', '''(.*?)'''", re.S)


def step_module(folder: str) -> tuple[str, str]:
    """The generated module (path, text) with the most launches of our templates."""
    best = None
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            with open(path, errors="replace") as f:
                text = f.read()
            if "def call(" not in text or "hybrid_decode" not in text:
                continue
            n = sum(1 for k in launches(text) if k.startswith("triton_tem"))
            if best is None or n > best[0]:
                best = (n, path, text)
    if best is None:
        raise SystemExit(f"no generated module calling our template under {folder}")
    return best[1], best[2]


def launches(text: str) -> list[str]:
    """Launch names in program order. With CUDA graphs Inductor may split `call` into `partition_N` functions,
    defined ahead of it: read from the first of them."""
    starts = [i for i in (text.find("def partition_0("), text.find("def call(")) if i >= 0]
    body = text[min(starts):] if starts else ""
    out = []
    for line in body.splitlines():
        m = LAUNCH.match(line)
        if m:
            out.append(next(g for g in m.groups() if g))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--copy-to", default=None, help="also copy the chosen module to this path")
    args = ap.parse_args(argv)
    path, text = step_module(args.folder)
    if args.copy_to:
        with open(args.copy_to, "w") as f:
            f.write(text)
    seq = launches(text)
    split = [i for i, k in enumerate(seq) if k.startswith("triton_tem") and "hybrid_decode" in k]
    print(f"module {path}: {len(seq)} launches, {len(split)} template launches")
    if len(split) < 2:
        raise SystemExit("fewer than two template launches: not a decode step")
    n = min(args.layer, max(len(split) // 2 - 2, 0))
    lo, hi = split[2 * n], split[2 * n + 2] if 2 * n + 2 < len(split) else len(seq)
    window = seq[lo:hi]
    print(f"\n== launches from template launch {2 * n} to {2 * n + 2} ({len(window)}):")
    for k in window:
        print("  ", k)
    tail = seq[split[-1] + 1:]
    print(f"\n== launches after the last template launch ({len(tail)}):")
    for k in tail:
        print("  ", k)
    sources = dict(KERNEL_SRC.findall(text))
    for k in dict.fromkeys(window + tail):
        if k in sources and not k.startswith("triton_tem"):
            body = sources[k].split("@triton.jit", 1)[-1]
            print(f"\n== {k}\n{body.strip()[:4000]}")


if __name__ == "__main__":
    main()
