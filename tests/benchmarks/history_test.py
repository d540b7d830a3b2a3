"""The kept results and their history: small, and every figure in the table.

`benchmarks/results/` keeps the latest result of each benchmark and
`history.csv`, which holds the figures of every run, the deleted ones too
(docs/benchmarks.md renders it). These tests read files only: no benchmark
runs, no TensorFlow.
"""

import json
import pathlib

from benchmarks import history

RESULTS = pathlib.Path(history.RESULTS_DIR)
# The JSON kept under benchmarks/results/, in lines: the latest result of
# each benchmark fits well under it; a run's older results go once their
# rows are in history.csv.
MAX_JSON_LINES = 40_000


def test_the_kept_results_stay_small():
    files = sorted(RESULTS.rglob("*.json"))
    lines = {
        path.relative_to(RESULTS).as_posix(): len(path.read_text().splitlines())
        for path in files
    }
    total = sum(lines.values())
    largest = sorted(lines.items(), key=lambda item: -item[1])[:5]
    assert total <= MAX_JSON_LINES, (
        f"benchmarks/results/ holds {total} lines of JSON, more than "
        f"{MAX_JSON_LINES}. Run `python -m benchmarks.history` and delete "
        f"the older results of each benchmark (largest: {largest})."
    )


def test_every_kept_result_is_in_the_history():
    known = {tuple(row[k] for k in history.KEY) for row in history.read()}
    missing = []
    for path in history.result_files():
        for row in history.rows_of(path):
            row = {k: str(row.get(k, "")) for k in history.COLUMNS}
            if tuple(row[k] for k in history.KEY) not in known:
                missing.append((row["run"], row["workload"], row["timing"]))
    assert not missing, (
        f"Results whose rows are not in history.csv: {missing[:10]}. Run "
        "`python -m benchmarks.history --docs`."
    )


def test_every_kept_result_gives_rows():
    # A result no reader understands would lose its figures when deleted.
    silent = [
        path for path in history.result_files() if not history.rows_of(path)
    ]
    assert not silent, f"No history rows from: {silent}"


def _calls(ratio_key, ratio, **medians):
    return {
        "staged": [0.5, 0.02, 0.02],
        "summary": {
            **{f"{mode}_ms": value for mode, value in medians.items()},
            f"paired_{ratio_key}": ratio,
        },
    }


def test_the_calls_families_give_a_row_per_workload(tmp_path):
    folder = tmp_path / "results" / "strategy_calls"
    folder.mkdir(parents=True)
    path = folder / "abc1234-before-fit.json"
    path.write_text(
        json.dumps(
            {
                "method": "fit",
                "fit": {
                    **_calls("staged/plain", 0.141, plain=687.7, staged=106.7),
                    "plain_again": [0.1],
                },
            }
        )
    )
    (row,) = history.calls_rows(
        json.loads(path.read_text()),
        "strategy_calls/abc1234-before-fit",
        "strategy_calls",
        "2026-11-27 20:12",
    )
    assert (row["family"], row["workload"], row["commit"]) == (
        "strategy_calls",
        "fit",
        "abc1234",
    )
    assert (row["plain"], row["staged"], row["staged/plain"]) == (
        "687.70",
        "106.70",
        "0.141",
    )
    assert (row["unit"], row["size"]) == ("ms/call", "3 calls")


def test_first_calls_scripts_give_a_row_per_script_and_part():
    results = {
        "kind": "scripts",
        "created": "2026-11-28T01:11:26+0000",
        "config": {"processes": 5},
        "environment": {"package": {"git_commit": "147ec92abc"}},
        "scripts": {
            "readme": {
                "summary": {
                    "script": {
                        "median_seconds": {"plain": 0.895, "staged": 1.225},
                        "paired": {
                            "staged/plain": 1.40,
                            "plain_again/plain": 1.01,
                        },
                    }
                }
            },
            "dcn": {"skipped": "keras-rs is not installed"},
        },
    }
    (row,) = history.first_calls_rows(results, "first_calls/scripts", "")
    assert (row["workload"], row["commit"], row["rounds"]) == (
        "readme script script",
        "147ec92",
        5,
    )
    assert (row["staged/plain"], row["control/plain"]) == ("1.400", "1.010")


def test_a_saved_regimes_log_gives_its_table():
    text = (
        "tabular validation: round 1/15  plain 0.306s  staged 0.881s\n"
        "tabular (batch 32): keras.io's structured data\n"
        "regime  whole s: plain  staged  expert  steps s: ...\n"
        "validation   0.396   0.374  -   0.263   0.279  -   0.944  1.048"
        "  -  -   0.986  1.067  <= 1\n"
        "  validation: fit, 30 batches x 4 epochs; fed a tf.data.Dataset\n"
    )
    call, steps = history.regimes_log_rows(text, "regimes/now", "2026-11-27")
    assert (call["workload"], call["rounds"], call["timing"]) == (
        "tabular validation",
        "15",
        "call",
    )
    assert (call["plain"], call["staged"], call["expert"]) == (
        "0.396",
        "0.374",
        "",
    )
    assert (call["staged/plain"], call["control/plain"]) == ("0.944", "0.986")
    assert (steps["staged/plain"], steps["control/plain"]) == (
        "1.048",
        "1.067",
    )
    assert "fed a tf.data.Dataset" in call["size"]


def _row(run, date, value, commit="", workload="criteo", timing="call"):
    row = {k: "" for k in history.COLUMNS}
    row.update(
        run=run,
        date=date,
        commit=commit,
        family="bench",
        workload=workload,
        timing=timing,
        **{"staged/plain": value},
    )
    return row


def test_the_markdown_table_gives_first_last_and_range():
    rows = [
        _row("after", "2026-11-27 10:00", "0.900", "bbbbbbb"),
        _row("aaaaaaa-before", "2026-11-27 10:00", "1.300", "aaaaaaa"),
        _row("later", "2026-11-28 09:00", "1.000", "ccccccc"),
        # Fewer runs timed the steps alone than whole calls: no line.
        _row("later", "2026-11-28 09:00", "1.100", timing="steps"),
    ]
    lines = history.markdown(rows).splitlines()
    assert len(lines) == 3
    assert lines[2] == (
        "| bench | criteo | call | staged/plain | 3 "
        "| 1.300 (2026-11-27, aaaaaaa) | 1.000 (2026-11-28, ccccccc) "
        "| 0.900 - 1.300 |"
    )


def test_jax_scale_gives_a_row_per_configuration_and_workload():
    def section(seconds):
        return {
            "epochs": 2,
            "rows": 8192,
            "batch_size": 256,
            "modes": {
                mode: {"seconds_median": value}
                for mode, value in zip(
                    ("staged", "hand", "hand2"), seconds, strict=True
                )
            },
        }

    def summary(ratio):
        return {
            "criteo": {
                "examples_per_second": {
                    "staged": 9000.0,
                    "hand": 8000.0,
                    "hand2": 8100.0,
                },
                "staged/hand": ratio,
                "hand2/hand": 1.01,
                "max_abs_weight_difference": 0.0,
            }
        }

    results = {
        "family": "jax_scale",
        "created": "2026-11-28T04:10:00+0000",
        "environment": {"git_commit": "339e002abc", "git_dirty": False},
        "config": {"rounds": 5},
        "configs": {
            "1x1": {
                "processes": [{"workloads": {"criteo": section([1, 2, 2])}}],
                "summary": summary(0.5),
            },
            "2x1": {"error": "process 1: exit -9"},
        },
    }
    (row,) = history.jax_scale_rows(results, "jax_scale")
    row = {k: str(row.get(k, "")) for k in history.COLUMNS}
    assert (row["family"], row["workload"], row["commit"]) == (
        "jax_scale",
        "criteo 1x1",
        "339e002",
    )
    assert (row["staged"], row["expert"], row["staged/expert"]) == (
        "1.000",
        "2.000",
        "0.500",
    )
    assert "control hand2/hand 1.010" in row["other"]
    assert "examples/s staged 9000, hand 8000, hand2 8100" in row["other"]
