"""`benchmarks.scenarios.fits` on TensorFlow: the recommender subclasses.

At their smallest (two batches an epoch): every mode trains the same
weights, the staged subclass's plan stages its lookups, and a run has rows
for every mode. Speed is never checked.
"""

import argparse

import pytest

from benchmarks import __main__ as cli
from benchmarks import records, runner
from benchmarks.modes import MODES
from benchmarks.scenarios import fits

pytestmark = pytest.mark.timeout(300)


def test_on_tensorflow_plain_keras_is_the_reference():
    scenario = fits.Fits()
    assert scenario.modes == ("plain", "staged", "plain_again")
    _, args = cli.parse(["fits"])
    assert scenario.cases(args) == list(fits.RECOMMENDERS)


def test_every_mode_trains_the_same_weights_and_the_lookups_are_staged():
    scenario = fits.Fits()
    args = argparse.Namespace(quick=True, steps=2)
    states = [
        scenario.setup("retrieval", MODES[name], args)
        for name in ("plain", "staged", "staged_always")
    ]
    # Equal initial weights and batches: one fit each, equal weights.
    assert "max_dw" not in states[0]
    for state in states[1:]:
        assert state["max_dw"] <= 1e-6
        plan = state["built"].model.get_stage_plan()
        assert {"user_lookup", "movie_lookup"} <= set(plan.staged_layers)
    # adaptive=False: every call staged, and counted so.
    trial = runner.timed(scenario, states[2], staged=True)
    assert trial["metrics"]["seconds"] > 0
    assert trial["staged_calls"] == trial["calls"] > 0
    assert trial["why"] == []
    # Adaptive (two batches of cheap lookups: its second call may time the
    # whole model's steps): a call that ran unstaged says why.
    trial = runner.timed(scenario, states[1], staged=True)
    assert trial["calls"] > 0
    assert trial["staged_calls"] == trial["calls"] or trial["why"]


def test_a_weight_check_that_fails_stops_the_run(monkeypatch):
    scenario = fits.Fits()
    args = argparse.Namespace(quick=True, steps=2)
    scenario.epochs = 1
    scenario.setup("retrieval", MODES["plain"], args)
    monkeypatch.setattr(fits, "TOLERANCE", -1.0)
    with pytest.raises(RuntimeError, match="train different models"):
        scenario.setup("retrieval", MODES["plain_again"], args)


def test_a_quick_run_has_rows_for_every_mode(monkeypatch):
    chosen, args = cli.parse(
        ["fits", "--rounds", "1", "--workloads", "retrieval", "--steps", "2"]
    )
    monkeypatch.setattr(chosen, "epochs", 1)
    rows = runner.run(chosen, args, log=lambda line: None)
    assert {row["mode"] for row in rows} == set(chosen.modes)
    summaries = records.summarize(rows, chosen.reference, chosen.control)
    (summary,) = [s for s in summaries if s["metric"] == "seconds"]
    assert set(summary["ratio"]) == {"staged", "plain_again"}
    assert summary["control"] == summary["ratio"]["plain_again"] > 0
