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
