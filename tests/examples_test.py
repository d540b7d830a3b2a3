"""The demo (`make demo`) runs end to end on a tiny size."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_demo_quick_runs_and_reports():
    out = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
    ).stdout
    assert "stage_wait_ratio" in out
    assert "verdict" in out
    assert "np.allclose = True" in out
    # The benchmark workloads, plain vs staged, with plan and verdict.
    for name in ("seed", "criteo"):
        assert f"\n{name}: 6 batches of" in out
    assert out.count("Stage plan:") >= 2
    assert out.count("    plain ") == 2 and out.count("    staged ") == 2
    assert out.count("PrefetchCallback verdict of the last staged epoch") == 2
