"""What a kernel launch and a chain of dependent loads cost, timed the way the kernel benchmark times our op
(attention_bench.time_calls: the median of CUDA-graph replays of back-to-back calls). It sizes the fixed cost of
the decode op's split and combine launches (8.5 us for the pair with almost no work; docs/design-notes.md):

    python benchmarks/probes/launch_probe.py --out $OUT

Each probe kernel runs `--grid` programs of 4 warps (264 = the split's grid on an H100; 96 = the combine's at
Llama-3-8B shapes, 128K, batch 1). Every program follows a chain of `loads` dependent scalar loads (each address
comes from the value loaded before it; the table is small, so the loads hit L2 after the first replay) and
stores its last value once. With --pdl each launch uses programmatic dependent launch and waits
(griddepcontrol.wait) before its first load, as our templates do; no probe releases its dependents early, as our
combine does not. A benchmark, not a test."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/, for attention_bench
from attention_bench import time_calls  # noqa: E402  (benchmarks/ is no package)

TABLE = 4096      # int32 entries of the chain table


@triton.jit
def _chain_kernel(X, Y, LOADS: tl.constexpr, PDL: tl.constexpr, TABLE_N: tl.constexpr):
    p = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    v = p % TABLE_N
    for _ in tl.static_range(LOADS):
        v = tl.load(X + v)       # the next address is the value just loaded: one round trip each
    tl.store(Y + p, v)


def probe(grid: int, loads: int, pdl: bool, sets: int = 4) -> float:
    """Median ms per launch of one probe configuration."""
    table = (torch.arange(TABLE, device="cuda", dtype=torch.int32) * 97 + 13) % TABLE    # a permutation
    outs = [torch.empty(grid, device="cuda", dtype=torch.int32) for _ in range(sets)]
    launch = dict(launch_pdl=True) if pdl else {}

    def call(y):
        return lambda: _chain_kernel[(grid,)](table, y, LOADS=loads, PDL=int(pdl), TABLE_N=TABLE, num_warps=4,
                                              **launch)
    calls = [call(y) for y in outs]
    ms = time_calls(calls)
    expect = torch.arange(grid, device="cuda", dtype=torch.int64) % TABLE
    for _ in range(loads):
        expect = table.long()[expect]
    assert torch.equal(outs[0].long(), expect), "probe kernel computed the wrong chain"
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grids", default="264,96", help="comma list of program counts")
    ap.add_argument("--loads", default="0,1,2,4,8", help="comma list of chain lengths")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    pdl_ok = torch.cuda.get_device_capability()[0] >= 9
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    rows = []
    for grid in (int(g) for g in args.grids.split(",")):
        for loads in (int(n) for n in args.loads.split(",")):
            for pdl in ((False, True) if pdl_ok else (False,)):
                rows.append(dict(grid=grid, loads=loads, pdl=pdl, us=1e3 * probe(grid, loads, pdl)))
                print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_probe.json"), "w") as f:
        json.dump(dict(meta=meta, argv=sys.argv, rows=rows), f, indent=1)
    print(f"\n{meta['device']}, {meta['date']}")
    print("| grid | dependent loads | us per launch | with PDL |\n|---:|---:|---:|---:|")
    for r in rows:
        if not r["pdl"]:
            p = next((x["us"] for x in rows if x["pdl"] and x["grid"] == r["grid"] and x["loads"] == r["loads"]),
                     None)
            print(f"| {r['grid']} | {r['loads']} | {r['us']:.2f} | {'-' if p is None else f'{p:.2f}'} |")


if __name__ == "__main__":
    main()
