"""CI never loses a test silently: the test ids a CI stack runs include every id of its committed list
(tests/ci_ids/a.txt, b.txt). Additions are fine; a removal fails here until the list is regenerated
(LYCHEE_UPDATE_TEST_IDS=1), and the commit that does so says why.

The ids come from this session when it selected the whole suite; otherwise (a subset was asked for) from a
collection-only run in a subprocess with the stack's marker expression."""
from __future__ import annotations

import os
import subprocess
import sys

from tests import ci_report

CI_MARKERS = "not gpu"   # .ci/test.sh's marker expression on both stacks; stack B's narrower set is ci_report's


def _whole_suite(config) -> bool:
    paths = [os.path.normpath(os.path.join(str(config.rootpath), a)) for a in config.args]
    whole = {os.path.normpath(os.path.join(str(config.rootpath), p)) for p in config.getini("testpaths")}
    return set(paths) <= whole | {str(config.rootpath)} and not config.getoption("keyword")


def _collect(stack: str, root: str) -> list[str]:
    env = dict(os.environ, LYCHEE_CI_STACK=stack)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-m", CI_MARKERS, "tests"], cwd=root, env=env, capture_output=True,
                         text=True, check=True)
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_no_ci_test_id_lost(request):
    stack = ci_report.ci_stack()
    marker_expr = request.config.getoption("markexpr")
    if _whole_suite(request.config) and marker_expr == CI_MARKERS:
        selected = list(ci_report.SELECTED)
    else:
        selected = _collect(stack, str(request.config.rootpath))
    if os.environ.get("LYCHEE_UPDATE_TEST_IDS") == "1":
        ci_report.write_ids(stack, selected)
    listed = ci_report.committed_ids(stack)
    assert listed, f"no committed id list for stack {stack}: create it with LYCHEE_UPDATE_TEST_IDS=1"
    lost = sorted(set(listed) - set(selected))
    assert not lost, (f"{len(lost)} test ids of tests/ci_ids/{stack}.txt are no longer run on stack {stack}: "
                      f"{lost[:10]}; if intended, regenerate with LYCHEE_UPDATE_TEST_IDS=1 and say why in the "
                      "commit message")
    assert request.node.nodeid in selected
