"""The benchmark harness (`benchmarks/`) runs end to end on a tiny size.

These tests check the harness, not the speed: every workload in every mode
for a couple of steps, the files it writes, the JSON schema, and that the
ratios are computed consistently from the repetitions.
"""

import dataclasses
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

import pytest

# The benchmarks run in the primary environment (`make bench`), which has
# matplotlib for the charts; the tensorflow-io environment does not.
pytest.importorskip("matplotlib")

from benchmarks import harness, report, run  # noqa: E402
from benchmarks.harness import add_ratios  # noqa: E402
from benchmarks.modes import MODE_ORDER  # noqa: E402
from benchmarks.workloads import WORKLOADS, trunk_scale  # noqa: E402
from keras_stage.data import live_stages  # noqa: E402

STEPS = 2
BATCH = 16
MODE_KEYS = {
    "description",
    "settings",
    "steps_per_second",
    "seconds_per_step",
    "setup_seconds",
    "warm_up_seconds",
    "cores",
    "cleanup_seconds",
    "reps",
    "call_seconds",
    "call_seconds_per_step",
    "outside_seconds",
}
# The ratios of whole calls (the headline), and of the steps alone.
RATIO_KEYS = (
    "ratio_to_plain",
    "ratio_to_expert",
    "ratio_to_limit",
    "speedup_vs_plain",
    "paired_ratio_to_plain",
    "paired_ratio_to_expert",
    "paired_ratio_to_limit",
    "paired_speedup_vs_plain",
)
MODE_KEYS |= {*RATIO_KEYS, *(f"steps_{key}" for key in RATIO_KEYS)}
REP_KEYS = {
    "seconds",
    "steps",
    "steps_per_second",
    "first_step_seconds",
    "cpu_seconds",
    "cores",
    "cleanup_seconds",
    "call_seconds",
    "outside_seconds",
}
LIMIT_KEYS = {
    "steps_per_second",
    "seconds_per_step",
    "bound_by",
    "compute_bound_seconds_per_step",
    "input_bound_seconds_per_step",
    "sequential_seconds_per_step",
    "call_seconds_per_step",
    "call_bound_by",
    "compute_bound_call_seconds_per_step",
    "input_bound_call_seconds_per_step",
    "sequential_call_seconds_per_step",
}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One tiny run of the CLI over every workload: (status, json, png)."""
    out = tmp_path_factory.mktemp("bench")
    status = run.main(
        [
            "--steps",
            str(STEPS),
            "--reps",
            "1",
            "--batch-size",
            str(BATCH),
            "--name",
            "smoke",
            "--out",
            str(out),
            "--data-dir",
            str(out / "images"),
            # The host buffer, as measured on a GPU machine (benchmarks/
            # gpu.md); on this machine the same as the defaults. Every
            # call staged (adaptive=False): fits of 2 steps on data in
            # memory would otherwise run unstaged once their stage's costs
            # are measured, and this run checks the staged modes' figures.
            "--staged-options",
            '{"device": "cpu", "adaptive": false}',
        ]
    )
    with open(out / "smoke.json") as f:
        results = json.load(f)
    # Every stage the run made has stopped its threads (True: none left).
    closed = [staged.close(timeout=1.0) for staged in live_stages()]
    return status, results, out / "smoke.png", closed


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-9)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_workload_and_mode_runs_and_writes_files(smoke_run):
    status, results, png, closed = smoke_run
    assert all(closed)
    failed = {
        (w, m): mode.get("error")
        for w, section in results["workloads"].items()
        for m, mode in section["modes"].items()
        if "error" in mode
    }
    assert failed == {}
    assert status == 0
    assert png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(results["workloads"]) == list(WORKLOADS)
    for section in results["workloads"].values():
        assert list(section["modes"]) == list(MODE_ORDER)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_results_schema(smoke_run):
    _, results, _, _ = smoke_run
    assert results["schema_version"] == 1
    assert results["config"]["reps"] == 1
    assert results["config"]["steps"] == STEPS
    assert "on_train_batch_begin" in results["timed"]
    assert "Whole calls (the headline ratios)" in results["timed"]
    env = results["environment"]
    for key in ("tensorflow", "keras", "keras_stage", "cpu_count", "python"):
        assert env[key]
    assert len(results["load"]["loadavg_before"]) == 3
    assert {t["workload"] for t in results["targets"]} <= set(WORKLOADS)
    for section in results["workloads"].values():
        assert section["info"]["steps"] == STEPS
        assert section["info"]["batch_size"] == BATCH
        limit = section["limit"]
        assert set(limit) >= LIMIT_KEYS
        assert all(limit[key] is not None for key in LIMIT_KEYS)
        for infix in ("", "call_"):
            assert _close(
                limit[f"sequential_{infix}seconds_per_step"],
                limit[f"compute_bound_{infix}seconds_per_step"]
                + limit[f"input_bound_{infix}seconds_per_step"],
            )
        for name, mode in section["modes"].items():
            assert MODE_KEYS <= set(mode), name
            assert len(mode["reps"]) == 1
            rep = mode["reps"][0]
            assert REP_KEYS <= set(rep)
            assert rep["steps"] == STEPS
            assert rep["seconds"] > 0
            assert rep["cpu_seconds"] >= 0
            # The whole call holds the steps window.
            assert rep["call_seconds"] >= rep["seconds"]
            assert _close(
                rep["outside_seconds"], rep["call_seconds"] - rep["seconds"]
            )
            if name != "input-bound":
                assert rep["fit_seconds"] >= rep["seconds"]
                # A fit mode's whole call is its fit call.
                assert rep["call_seconds"] == rep["fit_seconds"]
                assert _close(
                    rep["outside_seconds"], rep["fit_seconds"] - rep["seconds"]
                )
                assert math.isfinite(rep["loss"])
            if name.startswith("staged"):
                assert 0 <= rep["stage_wait_ratio"] <= 1
                assert rep["verdict"]["suggested_num_threads"] >= 1
        staged = section["modes"]["staged"]["settings"]
        assert staged["num_threads"] == "auto"
        assert staged["capacity"] == "auto"
        assert staged["staged_layers"][0].startswith("staged_input")
        tuned = section["modes"]["staged-tuned"]["settings"]
        verdict = tuned["tuned_from"]["verdict"]
        assert tuned["num_threads"] == verdict["suggested_num_threads"]
        assert tuned["capacity"] == verdict["suggested_capacity"]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ratios_are_consistent_with_the_repetitions(smoke_run):
    _, results, _, _ = smoke_run
    for section in results["workloads"].values():
        modes = section["modes"]
        median = {}
        call = {}
        for name, mode in modes.items():
            sps = [r["steps_per_second"] for r in mode["reps"]]
            for rep in mode["reps"]:
                assert _close(
                    rep["steps_per_second"], rep["steps"] / rep["seconds"]
                )
            median[name] = statistics.median(sps)
            assert _close(mode["steps_per_second"]["median"], median[name])
            assert mode["steps_per_second"]["min"] == min(sps)
            assert mode["steps_per_second"]["max"] == max(sps)
            # Whole calls: the fit call's seconds (input-bound: its
            # iterator and pass), per step.
            calls = [
                r["call_seconds"] if name == "input-bound" else r["fit_seconds"]
                for r in mode["reps"]
            ]
            call[name] = statistics.median(calls) / STEPS
            assert _close(mode["call_seconds"]["median"], call[name] * STEPS)
            assert _close(mode["call_seconds_per_step"]["median"], call[name])
            assert mode["call_seconds"]["min"] == min(calls)
            assert mode["call_seconds"]["max"] == max(calls)
        limit = section["limit"]
        # The steps alone.
        steps_limit = min(median["compute-bound"], median["input-bound"])
        assert _close(limit["steps_per_second"], steps_limit)
        for name, mode in modes.items():
            assert _close(
                mode["steps_ratio_to_plain"], median["plain"] / median[name]
            )
            assert _close(
                mode["steps_ratio_to_expert"], median["expert"] / median[name]
            )
            assert _close(
                mode["steps_ratio_to_limit"], steps_limit / median[name]
            )
            assert _close(
                mode["steps_speedup_vs_plain"] * mode["steps_ratio_to_plain"], 1
            )
        assert modes["plain"]["steps_ratio_to_plain"] == 1
        assert _close(modes[limit["bound_by"]]["steps_ratio_to_limit"], 1)
        # Whole calls, the headline: from the medians of the fit calls.
        call_limit = max(call["compute-bound"], call["input-bound"])
        assert _close(limit["call_seconds_per_step"], call_limit)
        for name, mode in modes.items():
            assert _close(mode["ratio_to_plain"], call[name] / call["plain"])
            assert _close(mode["ratio_to_expert"], call[name] / call["expert"])
            assert _close(mode["ratio_to_limit"], call[name] / call_limit)
            assert _close(mode["speedup_vs_plain"] * mode["ratio_to_plain"], 1)
        assert modes["plain"]["ratio_to_plain"] == 1
        assert _close(modes[limit["call_bound_by"]]["ratio_to_limit"], 1)
        # Paired: every mode ran every round, and plain against itself is 1.
        steps_times = {
            name: {r["round"]: 1 / r["steps_per_second"] for r in m["reps"]}
            for name, m in modes.items()
        }
        call_times = {
            name: {
                r["round"]: r["call_seconds"] / r["steps"] for r in m["reps"]
            }
            for name, m in modes.items()
        }
        for prefix, times in (("", call_times), ("steps_", steps_times)):
            assert all(
                sorted(t) == sorted(times["plain"]) for t in times.values()
            )
            for name, mode in modes.items():
                assert _close(
                    mode[f"{prefix}paired_ratio_to_plain"],
                    statistics.median(
                        times[name][r] / times["plain"][r] for r in times[name]
                    ),
                )
            assert modes["plain"][f"{prefix}paired_ratio_to_plain"] == 1
    # The targets are judged on whole calls, the steps beside them.
    for check in results["targets"]:
        staged = results["workloads"][check["workload"]]["modes"]["staged"]
        key = check["key"]
        assert check["value"] == staged[key]
        assert check["paired_value"] == staged[f"paired_{key}"]
        assert check["steps_value"] == staged[f"steps_{key}"]
        assert check["steps_paired_value"] == staged[f"steps_paired_{key}"]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_table_shows_every_workload(smoke_run):
    _, results, _, _ = smoke_run
    table = report.format_table(results)
    for workload in WORKLOADS:
        assert f"\n{workload}: batch {BATCH}" in table
    assert table.count("staged-tuned") == len(WORKLOADS)
    # Whole calls and the steps alone, side by side, for every workload.
    assert table.count("whole call (fit, set-up included)") == len(WORKLOADS)
    assert table.count("steps only (first batch to last)") == len(WORKLOADS)
    assert table.count("limit, whole calls: ") == len(WORKLOADS)
    assert table.count("limit, steps only: ") == len(WORKLOADS)


def _section(medians, calls=None):
    """Modes with these median steps/s and whole-call seconds per step."""
    calls = calls or {}
    return {
        "modes": {
            name: {
                "steps_per_second": {"median": sps},
                **(
                    {"call_seconds_per_step": {"median": calls[name]}}
                    if name in calls
                    else {}
                ),
            }
            for name, sps in medians.items()
        }
    }


def test_add_ratios_uses_the_slower_limit_and_time_ratios():
    section = _section(
        {
            "plain": 10.0,
            "expert": 20.0,
            "staged": 25.0,
            "compute-bound": 40.0,
            "input-bound": 30.0,
        },
        # Whole calls: set-up makes the compute-bound call the slower, and
        # staged's the slowest.
        calls={
            "plain": 0.2,
            "expert": 0.1,
            "staged": 0.25,
            "compute-bound": 0.125,
            "input-bound": 0.05,
        },
    )
    add_ratios(section)
    assert section["limit"]["bound_by"] == "input-bound"
    assert section["limit"]["steps_per_second"] == 30.0
    staged = section["modes"]["staged"]
    assert staged["steps_ratio_to_plain"] == 0.4
    assert staged["steps_speedup_vs_plain"] == 2.5
    assert staged["steps_ratio_to_expert"] == 0.8
    assert staged["steps_ratio_to_limit"] == 1.2
    # The headline, of whole calls.
    assert section["limit"]["call_bound_by"] == "compute-bound"
    assert _close(section["limit"]["call_seconds_per_step"], 0.125)
    assert _close(section["limit"]["sequential_call_seconds_per_step"], 0.175)
    assert _close(staged["ratio_to_plain"], 1.25)
    assert _close(staged["speedup_vs_plain"], 0.8)
    assert _close(staged["ratio_to_expert"], 2.5)
    assert _close(staged["ratio_to_limit"], 2.0)


def _rounds(times, outside=None):
    """A section whose modes ran one repetition per round at `times`.

    `times` are seconds per step of the steps; each whole call of 10
    steps takes `outside[name]` seconds more (none by default).
    """
    outside = outside or {}
    return {
        "modes": {
            name: {
                "steps_per_second": {
                    "median": statistics.median(1 / t for t in seconds)
                },
                "call_seconds_per_step": {
                    "median": statistics.median(
                        t + outside.get(name, 0) / 10 for t in seconds
                    )
                },
                "reps": [
                    {
                        "round": r,
                        "steps": 10,
                        "steps_per_second": 1 / t,
                        "call_seconds": 10 * t + outside.get(name, 0),
                    }
                    for r, t in enumerate(seconds)
                ],
            }
            for name, seconds in times.items()
        }
    }


def test_add_ratios_pairs_the_repetitions_of_each_round():
    # The machine slowed down in round 1 for every mode alike; within
    # each round staged is 2% slower than plain and expert.
    section = _rounds(
        {
            "plain": [1.00, 2.00, 1.10],
            "expert": [1.00, 2.00, 1.10],
            "staged": [1.02, 2.04, 1.122],
            "compute-bound": [0.50, 1.00, 0.55],
            "input-bound": [0.60, 0.90, 0.60],
        }
    )
    add_ratios(section)
    staged = section["modes"]["staged"]
    for prefix in ("", "steps_"):
        # No time outside the steps: whole calls and steps agree.
        assert _close(staged[f"{prefix}paired_ratio_to_plain"], 1.02)
        assert _close(staged[f"{prefix}paired_ratio_to_expert"], 1.02)
        assert _close(staged[f"{prefix}paired_speedup_vs_plain"], 1 / 1.02)
        # The limit of each round is its slower bound: 0.6, 1.0, 0.6.
        assert _close(
            staged[f"{prefix}paired_ratio_to_limit"], 1.02 / 0.6 * 1.1
        )
        assert section["modes"]["plain"][f"{prefix}paired_ratio_to_plain"] == 1
    checks = {
        (c["workload"], c["key"]): c
        for c in report.target_checks({"workloads": {"none": section}})
    }
    check = checks[("none", "ratio_to_plain")]
    assert _close(check["paired_value"], 1.02)
    assert check["paired_met"] is True
    assert check["met"] == (check["value"] <= 1.03)
    assert _close(check["steps_paired_value"], 1.02)
    assert check["steps_paired_met"] is True
    assert check["steps_met"] == (check["steps_value"] <= 1.03)


def test_whole_call_ratios_count_the_set_up():
    # Staged's steps are 2% faster than plain's in every round, but each of
    # its calls spends 0.2 s more outside them (10 steps a call).
    section = _rounds(
        {
            "plain": [0.10, 0.20, 0.11],
            "staged": [0.098, 0.196, 0.1078],
            "compute-bound": [0.05, 0.10, 0.055],
            "input-bound": [0.06, 0.09, 0.06],
        },
        outside={"staged": 0.2},
    )
    add_ratios(section)
    staged = section["modes"]["staged"]
    assert _close(staged["steps_paired_ratio_to_plain"], 0.98)
    # Per round, (10 x step + 0.2) / (10 x plain's step): 1.18, 1.08 and
    # 0.1278 / 0.11 (1.16), the median.
    assert _close(staged["paired_ratio_to_plain"], 0.1278 / 0.11)
    assert _close(staged["ratio_to_plain"], (0.1078 + 0.02) / 0.11)
    assert _close(staged["steps_ratio_to_plain"], 0.98)
    checks = {
        (c["workload"], c["key"]): c
        for c in report.target_checks({"workloads": {"none": section}})
    }
    # Within 3% of plain by its steps, not by its whole calls.
    check = checks[("none", "ratio_to_plain")]
    assert (check["met"], check["paired_met"]) == (False, False)
    assert (check["steps_met"], check["steps_paired_met"]) == (True, True)


def test_add_ratios_pairs_only_the_rounds_both_ran():
    section = _rounds({"plain": [1.0, 2.0, 3.0], "staged": [1.1, 2.4, 3.6]})
    # staged failed in round 1: its record is missing.
    del section["modes"]["staged"]["reps"][1]
    add_ratios(section)
    for prefix in ("", "steps_"):
        staged = section["modes"]["staged"]
        assert _close(staged[f"{prefix}paired_ratio_to_plain"], 1.15)
        assert staged[f"{prefix}paired_ratio_to_expert"] is None
        assert staged[f"{prefix}paired_ratio_to_limit"] is None


def test_add_ratios_leaves_failed_modes_out():
    section = _section(
        {"plain": 10.0, "expert": 20.0, "compute-bound": 5.0},
        calls={"plain": 0.5, "expert": 0.25, "compute-bound": 1.0},
    )
    section["modes"]["staged"] = {"error": "boom"}
    add_ratios(section)
    assert section["limit"] is None
    for prefix in ("", "steps_"):
        modes = section["modes"]
        assert modes["staged"][f"{prefix}ratio_to_plain"] is None
        assert modes["expert"][f"{prefix}ratio_to_plain"] == 0.5
        assert modes["expert"][f"{prefix}ratio_to_limit"] is None


def test_add_ratios_of_results_without_whole_calls():
    # Results written before whole calls were timed: the steps' ratios
    # only, the whole calls' left None.
    section = _section({"plain": 10.0, "expert": 20.0})
    section["modes"]["expert"]["reps"] = [{"steps_per_second": 20.0}]
    add_ratios(section)
    expert = section["modes"]["expert"]
    assert expert["steps_ratio_to_plain"] == 0.5
    assert expert["ratio_to_plain"] is None
    assert expert["paired_ratio_to_plain"] is None


def test_trunk_option():
    assert trunk_scale("light") == 1.0
    assert trunk_scale("heavy") > 1.0
    assert trunk_scale("2.5") == 2.5
    for bad in ("huge", "0", "-1"):
        with pytest.raises(ValueError, match="trunk"):
            trunk_scale(bad)


def test_cli_rejects_unknown_workloads(capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--workloads", "seed,mnist"])
    assert "mnist" in capsys.readouterr().err
    args = run.parse_args(["--quick", "--workloads", "none,seed"])
    assert args.workloads == ["none", "seed"]
    assert args.name == "bench-quick"
    assert args.staged_options is None


@pytest.mark.parametrize("bad", ["{device: cpu}", "[1]"])
def test_cli_rejects_staged_options_that_are_not_a_json_object(bad, capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--staged-options", bad])
    assert "--staged-options" in capsys.readouterr().err


@pytest.mark.long
def test_staged_options_reach_the_staged_modes(smoke_run):
    _, results, _, _ = smoke_run
    assert results["config"]["staged_options"] == {
        "device": "cpu",
        "adaptive": False,
    }
    for section in results["workloads"].values():
        for name in ("staged", "staged-tuned"):
            description = section["modes"][name]["description"]
            assert "device='cpu'" in description
            assert "adaptive=False" in description


@pytest.mark.long
def test_remote_read_option(smoke_run, capsys):
    _, results, _, _ = smoke_run
    assert results["config"]["remote_read"] == "tf"
    assert results["config"]["remote_latency"] is None
    assert results["workloads"]["remote"]["info"]["read"] == "tf"
    assert run.parse_args(["--remote-read", "python"]).remote_read == "python"
    with pytest.raises(SystemExit):
        run.parse_args(["--remote-read", "disk"])
    assert "--remote-read" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read", ["tf", "python"])
def test_remote_read_blocks_and_passes_the_lines_through(read):
    import time

    import tensorflow as tf

    from benchmarks.workloads.remote import RemoteRead

    layer = RemoteRead(0.05, read=read)
    restored = RemoteRead.from_config(layer.get_config())
    assert (restored.seconds, restored.read) == (0.05, read)
    lines = tf.constant(["1,2,3.0", "4,5,6.0"])
    read_fn = tf.function(layer)
    read_fn(lines)  # traced outside the timed call
    started = time.perf_counter()
    out = read_fn(lines)
    # A lower bound (the emulated latency), not a speed check.
    assert time.perf_counter() - started >= 0.05
    assert out.numpy().tolist() == lines.numpy().tolist()


def test_remote_latency_option():
    from benchmarks.harness import _remote_kwargs
    from benchmarks.workloads.remote import READ_SECONDS, RemoteWorkload

    assert run.parse_args([]).remote_latency_ms is None
    assert run.parse_args(["--remote-latency-ms", "80"]).remote_latency_ms == 80
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit):
            run.parse_args(["--remote-latency-ms", bad])
    assert _remote_kwargs("tf", None) == {"read": "tf"}
    assert _remote_kwargs("tf", 0.08) == {"read": "tf", "read_seconds": 0.08}
    default = RemoteWorkload(steps=1)
    assert default.read_seconds == READ_SECONDS
    assert "waits 20 ms" in default.description
    slow = RemoteWorkload(steps=1, read_seconds=0.08)
    assert "waits 80 ms" in slow.description
    assert slow.params()["read_seconds_per_batch"] == 0.08
    (read, _) = slow.preprocessing()
    assert read.seconds == 0.08
    with pytest.raises(ValueError, match="read_seconds=0"):
        RemoteWorkload(steps=1, read_seconds=0)


def test_remote_read_rejects_an_unknown_kind():
    from benchmarks.workloads.remote import RemoteRead, RemoteWorkload

    with pytest.raises(ValueError, match="read='disk'"):
        RemoteRead(read="disk")
    with pytest.raises(ValueError, match="read='disk'"):
        RemoteWorkload(steps=1, read="disk")


def _compare_briefly(module, monkeypatch, capsys):
    """Runs comparison script `module` for one round of 2 steps.

    Returns the lines it printed.
    """
    monkeypatch.setattr(module, "STEPS", 2)
    assert module.main(["1"]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_thread_pool_comparison_runs(monkeypatch, capsys):
    from benchmarks import thread_pool

    lines = _compare_briefly(thread_pool, monkeypatch, capsys)
    rows = {line[:28].strip(): line[28:].split() for line in lines[-6:-1]}
    assert set(rows) == {
        "expert",
        "expert, private pool 16",
        "staged, auto",
        "staged, thread_pool_size=16",
        "staged, thread_pool_size=2",
    }
    # The auto stage's pool was adapted after its warm-up epoch.
    assert lines[-1].startswith("staged, auto: thread pool sizes of the reps [")
    assert rows["expert"][2] == "1.000"
    assert all(float(value) > 0 for row in rows.values() for value in row)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_remote_pipelines_comparison_runs(capsys):
    from benchmarks import remote_pipelines

    assert remote_pipelines.main(["1", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:30].strip(): line[30:].split() for line in lines[-6:]}
    assert set(rows) == {
        "staged, auto",
        "fused, AUTOTUNE",
        "fused, 16",
        "fused, AUTOTUNE, cpu_budget 2",
        "split, 16 + 1",
        "compute-bound",
    }
    assert rows["staged, auto"][2] == "1.000"
    assert rows["compute-bound"][3] == "1.000"
    for ms, cpu_ms, to_staged, to_limit in rows.values():
        assert float(ms) > 0 and float(to_staged) > 0 and float(to_limit) > 0
        # The process CPU clock ticks in 10 ms: 2 short steps may read 0.
        assert float(cpu_ms) >= 0


def test_paired_ratio_is_the_median_of_the_rounds_ratios():
    from benchmarks.paired import paired_ratio, per_step

    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])
    records = [{"seconds": 1.0, "cpu_seconds": 3.0, "steps": 4}]
    assert per_step(records) == [0.25]
    assert per_step(records, "cpu_seconds") == [0.75]


def test_run_interleaved_warms_up_each_mode_then_alternates():
    from benchmarks.paired import run_interleaved

    calls = []

    class FakeMode:
        def __init__(self, name):
            self.name = name
            self.runs = 0

        def setup(self):
            calls.append(("setup", self.name))

        def run(self):
            self.runs += 1
            calls.append(("run", self.name))
            return {"name": self.name, "run": self.runs}

        def close(self):
            calls.append(("close", self.name))

    lines = []
    records = run_interleaved(
        {"a": FakeMode("a"), "b": FakeMode("b")}, 2, log=lines.append
    )
    assert calls == [
        ("setup", "a"),
        ("run", "a"),
        ("setup", "b"),
        ("run", "b"),
        ("run", "a"),
        ("run", "b"),
        ("run", "a"),
        ("run", "b"),
        ("close", "a"),
        ("close", "b"),
    ]
    # The warm-up run is not among the records.
    assert records == {
        "a": [{"name": "a", "run": 2}, {"name": "a", "run": 3}],
        "b": [{"name": "b", "run": 2}, {"name": "b", "run": 3}],
    }
    assert lines == ["rep 1/2 done", "rep 2/2 done"]


@pytest.mark.timeout(60)
def test_input_bound_window_leaves_out_making_the_iterator():
    # As fit makes its iterator before its first step, the input-bound mode
    # makes its own before the timed window: a slow start-up is not timed.
    import time
    import types

    from benchmarks.modes import InputBoundMode

    # Long beside three steps over a range, even on a loaded machine.
    start_up = 1.0

    class SlowToStart:
        def __iter__(self):
            time.sleep(start_up)
            return iter(range(3))

    mode = InputBoundMode(types.SimpleNamespace(steps=3))
    mode.staged = SlowToStart()
    record = mode.run()
    assert record["steps"] == 3
    assert record["seconds"] < start_up / 2
    # The whole call holds it.
    assert record["call_seconds"] >= start_up
    assert _close(
        record["outside_seconds"], record["call_seconds"] - record["seconds"]
    )


def test_default_repetitions_scale_with_the_workload(monkeypatch):
    # The 3% and 5% targets need more repetitions than the defaults;
    # an explicit count is every workload's.
    asked = {}

    def fake_run_workload(workload, reps, log=print, staged_options=None):
        asked[workload.name] = reps
        return {}

    monkeypatch.setattr(harness, "run_workload", fake_run_workload)
    names = ["seed", "criteo", "images", "none"]
    harness.run_benchmark(names, steps=1, log=lambda line: None)
    assert asked == {
        "seed": harness.DEFAULT_REPS,
        "criteo": 3 * harness.DEFAULT_REPS,
        "images": 3 * harness.DEFAULT_REPS,
        "none": 3 * harness.DEFAULT_REPS,
    }
    harness.run_benchmark(names, steps=1, quick=True, log=lambda line: None)
    assert asked == {
        "seed": harness.QUICK_REPS,
        "criteo": 3 * harness.QUICK_REPS,
        "images": 3 * harness.QUICK_REPS,
        "none": 3 * harness.QUICK_REPS,
    }
    harness.run_benchmark(names, reps=2, steps=1, log=lambda line: None)
    assert asked == dict.fromkeys(names, 2)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_criteo_overlap_comparison_runs(monkeypatch, capsys):
    from benchmarks import criteo_overlap

    lines = _compare_briefly(criteo_overlap, monkeypatch, capsys)
    names = {
        "plain",
        "expert",
        "trunk alone",
        "staged",
        "trunk, a process parses beside",
    }
    parsing = ["trunk, a process parses beside"]
    if criteo_overlap.idle_class_supported():
        names |= {
            "trunk, idle-class process parses",
            "trunk, idle-class loop beside",
            "staged, stage threads idle-class",
        }
        parsing.append("trunk, idle-class process parses")
        # The staged-idle run after the warm-up moved its iterator's threads
        # (its private pool at least); the warm-up moved none.
        moved = lines[-1].rsplit("[", 1)[1].rstrip("]").split(",")
        assert [int(count) > 0 for count in moved] == [True], lines[-1]
        # Only the stage's threads: this one (the trunk's caller) keeps the
        # normal class.
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        lines = lines[:-1]
    # The parsing processes answered every repetition's request to finish
    # (a process that ended or hung fails the run instead).
    lags = lines[-1].split(": ", 1)[1].split("; ")
    assert [lag.split(":")[0] for lag in lags] == parsing, lines[-1]
    assert all(lag.endswith(" ms") for lag in lags), lines[-1]
    lines = lines[:-1]
    rows = {
        line[:34].strip(): line[34:].split() for line in lines[-len(names) :]
    }
    assert set(rows) == names
    assert rows["plain"][2] == "1.000"
    assert all(float(value) > 0 for row in rows.values() for value in row)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_regimes_time_every_regime_and_mode(tmp_path, capsys):
    from benchmarks import regimes

    argv = ["--tiny", "--rounds", "1", "--name", "smoke"]
    assert regimes.main([*argv, "--out", str(tmp_path)]) == 0
    # Every stage the run made has stopped its threads.
    assert all(staged.close(timeout=1.0) for staged in live_stages())
    with open(tmp_path / "smoke.json") as f:
        results = json.load(f)
    assert results["schema_version"] == regimes.SCHEMA_VERSION
    assert results["config"]["rounds"] == 1
    assert results["config"]["feed"] == "arrays"
    assert results["config"]["determinism"] is False
    assert results["environment"]["git_commit"]
    assert list(results["models"]) == list(regimes.DEFAULT_MODELS)
    table = capsys.readouterr().out
    for name, model in results["models"].items():
        spec = regimes.MODELS[name]
        assert model["batch_size"] == spec.batch_size == 32
        assert model["sizes"] == dataclasses.asdict(regimes.TINY)
        assert list(model["regimes"]) == list(spec.regimes)
        for name, regime in model["regimes"].items():
            assert name in table
            assert list(regime["modes"]) == list(regimes.MODES)
            for mode_name, mode in regime["modes"].items():
                (record,) = mode["rounds"]
                assert 0 < mode["steps_seconds_median"] < mode["seconds_median"]
                assert record["seconds"] == mode["seconds_median"]
                # keras_stage decides (and logs) every call of a staged
                # model; a plain model's calls decide nothing.
                assert bool(record["decisions"]) == (mode_name == "staged")
            (staged,) = regime["modes"]["staged"]["rounds"]
            assert regime["decisions"] == {
                "sequences": [staged["decisions"]],
                "counts": [1],
                "same": True,
                "same_after_first": True,
            }
            # The same batches in every mode.
            assert len({m["steps"] for m in regime["modes"].values()}) == 1
            ratios = regime["paired_ratios"]
            assert set(ratios) == {"staged/plain", "expert/plain"}
            assert all(v > 0 for r in ratios.values() for v in r.values())
            check = regime["target"]
            assert check["value"] == ratios["staged/plain"]["seconds"]
            assert check["met"] == (check["value"] <= check["bound"])
            # No control, no noise to judge by.
            assert check["control_distance"] is None
            assert check["met_within_noise"] is None
    assert len(results["targets"]) == sum(
        len(regimes.MODELS[name].regimes) for name in regimes.DEFAULT_MODELS
    )
    assert "decisions: the same in all 1 rounds (train " in table


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_regimes_control_mode_is_a_second_plain_model(tmp_path, capsys):
    from benchmarks import regimes

    argv = ["--tiny", "--rounds", "1", "--models", "dense"]
    argv += ["--regimes", "evaluate_x3", "--control", "--name", "control"]
    assert regimes.main([*argv, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "control.json") as f:
        results = json.load(f)
    assert results["config"]["modes"] == [*regimes.MODES, regimes.CONTROL]
    regime = results["models"]["dense"]["regimes"]["evaluate_x3"]
    assert type(regimes.MODE_CLASSES[regimes.CONTROL]("x", {})).__mro__[1] is (
        regimes.PlainMode
    )
    control = regime["paired_ratios"][f"{regimes.CONTROL}/plain"]
    check = regime["target"]
    assert check["control"] == control["seconds"] > 0
    assert check["control_distance"] == abs(control["seconds"] - 1)
    assert check["met_within_noise"] == (
        check["value"] <= check["bound"] + check["control_distance"]
    )
    table = capsys.readouterr().out
    assert f"{regimes.CONTROL}/plain" in table
    assert f"(noise {check['control_distance']:.3f}: " in table


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_regimes_feed_datasets_to_the_criteo_and_featurespace_models(
    tmp_path, capsys
):
    from benchmarks import regimes

    argv = ["--tiny", "--rounds", "1", "--feed", "dataset", "--control"]
    argv += ["--models", "criteo,featurespace", "--name", "dataset"]
    argv += ["--regimes", "validation,fit_2_epochs,featurespace_fit"]
    assert regimes.main([*argv, "--out", str(tmp_path)]) == 0
    assert all(staged.close(timeout=1.0) for staged in live_stages())
    with open(tmp_path / "dataset.json") as f:
        results = json.load(f)
    assert results["config"]["feed"] == "dataset"
    assert results["models"]["criteo"]["batch_size"] == 128
    assert results["models"]["featurespace"]["batch_size"] == 32
    for model in results["models"].values():
        assert list(model["regimes"]) == [
            "validation",
            "fit_2_epochs",
            "featurespace_fit",
        ]
        # The preprocessing is staged, the trunk is not.
        assert model["staged_plan"]["staged_layers"]
        assert model["staged_plan"]["trunk_layers"]
        for regime in model["regimes"].values():
            assert len({m["steps"] for m in regime["modes"].values()}) == 1
        two_epochs = model["regimes"]["fit_2_epochs"]
        staged_expert = two_epochs["paired_ratios"]["staged/expert"]
        check = two_epochs["expert_target"]
        assert check["bound"] == 1.10
        assert check["value"] == staged_expert["seconds"] > 0
        assert check["control_distance"] is not None
        assert "expert_target" not in model["regimes"]["validation"]
    ratios = {
        (t["model"], t["regime"], t["ratio"][:13]) for t in results["targets"]
    }
    assert ("criteo", "fit_2_epochs", "staged/expert") in ratios
    assert len(results["targets"]) == 2 * (3 + 1)
    table = capsys.readouterr().out
    assert "feed: dataset" in table
    assert "target on staged/expert <= 1.10" in table


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_regimes_tuner_search_times_a_keras_tuner_search(tmp_path, capsys):
    pytest.importorskip("keras_tuner")
    from benchmarks import regimes

    argv = ["--tiny", "--rounds", "1", "--feed", "dataset", "--name", "tuner"]
    argv += ["--models", "tabular", "--regimes", "tuner_search"]
    assert regimes.main([*argv, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "tuner.json") as f:
        results = json.load(f)
    regime = results["models"]["tabular"]["regimes"]["tuner_search"]
    assert regime["target"]["bound"] == 1.10
    # Every trial's batches reached the step clock, in every mode: the
    # tuner's copies of the callbacks add to it.
    sizes = regimes.TINY
    steps = sizes.tuner_trials * sizes.tuner_epochs
    steps *= sizes.tuner_batches + sizes.val_batches
    assert {m["steps"] for m in regime["modes"].values()} == {steps}


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_regimes_determinism_runs_under_op_determinism(tmp_path, capsys):
    from benchmarks import regimes
    from tests.op_determinism import enabled, op_determinism

    argv = ["--tiny", "--rounds", "1", "--feed", "dataset", "--determinism"]
    argv += ["--models", "criteo", "--regimes", "fit_2_epochs"]
    argv += ["--modes", "plain,staged", "--name", "determinism"]
    # The context turns determinism off again for the tests after this one.
    with op_determinism(note_again=False):
        assert regimes.main([*argv, "--out", str(tmp_path)]) == 0
        assert enabled()
    with open(tmp_path / "determinism.json") as f:
        results = json.load(f)
    assert results["config"]["determinism"] is True
    regime = results["models"]["criteo"]["regimes"]["fit_2_epochs"]
    # No expert mode, no staged/expert ratio to check.
    assert "expert_target" not in regime
    assert "op determinism on" in capsys.readouterr().out


class _Recorder:
    """A model's `fit`/`evaluate`/`predict` that record what they get."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, method):
        return lambda **kwargs: self.calls.append((method, kwargs))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "regime", ["validation", "fit_epochs1_x4", "evaluate_x3", "predict8_x10"]
)
def test_regimes_dataset_feed_passes_one_dataset_to_every_call(regime):
    import tensorflow as tf

    from benchmarks import regimes

    spec = regimes.MODELS["tabular"]
    data = regimes.make_data(spec, regimes.TINY, regimes.REGIMES[regime].parts)
    mode = regimes.PlainMode(spec, data, feed="dataset")
    mode.model = _Recorder()
    regimes.REGIMES[regime].run(mode, regimes.StepClock(), regimes.TINY)
    calls = mode.model.calls
    assert len(calls) >= 1
    assert len({id(kwargs["x"]) for _, kwargs in calls}) == 1
    for method, kwargs in calls:
        assert isinstance(kwargs["x"], tf.data.Dataset)
        assert "y" not in kwargs and "batch_size" not in kwargs
        if method == "fit":
            # The dataset shuffles itself; Keras would warn of shuffle=True.
            assert kwargs["shuffle"] is False
    if regime == "validation":
        ((_, kwargs),) = calls
        assert isinstance(kwargs["validation_data"], tf.data.Dataset)
        assert kwargs["epochs"] == regimes.TINY.val_epochs
    # Batches of the model's batch size; predict's 8 examples in one.
    first = next(iter(calls[0][1]["x"]))
    labels = first["cp"] if regime == "predict8_x10" else first[1]
    assert labels.shape[0] == (
        regimes.TINY.predict_examples
        if regime == "predict8_x10"
        else spec.batch_size
    )


def test_regimes_targets_strict_and_within_noise():
    from benchmarks import regimes

    met = regimes.check("staged/plain", 1.05, 1.08, control=0.95)
    assert met["control_distance"] == pytest.approx(0.05)
    assert (met["met"], met["met_within_noise"]) == (False, True)
    missed = regimes.check("staged/plain", 1.05, 1.12, control=1.03)
    assert (missed["met"], missed["met_within_noise"]) == (False, False)
    alone = regimes.check("staged/plain", 1.05, 1.0, control=None)
    assert (alone["met"], alone["met_within_noise"]) == (True, None)
    # On datasets every warm regime is held to 1.05, tabular included.
    assert regimes.target("tabular", "validation", "dataset") == 1.05
    assert regimes.target("tabular", "predict8_x10", "dataset") == 1.5
    assert regimes.target("criteo", "fresh_model", "dataset") == 1.10
    assert regimes.target("tabular", "tuner_search", "dataset") == 1.10
    assert regimes.target("featurespace", "featurespace_fit", "dataset") == 1.05
    assert regimes.REGIMES["fit_2_epochs"].expert_bound == 1.10


@pytest.mark.timeout(60)
def test_regimes_skip_the_tuner_search_without_keras_tuner(monkeypatch):
    from benchmarks import regimes

    def missing():
        return "keras_tuner is not importable (test)"

    tuner = dataclasses.replace(
        regimes.REGIMES["tuner_search"], missing=missing
    )
    monkeypatch.setitem(regimes.REGIMES, "tuner_search", tuner)
    lines = []
    out = regimes.run_model(
        regimes.MODELS["dense"],
        ["tuner_search"],
        ("plain",),
        1,
        regimes.TINY,
        log=lines.append,
    )
    assert out["regimes"] == {}
    assert out["skipped"] == {"tuner_search": missing()}
    assert lines == [f"dense tuner_search: skipped, {missing()}"]
    assert "requirements/bench-extra.txt" in regimes.KERAS_TUNER_INSTALL


@pytest.mark.timeout(60)
def test_regimes_heart_table_has_the_keras_io_columns():
    from benchmarks import regimes
    from benchmarks.workloads import heart

    x, y = heart.make_heart_data(heart.TRAIN_ROWS, seed=0)
    assert (heart.TRAIN_ROWS, heart.VAL_ROWS) == (242, 61)
    assert list(x) == sorted(heart.feature_space().features)
    assert len(x) == 13 and y.dtype == "int64" and set(y) == {0, 1}
    assert x["thal"].dtype == object and x["oldpeak"].dtype == "float64"
    assert all(
        x[name].dtype == "int64"
        for name in x
        if name not in {"thal", "oldpeak"}
    )
    # Each table holds every categorical value: the example's lookups have
    # no out-of-vocabulary index.
    small, _ = heart.make_heart_data(8, seed=1)
    assert set(small["thal"]) == set(heart.THAL)
    assert set(small["cp"]) == set(range(5))
    data = regimes.make_data(
        regimes.MODELS["featurespace"],
        regimes.Sizes(),
        ("example_train", "example_val"),
    )
    assert len(data["example_train"][1]) == 242
    assert len(data["example_val"][1]) == 61


def test_regimes_cli_and_targets(capsys):
    from benchmarks import regimes

    with pytest.raises(SystemExit):
        regimes.parse_args(["--regimes", "short_epochs,long_epochs"])
    assert "long_epochs" in capsys.readouterr().err
    args = regimes.parse_args(["--quick", "--models", "dense"])
    assert (args.rounds, args.models, args.name) == (2, ["dense"], "regimes")
    # Each model's own regimes, arrays, no determinism: earlier runs' flags.
    assert (args.regimes, args.feed, args.determinism) == (
        None,
        "arrays",
        False,
    )
    args = regimes.parse_args(["--feed", "dataset", "--determinism"])
    assert (args.feed, args.determinism) == ("dataset", True)
    assert args.models == list(regimes.DEFAULT_MODELS)
    with pytest.raises(SystemExit):
        regimes.parse_args(["--feed", "generator"])
    assert regimes.target("dense", "short_epochs") == 1.05
    assert regimes.target("tabular", "short_epochs") == 1.0
    assert regimes.target("tabular", "fresh_model") == 1.10
    assert regimes.target("dense", "predict8_x10") == 1.5
    assert regimes.MODELS["criteo"].batch_size == 128
    assert regimes.MODELS["criteo"].sizes.val_train_batches == 40
    assert regimes.MODELS["criteo"].sizes.val_epochs == 3


# -- the history table and the charts (no benchmark runs) -------------------


def _times(median):
    return {"median": median, "min": 0.9 * median, "max": 1.2 * median}


def _tiny_bench_results():
    """A `benchmarks.run` results file of one workload, cut to the bone."""
    modes = {}
    for mode, call, steps in (
        ("plain", 0.004, 0.003),
        ("expert", 0.0036, 0.0028),
        ("staged", 0.002, 0.0019),
        ("compute-bound", 0.0018, 0.0017),
    ):
        modes[mode] = {
            "call_seconds_per_step": _times(call),
            "seconds_per_step": _times(steps),
            "reps": [{}, {}],
            "paired_ratio_to_plain": call / 0.004,
            "paired_ratio_to_expert": call / 0.0036,
            "paired_ratio_to_limit": call / 0.0018,
            "steps_paired_ratio_to_plain": steps / 0.003,
            "steps_paired_ratio_to_expert": steps / 0.0028,
            "steps_paired_ratio_to_limit": steps / 0.0017,
        }
    return {
        "name": "tiny",
        "created": "2026-11-25T13:16:20+0000",
        "config": {"reps": 2, "trunk": "light", "remote_read": "tf"},
        "environment": {
            "git_commit": "0123456789abcdef",
            "git_dirty": False,
            "tensorflow": "2.21.0",
            "keras": "3.15.1",
            "usable_cpus": 2,
            "gpus": 0,
        },
        "workloads": {
            "remote": {
                "info": {"steps": 4, "batch_size": 8},
                "limit": {
                    "seconds_per_step": 0.0017,
                    "call_seconds_per_step": 0.0018,
                },
                "modes": modes,
            }
        },
    }


def _tiny_regimes_results():
    """A `benchmarks.regimes --control` results file of one regime."""
    ratios = {
        "staged/plain": 1.02,
        "expert/plain": 0.6,
        "plain_again/plain": 1.01,
    }
    return {
        "created": "2026-11-25T16:07:00+0000",
        "config": {"rounds": 3},
        "environment": {
            "git_commit": "fedcba9876543210",
            "git_dirty": True,
            "tensorflow": "2.21.0",
            "keras": "3.15.1",
            "usable_cpus": 2,
            "gpus": 0,
        },
        "models": {
            "dense": {
                "regimes": {
                    "evaluate_x3": {
                        "description": "evaluate on 20 batches, 3 calls",
                        "modes": {
                            mode: {
                                "seconds_median": 0.2 * ratio,
                                "steps_seconds_median": 0.05,
                            }
                            for mode, ratio in (
                                ("plain", 1.0),
                                ("staged", 1.02),
                                ("expert", 0.6),
                                ("plain_again", 1.01),
                            )
                        },
                        "paired_ratios": {
                            name: {"seconds": value, "steps_seconds": 1.0}
                            for name, value in ratios.items()
                        },
                        "target": {"bound": 1.05, "value": 1.02, "met": True},
                    }
                }
            }
        },
    }


def test_history_rows_copy_each_familys_figures(tmp_path):
    from benchmarks import history

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_tiny_bench_results()))
    regimes = tmp_path / "regimes.json"
    regimes.write_text(json.dumps(_tiny_regimes_results()))
    switch = tmp_path / "switch.json"
    switch.write_text(
        json.dumps(
            {
                "workload": "criteo",
                "epochs": 6,
                "steps_per_epoch": 50,
                "rounds": 5,
                "median_seconds": {"plain": 3.5, "staged": 3.4},
                "ratio_to_plain": {"plain": 1.0, "staged": 0.983},
                "environment": {"git_commit": "9093412aa", "git_dirty": True},
            }
        )
    )
    overlap = tmp_path / "overlap.txt"
    overlap.write_text(
        "# python -m benchmarks.criteo_overlap 12, 2026-11-24, at 8be8295 "
        "(run 4)\n"
        f"{'mode':<34} ms/step  CPU ms/step  time / plain (paired)  speedup\n"
        f"{'plain':<34}   6.46         9.65       1.000     1.000\n"
        f"{'staged':<34}   6.01         8.65       1.008     0.993\n"
        f"{'trunk alone':<34}   4.55         7.00       0.791     1.264\n"
    )
    table = tmp_path / "history.csv"
    files = [str(p) for p in (bench, regimes, switch, overlap)]
    assert history.update(files, str(table)) == 6
    # A second pass adds nothing: a row is known by its run and medians.
    assert history.update(files, str(table)) == 0
    rows = {(r["family"], r["timing"]): r for r in history.read(str(table))}
    call = rows["bench", "call"]
    assert (call["commit"], call["date"]) == ("0123456", "2026-11-25 13:16")
    assert (call["plain"], call["staged"], call["limit"]) == (
        "4.00",
        "2.00",
        "1.80",
    )
    assert call["staged/plain"] == "0.500"
    assert call["ratios"] == "paired"
    assert call["other"] == "compute-bound 1.80 (0.450)"
    assert rows["bench", "steps"]["staged/limit"] == f"{0.0019 / 0.0017:.3f}"
    regime = rows["regimes", "call"]
    assert regime["commit"] == "fedcba9+"
    assert regime["workload"] == "dense evaluate_x3"
    assert (regime["staged/plain"], regime["control/plain"]) == (
        "1.020",
        "1.010",
    )
    assert rows["regimes", "steps"]["plain"] == "0.050"
    assert rows["epoch_switch", "call"]["staged/plain"] == "0.983"
    overlap_row = rows["criteo_overlap", "steps"]
    assert (overlap_row["commit"], overlap_row["rounds"]) == ("8be8295", "12")
    assert overlap_row["staged/plain"] == "1.008"
    assert overlap_row["other"] == "trunk alone 4.55 (0.791)"


@pytest.mark.parametrize(
    "results", [_tiny_bench_results, _tiny_regimes_results]
)
def test_plots_write_a_png(tmp_path, results):
    from benchmarks import plots

    path = tmp_path / "chart.png"
    assert plots.main([_write(tmp_path, results()), str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _write(folder, results):
    path = folder / "results.json"
    path.write_text(json.dumps(results))
    return str(path)


def test_plots_reject_other_files():
    from benchmarks import plots

    with pytest.raises(ValueError, match="Received keys: \\['workload'\\]"):
        plots.plot({"workload": "criteo"}, "unused.png")


def test_history_and_plots_import_no_tensorflow():
    import subprocess
    import sys

    code = (
        "import sys, benchmarks.history, benchmarks.plots; "
        "sys.exit('tensorflow' in sys.modules or 'keras' in sys.modules)"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, timeout=60, check=False
    )
    assert done.returncode == 0


def test_importing_the_jax_benchmark_leaves_the_backend_alone():
    # It once set KERAS_BACKEND=jax on import: collected by pytest on the
    # TensorFlow backend, every later subprocess then started on JAX.
    import os

    before = os.environ.get("KERAS_BACKEND")
    from benchmarks import jax_backend

    assert os.environ.get("KERAS_BACKEND") == before
    assert jax_backend.MODE_CLASSES


@pytest.mark.long
@pytest.mark.timeout(600)
def test_first_calls_times_every_call_of_each_mode_in_its_own_process():
    from benchmarks import first_calls

    logged = []
    results = first_calls.run(1, "tabular", log=logged.append)
    assert len(logged) == len(first_calls.MODES)
    for mode in first_calls.MODES:
        (seconds,) = results["runs"][mode]
        assert set(seconds) == {*first_calls.CALLS, "total"}
        assert all(value > 0 for value in seconds.values())
        assert seconds["total"] == pytest.approx(
            sum(seconds[name] for name in first_calls.CALLS)
        )
    fit = results["summary"]["fit"]
    assert fit["paired"]["staged/plain"] == pytest.approx(
        results["runs"]["staged"][0]["fit"] / results["runs"]["plain"][0]["fit"]
    )


@pytest.mark.long
@pytest.mark.timeout(600)
def test_across_calls_times_each_call_of_both_modes():
    from benchmarks import across_calls

    logged = []
    results = across_calls.run("tabular", 4, log=logged.append)
    assert len(logged) == 1 and "every call staged" in logged[0]
    for mode in ("plain", "staged"):
        assert len(results[mode]) == 4
        assert all(value > 0 for value in results[mode])
    summary = results["summary"]
    warm = across_calls.WARM_UP
    assert summary["staged_ms"] == pytest.approx(
        1000 * statistics.median(results["staged"][warm:])
    )
    logged.clear()
    results = across_calls.run(
        "tabular", 3, log=logged.append, method="predict"
    )
    assert "predict x3" in logged[0]
    assert all(len(results[mode]) == 3 for mode in ("plain", "staged"))
    logged.clear()
    results = across_calls.run(
        "tabular", 3, log=logged.append, method="fit", new_datasets=True
    )
    assert "fit x3 on a new dataset each" in logged[0]
    assert all(len(results[mode]) == 3 for mode in ("plain", "staged"))


@pytest.mark.long
@pytest.mark.timeout(600)
def test_determinism_verdict_compares_both_ways_of_measuring(tmp_path):
    from benchmarks import determinism_verdict

    determinism_verdict.RESULTS = tmp_path
    determinism_verdict.main(
        ["--rounds", "1", "--workloads", "slow_step", "--name", "t"]
    )
    runs = json.loads((tmp_path / "t.json").read_text())["slow_step"]
    for key in ("clock", "determinism"):
        [verdict] = runs[key]
        # A step that sleeps 20 ms a batch: compute-bound either way.
        assert verdict["input_bound"] is False, (key, verdict)
        assert verdict["train_seconds_per_batch"] >= 0.02, (key, verdict)
        assert 0.0 <= verdict["wait_ratio"] <= 1.0


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["evaluate", "fit-validation"])
def test_strategy_calls_times_both_modes_on_two_replicas(method):
    # In a subprocess: it splits the CPU into two logical devices.
    script = (
        "import json\n"
        "from benchmarks import strategy_calls\n"
        f"r = strategy_calls.run({method!r}, 3, log=lambda line: None)\n"
        "print(json.dumps(r))\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    # With faulthandler, an abort (as at a helper thread's exit inside
    # TensorFlow, tests/reliability/exit_test.py) prints every Python
    # thread's stack.
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for mode in ("plain", "staged", "plain_again"):
        assert len(results[mode]) == 3
        assert all(value > 0 for value in results[mode])
    assert results["summary"]["paired_staged/plain"] > 0
    assert results["summary"]["paired_plain_again/plain"] > 0


@pytest.mark.long
@pytest.mark.timeout(600)
def test_service_calls_times_both_modes_on_a_local_service():
    from benchmarks import service_calls

    lines = []
    results = service_calls.run("evaluate", 3, log=lines.append)
    assert len(lines) == 1 and "tf.data service" in lines[0]
    for mode in ("plain", "staged"):
        assert len(results[mode]) == 3
        assert all(value > 0 for value in results[mode])
    assert results["summary"]["paired_staged/plain"] > 0
