"""pytest plugin (loaded by tests/conftest.py): what a CI log needs to see at the end of every run.

- A per-file duration table: seconds summed over setup, call and teardown of every test of a file, with the count of
  tests run, slowest first. Under pytest-xdist the controller receives every report, so the table covers all
  workers; its total is worker-seconds (the run's wall time is about that total over the number of workers).
- The count of test ids this run selected, and how it compares with the committed list of the CI stack
  (tests/ci_ids/, see tests/test_ci_ids.py).
- The fuzz tests' case counts (tests/fuzz_counts.py), merged from the xdist workers when there are workers.
"""
from __future__ import annotations

import collections
import os
import pathlib
import time

import pytest

from tests import fuzz_counts

IDS_DIR = pathlib.Path(__file__).parent / "ci_ids"
FILE_SECONDS: collections.Counter = collections.Counter()
FILE_TESTS: collections.Counter = collections.Counter()
STACK_A_ONLY = ("slow", "single_stack")
SELECTED: list = []   # node ids of this session's selected tests (after -m / -k deselection), on every process
TIMES: dict = {}      # monotonic seconds: session start, end of collection (this process's imports and collection)


def ci_stack() -> str:
    """The CI stack whose committed id list applies: LYCHEE_CI_STACK ("a" or "b"; .ci/run sets it), default "a"."""
    return os.environ.get("LYCHEE_CI_STACK", "a")


def pytest_collection_modifyitems(config, items):
    """Stack B runs what depends on the torch / transformers / triton versions: not the `slow` real-model runs nor
    the `single_stack` tests (behaviour of our own code that no version changes); stack A runs everything.
    On pytest-xdist workers, files are ordered slowest first (slowest_first)."""
    if hasattr(config, "workerinput"):
        items[:] = slowest_first(items)
    if ci_stack() != "b":
        return
    kept, dropped = [], []
    for item in items:
        (dropped if any(item.get_closest_marker(m) for m in STACK_A_ONLY) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def slowest_first(items) -> list:
    """Items grouped by file, the files in the order of tests/ci_ids/slow_files.txt (slowest first), then the rest in
    collection order; a file's own order is kept. With --dist loadfile and --no-loadscope-reorder (.ci/test.sh) the
    workers take files in this order, so a long file never starts last and leaves one worker running alone."""
    path = IDS_DIR / "slow_files.txt"
    listed = [line.split()[-1] for line in path.read_text().splitlines()
              if line.strip() and not line.startswith("#")] if path.exists() else []
    rank = {f: i for i, f in enumerate(listed)}
    return sorted(items, key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def committed_ids(stack: str) -> list[str]:
    path = IDS_DIR / f"{stack}.txt"
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")] if path.exists() else []


def write_ids(stack: str, ids) -> pathlib.Path:
    path = IDS_DIR / f"{stack}.txt"
    path.parent.mkdir(exist_ok=True)
    header = (f"# Test ids CI runs on stack {stack} (.ci/run). Additions are fine; a removal needs its reason in the "
              "commit message.\n# Regenerate: LYCHEE_UPDATE_TEST_IDS=1 with the stack's marker expression "
              "(.ci/test.sh prints it).\n")
    path.write_text(header + "".join(f"{i}\n" for i in sorted(set(ids))))
    return path


def pytest_sessionstart(session):
    TIMES["start"] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    SELECTED[:] = [item.nodeid for item in session.items]
    TIMES["collected"] = time.monotonic()


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    FILE_SECONDS[path] += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        FILE_TESTS[path] += 1


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:   # an xdist worker: hand its fuzz counts to the controller
        workeroutput["fuzz_counts"] = dict(fuzz_counts.COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """On the xdist controller, which collects nothing itself: every worker selects the same ids."""
    SELECTED[:] = ids
    TIMES.setdefault("collected", time.monotonic())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    fuzz_counts.COUNTS.update(getattr(node, "workeroutput", {}).get("fuzz_counts", {}))


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    for name, n in sorted(fuzz_counts.COUNTS.items()):
        write(f"fuzz cases checked: {name}: {n} (0 mismatches: any mismatch fails its test)")
    if not FILE_SECONDS:
        return
    total = sum(FILE_SECONDS.values())
    if "collected" in TIMES:
        write(f"collection (imports included): {TIMES['collected'] - TIMES['start']:.1f} s")
    write(f"per-file durations (setup + call + teardown; {total:.0f} s summed over all workers):")
    write(f"{'seconds':>9} {'share':>6} {'tests':>6}  file")
    for path, seconds in FILE_SECONDS.most_common():
        write(f"{seconds:9.1f} {seconds / total:6.1%} {FILE_TESTS[path]:6d}  {path}")
    stack, listed = ci_stack(), committed_ids(ci_stack())
    write(f"test ids selected: {len(SELECTED)} (committed list for stack {stack}: {len(listed)}; "
          f"{len(set(listed) - set(SELECTED))} of its ids not selected in this run)")
