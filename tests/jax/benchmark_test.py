"""The benchmarks' scenarios run, at their smallest, on the JAX backend."""

import argparse

import pytest

pytestmark = pytest.mark.timeout(300)


def test_fits_trains_the_hand_splits_weights_and_stages_the_lookups():
    # Imported here: collected (and skipped) on TensorFlow too.
    from benchmarks import runner
    from benchmarks.modes import MODES
    from benchmarks.scenarios import fits

    scenario = fits.Fits()
    scenario.epochs = 1
    # Plain Keras cannot take the string columns on JAX.
    assert scenario.modes == ("expert", "staged", "expert_again")
    args = argparse.Namespace(quick=True, steps=2)
    expert, staged = (
        scenario.setup("criteo_columns", MODES[name], args)
        for name in ("expert", "staged")
    )
    assert "max_dw" not in expert and staged["max_dw"] <= 1e-6
    layers = staged["built"].model.get_stage_plan().staged_layers
    assert layers[0].startswith("staged_input")
    assert {"dense_norm", *(f"C{i}_hash" for i in range(1, 27))} <= set(layers)
    for state in (expert, staged):
        trial = runner.timed(scenario, state, staged=state is staged)
        assert trial["metrics"]["seconds"] > 0


def test_a_quick_fits_run_has_rows_for_every_mode(monkeypatch):
    from benchmarks import __main__ as cli
    from benchmarks import records, runner

    chosen, args = cli.parse(
        ["fits", "--rounds", "1", "--workloads", "tabular", "--steps", "2"]
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


def test_repeated_calls_keep_one_stage_beside_the_hand_split():
    from benchmarks import __main__ as cli
    from benchmarks import runner
    from benchmarks.modes import MODES
    from keras_stage.data import live_stages

    chosen, args = cli.parse(
        ["calls", "--workloads", "tabular", "--method", "evaluate,fit"]
        + ["--calls", "3", "--batches", "2", "--rounds", "1"]
    )
    # Plain Keras cannot take the string columns on JAX.
    assert chosen.modes == ("expert", "staged_always", "expert_again")
    rows = runner.run(chosen, args, log=lambda line: None)
    assert {(row["workload"], row["mode"]) for row in rows} == {
        (f"tabular-{method}", mode)
        for method in ("evaluate", "fit")
        for mode in chosen.modes
    }
    # Every call's time; the tear-down after its last callback may be ~0.
    assert all(
        row["value"] > 0 if row["metric"] != "teardown" else row["value"] >= 0
        for row in rows
    )
    # keras_stage logs no decision where every call is staged: the calls
    # ran on one stage, kept across calls on the same dataset object.
    state = chosen.setup("tabular-evaluate", MODES["staged_always"], args)
    before = set(live_stages())
    chosen.trial(state)
    made = set(live_stages()) - before
    assert len(made) == 1
    chosen.trial(state)
    assert set(live_stages()) - before == made
