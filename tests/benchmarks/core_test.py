"""The benchmark tool's core: workloads, modes, the paired runner, records.

Speed is never asserted here; what is checked is that every mode does the
same work (equal losses), that the runner pairs and rotates as it says, and
that summaries, tables and the history read one schema.
"""

import json
import logging
import pathlib

import numpy as np
import pytest

from benchmarks import history, records, runner
from benchmarks.__main__ import parse
from benchmarks.modes import MODES
from benchmarks.workloads import WORKLOADS, workload

# The slower workloads' builds run in the long sweep.
SLOW = ("featurespace", "criteo_columns", "retrieval", "deep_retrieval", "dlrm")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.long) if name in SLOW else name
        for name in sorted(WORKLOADS)
    ],
)
def test_every_mode_of_a_workload_does_the_same_work(name):
    work = workload(name)
    x, y = work.data(2 * work.batch_size)
    losses = {}
    for mode in ("plain", "staged", "expert", "compute_bound"):
        built = MODES[mode].build(work, x)
        history_ = built.call("fit", work.dataset(x, y), epochs=1)
        losses[mode] = history_.history["loss"][0]
    # `images` flips at random: its draws differ where the flip runs.
    rtol = 1e-3 if name == "images" else 1e-5
    np.testing.assert_allclose(
        list(losses.values()), losses["plain"], rtol=rtol, err_msg=str(losses)
    )


def test_an_unknown_workload_or_mode_is_named():
    with pytest.raises(ValueError, match="Unknown workload 'nope'"):
        workload("nope")
    with pytest.raises(ValueError, match="no attribute 'stepz'"):
        workload("none", stepz=3)
    with pytest.raises(ValueError, match="kind 'fast' is not one of"):
        type(MODES["plain"])("x", "fast")


def test_rounds_rotate_the_modes():
    assert runner.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert runner.rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert runner.rotated(["a", "b", "c"], 5) == ["c", "a", "b"]


def test_decisions_are_read_from_keras_stages_log():
    log = logging.getLogger("keras_stage")
    with runner.decisions_logged() as decisions:
        log.info("Model 'm': train is staged [pays]: it saves 3 ms.")
        log.info(
            "Model 'm': test runs the whole model in Keras's step, "
            "unstaged [does_not_pay]: it cannot repay its set-up."
        )
        log.info("Model 'm': an unrelated line.")
    assert decisions == [
        ("train", True, "pays", "it saves 3 ms."),
        ("test", False, "does_not_pay", "it cannot repay its set-up."),
    ]


def test_the_decision_line_is_the_one_keras_stage_logs():
    # The parsed form of keras_stage's own log line (models/call/facts.py).
    from keras_stage.models.call import facts

    source = pathlib.Path(facts.__file__).read_text()
    assert "\"Model '%s': %s %s [%s]: %s.\"" in source
    assert "runs the whole model in Keras's step, unstaged" in source


def open_text(path):
    return pathlib.Path(path).read_text()


def _row(mode, round_, value, staged=None, why=()):
    return {
        "benchmark": "b",
        "workload": "w",
        "mode": mode,
        "round": round_,
        "metric": "seconds",
        "value": value,
        "staged_calls": staged,
        "calls": None if staged is None else 1,
        "why": list(why),
    }


def test_summaries_pair_rounds_and_count_staged_calls():
    rows = [
        _row("plain", 0, 1.0),
        _row("plain", 1, 2.0),
        _row("plain", 2, 4.0),
        _row("staged", 0, 0.5, 1),
        _row("staged", 1, 1.0, 1),
        _row("staged", 2, 8.0, 0, ["too short"]),
        _row("plain_again", 0, 1.1),
        _row("plain_again", 1, 2.0),
        _row("plain_again", 2, 4.0),
    ]
    (summary,) = records.summarize(rows, "plain", "plain_again")
    # Paired: per round 0.5, 0.5, 2.0 -> median 0.5 (of medians: 1.0 / 2.0).
    assert summary["ratio"]["staged"] == 0.5
    assert summary["control"] == 1.0
    assert summary["staged"] == {"staged": [2, 3]}
    assert summary["why"] == {"staged": ["too short"]}
    assert records.ran_staged(summary, "staged") == "2/3"
    assert records.within_noise(summary, "staged")
    text = records.table([summary], "plain", "plain_again")
    assert (
        "| workload | plain seconds | staged/plain | control (plain_again) |"
        in text
    )
    # One metric, one staged mode; the control's rounds: 1.1, 1.0, 1.0.
    assert "| w | 2.000 | 0.50 | 1.00 (1.00-1.05) | 2/3 |" in text
    assert summary["control_range"] == pytest.approx([1.0, 1.05])
    # The control's distance from 1 is its range's: 1.04 is within it.
    within = {**summary, "ratio": {"staged": 1.04}}
    assert records.within_noise(within, "staged")
    assert not records.within_noise({**within, "control_range": None}, "staged")


def test_the_speed_table_times_calls_to_their_last_callback():
    # Per mode: the whole call, its time to the last callback, the rest.
    timings = {
        "plain": (2.6, 1.3),  # a call that waited 1.3 s in its tear-down
        "staged": (1.0, 0.001),
        "expert": (1.2, 0.001),
        "plain_again": (1.3, 0.001),
        "compute_bound": (0.9, 0.001),
    }
    rows = []
    for mode, (seconds, teardown) in timings.items():
        staged = 1 if mode == "staged" else None
        for metric, value in (
            ("seconds", seconds),
            ("to_end", seconds - teardown),
            ("teardown", teardown),
        ):
            rows.append({**_row(mode, 0, value, staged), "metric": metric})
    summaries = records.summarize(rows, "plain", "plain_again")
    (teardown,) = [s for s in summaries if s["metric"] == "teardown"]
    assert teardown["max"]["plain"] == teardown["mean"]["plain"] == 1.3
    text = records.speed_table({"summaries": summaries})
    assert "| `w` |  | 0.77 | 1.00 | 0.83 | 1 of 1 |" in text  # 1.0 / 1.3
    assert "up to 1.30 s in plain Keras's fits and 0.00 s in the staged" in text
    # The generic table shows `to_end`, not the whole call or the tear-down.
    table = records.table(summaries, "plain", "plain_again")
    assert "| workload | plain to_end |" in table
    assert "seconds" not in table and "teardown" not in table
    both = records.table(
        summaries, "plain", "plain_again", ["seconds", "to_end"]
    )
    assert "| w | seconds | 2.600 | 0.38 |" in both  # two metrics: a column


def test_a_summary_file_becomes_history_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RESULTS", str(tmp_path))
    rows = [_row("plain", 0, 2.0), _row("staged", 0, 1.0, 1)]
    summaries = records.summarize(rows, "plain", "plain_again")
    path = records.write("b", "n", "python -m benchmarks b", rows, summaries)
    assert json.loads(open_text(path))["summaries"] == summaries
    (raw,) = (tmp_path / "raw").iterdir()
    assert len(json.loads(raw.read_text())["rows"]) == 2
    (row,) = history.rows_of(path)
    assert (row["family"], row["workload"], row["timing"]) == ("b", "w", "call")
    assert row["staged/plain"] == "0.5" and row["other"] == "ran staged 1/1"
    csv = tmp_path / "history.csv"
    assert history.update([path], str(csv)) == 1
    assert history.update([path], str(csv)) == 0  # not added twice


def _seconds(rows):
    return [r for r in rows if r["metric"] == "seconds"]


def test_a_bench_run_records_every_mode_and_its_staged_calls():
    scenario, args = parse(
        ["bench", "--workloads", "none", "--steps", "2", "--rounds", "2"]
    )
    rows = runner.run(scenario, args, log=lambda line: None)
    modes = {row["mode"] for row in rows}
    assert modes == set(scenario.modes)
    seconds = [r for r in rows if r["metric"] == "seconds"]
    assert sorted(r["round"] for r in seconds if r["mode"] == "staged") == [
        0,
        1,
    ]
    # Each trial: the whole call, its time to the last callback and the
    # tear-down after it, which add up.
    by_trial = {}
    for row in rows:
        key = (row["mode"], row["round"])
        by_trial.setdefault(key, {})[row["metric"]] = row["value"]
    for trial in by_trial.values():
        assert set(trial) == {"seconds", "to_end", "teardown"}
        assert 0 <= trial["teardown"] < trial["seconds"]
        assert trial["to_end"] + trial["teardown"] == pytest.approx(
            trial["seconds"]
        )
    staged = [r for r in rows if r["mode"] == "staged"]
    assert all(r["calls"] >= 1 for r in staged), staged
    assert all(r["calls"] is None for r in rows if r["mode"] != "staged")


def test_a_regime_runs_its_calls_in_every_mode():
    scenario, args = parse(
        ["regimes", "--workloads", "tabular", "--regimes", "evaluate_x3"]
        + ["--tiny", "--rounds", "1", "--modes", "plain,staged,expert"]
    )
    rows = runner.run(scenario, args, log=lambda line: None)
    assert {(r["workload"], r["mode"]) for r in rows} == {
        ("tabular/evaluate_x3", mode) for mode in ("plain", "staged", "expert")
    }
    (staged,) = [r for r in _seconds(rows) if r["mode"] == "staged"]
    assert staged["calls"] == 2  # evaluate_x3 at its tiny size: 2 calls


def test_the_tool_stays_small_and_keeps_only_summaries():
    root = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    code = sum(len(p.read_text().splitlines()) for p in root.rglob("*.py"))
    assert code <= 3500, f"benchmarks/ has {code} lines of Python; keep 3,500"
    # In git: the history and one summary per latest run of each family;
    # the raw rows (results/raw/) and bench-quick's checks are ignored.
    kept = [
        p
        for p in (root / "results").iterdir()
        if p.is_file() and not p.name.endswith("-quick.json")
    ]
    lines = sum(len(p.read_text().splitlines()) for p in kept)
    assert lines <= 10_000, f"benchmarks/results/ keeps {lines} lines"
