"""The `calls`, `determinism` and `floor` scenarios, at their smallest."""

import pytest

from benchmarks import runner
from benchmarks.__main__ import parse
from benchmarks.modes import MODES
from keras_stage.data import pipeline_model


def _run(*argv):
    scenario, args = parse(list(argv))
    return runner.run(scenario, args, log=lambda line: None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["evaluate", "fit-validation"])
def test_calls_stage_every_call_on_one_dataset(method):
    rows = _run(
        *("calls", "--workloads", "tabular", "--method", method),
        *("--calls", "2", "--batches", "2", "--rounds", "2"),
    )
    assert {(r["workload"], r["mode"]) for r in rows} == {
        (f"tabular-{method}", mode)
        for mode in ("plain", "staged_always", "plain_again")
    }
    staged = [r for r in rows if r["mode"] == "staged_always"]
    rounds = sorted(r["round"] for r in staged if r["metric"] == "seconds")
    assert rounds == [0, 1]
    # adaptive=False: every call of a round staged, none decided away.
    assert all(r["staged_calls"] == r["calls"] >= 2 for r in staged), staged
    assert all(r["calls"] is None for r in rows if r["mode"] != "staged_always")


@pytest.mark.timeout(120)
def test_calls_on_a_new_dataset_each_call_are_staged_too():
    rows = _run(
        *("calls", "--workloads", "tabular", "--method", "predict"),
        *("--calls", "3", "--batches", "2", "--rounds", "1", "--new-datasets"),
        *("--modes", "plain,staged_always"),
    )
    (staged,) = [
        r
        for r in rows
        if r["mode"] == "staged_always" and r["metric"] == "seconds"
    ]
    assert staged["staged_calls"] == staged["calls"] == 3
    assert staged["value"] > 0


@pytest.mark.timeout(60)
def test_the_hand_split_maps_the_kept_dataset_once():
    scenario, args = parse(
        ["calls", "--method", "fit-validation", "--batches", "2"]
    )
    built, method, feed, calls, _ = scenario.setup(
        "tabular-fit-validation", MODES["expert"], args
    )
    (data, kwargs), (again, kwargs_again) = feed(), feed()
    # Mapped in setup, then fed as they are: the same objects every call.
    assert built.kind == "plain" and method == "fit" and calls == 5
    assert data is again and kwargs is kwargs_again
    assert kwargs["epochs"] == 3 and "validation_data" in kwargs
    scenario.trial((built, method, feed, 1, None))
    args.new_datasets = True
    built, _, feed, _, _ = scenario.setup(
        "tabular-evaluate", MODES["expert"], args
    )
    assert built.kind == "expert" and feed()[0] is not feed()[0]


def test_calls_reject_an_unknown_method():
    scenario, args = parse(["calls", "--method", "evaluate,fit_twice"])
    with pytest.raises(SystemExit, match="fit_twice"):
        scenario.cases(args)


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("option", ["--service", "--strategy=mirrored"])
def test_calls_run_on_a_service_and_under_a_strategy(option):
    # A strategy's logical devices need a fresh process: run as a user does.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "calls", option, "--no-write"]
        + ["--method", "evaluate,fit-validation", "--calls", "2"]
        + ["--batches", "2", "--rounds", "1"],
        cwd=runner.ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # One staged mode (staged_always): its calls, both staged, end each row.
    assert any("staged_always/plain" in line for line in lines)
    table = [line for line in lines if "-evaluate |" in line]
    assert table and all(line.endswith("| 2/2 |") for line in table)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["slow_source", "slow_step"])
def test_a_determinism_round_returns_the_verdicts_figures(case, monkeypatch):
    from benchmarks.scenarios import determinism

    monkeypatch.setattr(determinism.Slow, "quick_steps", 6)
    scenario, args = parse(["determinism", "--quick"])
    state = scenario.setup(case, MODES["staged_always"], args)
    figures = scenario.trial(state)
    assert {"wait_ratio", "buffer_fill", "input_bound"} <= set(figures)
    assert figures["input_bound"] == (case == "slow_source")
    if case == "slow_step":  # the sleep stayed in the step
        assert figures["train_seconds_per_batch"] >= determinism.SLEEP_SECONDS


@pytest.mark.long
@pytest.mark.timeout(600)
def test_determinism_runs_each_round_in_a_fresh_process():
    rows = _run(
        "determinism", "--rounds", "1", "--quick", "--workloads", "slow_step"
    )
    by_mode = {}
    for row in rows:
        by_mode.setdefault(row["mode"], {})[row["metric"]] = row
    assert set(by_mode) == {
        "staged_always",
        "staged_deterministic",
        "staged_always_again",
    }
    for mode, metrics in by_mode.items():
        assert {"seconds", "process", "delivery_seconds_per_batch"} <= set(
            metrics
        )
        assert metrics["seconds"]["staged_calls"] == 1
        # Under op determinism the wait is read from tf.data's model of the
        # iterator, which TensorFlow 2.16 cannot read (docs/callback.md).
        timed = mode != "staged_deterministic" or pipeline_model.AVAILABLE
        assert ("wait_ratio" in metrics) == timed, (mode, sorted(metrics))


def test_each_floor_case_runs_its_own_modes():
    scenario, args = parse(["floor"])
    # The hand-built pipeline first and last (the reference, the control),
    # the floor (the trunk alone) in every case.
    assert scenario.case_modes("remote", args) == [
        "pipeline_auto",
        "compute_bound",
        "staged",
        "pipeline_16",
        "pipeline_2cpu",
        "pipeline_split",
        "pipeline_auto_again",
    ]
    for case in ("images", "criteo"):
        modes = scenario.case_modes(case, args)
        assert modes[0] == "pipeline_auto" and "compute_bound" in modes
        assert modes[-1] == "pipeline_auto_again"
    assert "parsing_beside" in scenario.case_modes("criteo", args)
    scenario, args = parse(["floor", "--modes", "pipeline_auto,staged_pool2"])
    assert scenario.case_modes("remote", args) == ["pipeline_auto"]
    assert scenario.case_modes("images", args) == [
        "pipeline_auto",
        "staged_pool2",
    ]


@pytest.mark.timeout(120)
def test_the_floor_of_remote_beside_pipelines_built_by_hand():
    modes = "pipeline_auto,pipeline_split,compute_bound,pipeline_auto_again"
    rows = _run(
        *("floor", "--cases", "remote", "--steps", "2", "--rounds", "1"),
        *("--modes", modes + ",staged_pool2"),  # not a mode of remote
    )
    assert {r["mode"] for r in rows} == set(modes.split(","))
    assert {r["metric"] for r in rows} == {"seconds", "to_end", "teardown"}
    assert all(r["value"] > 0 for r in rows if r["metric"] != "teardown")


@pytest.mark.timeout(60)
def test_compute_bound_preprocesses_a_dataset_once():
    scenario, args = parse(["floor", "--steps", "2"])
    built, data = scenario.setup("remote", MODES["compute_bound"], args)
    assert built.feed(data) is built.feed(data)


@pytest.mark.long
@pytest.mark.timeout(300)
def test_the_trunk_beside_a_parsing_process():
    rows = _run(
        *("floor", "--cases", "criteo", "--steps", "2", "--rounds", "2"),
        *("--modes", "compute_bound,parsing_beside"),
    )
    lags = [r["value"] for r in rows if r["metric"] == "lag"]
    assert len(lags) == 2 and all(lag >= 0 for lag in lags)
