"""The torch backend's benchmarks run, at their smallest, on torch.

What is checked is the rows' structure and that the staged and the hand
split trained the same weights, never their speed.
"""

import argparse
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)


def test_fits_trains_the_hand_splits_weights_and_stages_the_lookups():
    from benchmarks import runner
    from benchmarks.modes import MODES
    from benchmarks.scenarios import fits

    scenario = fits.Fits()
    scenario.epochs = 1
    # Plain Keras cannot take the string columns on torch.
    assert scenario.modes == ("expert", "staged", "expert_again")
    args = argparse.Namespace(quick=True, steps=2)
    expert, staged = (
        scenario.setup("dlrm", MODES[name], args)
        for name in ("expert", "staged")
    )
    assert "max_dw" not in expert and staged["max_dw"] <= 1e-6
    layers = staged["built"].model.get_stage_plan().staged_layers
    assert {"dense_norm", *(f"hash_{i}" for i in range(8))} <= set(layers)
    trial = runner.timed(scenario, staged, staged=True)
    assert trial["metrics"]["seconds"] > 0


def test_a_quick_fits_run_has_rows_for_every_mode(monkeypatch):
    from benchmarks import __main__ as cli
    from benchmarks import records, runner

    chosen, args = cli.parse(
        ["fits", "--rounds", "1", "--workloads", "criteo_columns"]
        + ["--steps", "2"]
    )
    monkeypatch.setattr(chosen, "epochs", 1)
    rows = runner.run(chosen, args, log=lambda line: None)
    assert {row["mode"] for row in rows} == {"expert", "staged", "expert_again"}
    summaries = records.summarize(rows, chosen.reference, chosen.control)
    # The whole call, its time to the last callback and the tear-down after.
    assert {s["metric"] for s in summaries} == {"seconds", "to_end", "teardown"}
    (summary,) = [s for s in summaries if s["metric"] == "seconds"]
    assert summary["control"] == summary["ratio"]["expert_again"] > 0
    assert summary["ratio"]["staged"] > 0


@pytest.mark.slow
def test_a_split_script_runs_each_mode_in_a_fresh_torch_process():
    from benchmarks import runner

    # The children inherit KERAS_BACKEND=torch: plain is the hand split.
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "scripts", "--rounds", "1"]
        + ["--scripts", "tabular_split", "--tiny", "--no-write"],
        cwd=runner.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == "tabular_split":
            rows[cells[1]] = cells[2:5]
    assert set(rows) == {
        "seconds",
        "script",
        "fit",
        "evaluate",
        "predict",
        "process",
    }
    for metric, (plain, staged, control) in rows.items():
        # Each mode's process: plain's median, staged's and plain_again's
        # ratios to it.
        control = control.split()[0]  # its range follows, in brackets
        assert min(float(plain), float(staged), float(control)) > 0, metric
