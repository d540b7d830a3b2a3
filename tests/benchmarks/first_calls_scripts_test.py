"""`benchmarks.first_calls --scripts`: whole user scripts in fresh processes.

The summary, the modes' rotation, the child's bounds and `--package-root`'s
import path are checked here without TensorFlow; the runs of the harness
(a tiny script, each mode in its own process) are `long`.
"""

import logging
import pathlib
import shutil
import sys

import pytest

from benchmarks import first_calls, scripts
from tests.helpers import run_forked


def test_every_script_has_a_module_with_run():
    folder = pathlib.Path(scripts.__file__).parent
    modules = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    assert modules == set(scripts.SCRIPTS)
    for name in scripts.SCRIPTS:
        assert (
            "\ndef run(mode, timer, tiny=False):"
            in (folder / f"{name}.py").read_text()
        )


def test_mode_order_rotates_per_repetition():
    assert first_calls.mode_order(0) == ("plain", "staged", "plain_again")
    assert first_calls.mode_order(1) == ("staged", "plain_again", "plain")
    assert first_calls.mode_order(2) == ("plain_again", "plain", "staged")
    assert first_calls.mode_order(3) == first_calls.mode_order(0)


def _runs(seconds):
    """`{mode: [run]}` from `{mode: [{part: s} of each repetition]}`."""
    return {
        mode: [{"seconds": dict(parts)} for parts in repetitions]
        for mode, repetitions in seconds.items()
    }


def test_summary_pairs_the_processes_of_each_repetition():
    runs = _runs(
        {
            "plain": [
                {"script": 1.0, "fit": 0.5, "process": 6.0},
                {"script": 2.0, "fit": 1.0, "process": 7.0},
                {"script": 4.0, "fit": 2.0, "process": 8.0},
            ],
            "staged": [
                {"script": 1.5, "fit": 0.5, "process": 6.0},
                {"script": 2.2, "fit": 2.0, "process": 7.7},
                {"script": 4.4, "fit": 2.0, "process": 8.0},
            ],
            "plain_again": [
                {"script": 1.0, "fit": 0.5, "process": 6.6},
                {"script": 1.0, "fit": 1.0, "process": 7.0},
                {"script": 4.0, "fit": 2.0, "process": 8.0},
            ],
        }
    )
    summary = first_calls.summarize_script(runs)
    # No run timed evaluate or predict: no rows for them.
    assert list(summary) == ["script", "fit", "process"]
    assert summary["script"]["median_seconds"] == {
        "plain": 2.0,
        "staged": 2.2,
        "plain_again": 1.0,
    }
    # The median of 1.5, 1.1 and 1.1, not 2.2 / 2.0 of the medians alone.
    paired = summary["script"]["paired"]
    assert paired["staged/plain"] == pytest.approx(1.1)
    assert paired["plain_again/plain"] == pytest.approx(1.0)
    assert summary["fit"]["paired"]["staged/plain"] == pytest.approx(1.0)
    assert summary["process"]["paired"]["plain_again/plain"] == 1.0


def test_summary_leaves_out_a_part_some_runs_lack():
    runs = _runs(
        {
            mode: [{"script": 1.0, "predict": 0.1}, {"script": 1.0}]
            for mode in first_calls.MODES
        }
    )
    assert list(first_calls.summarize_script(runs)) == ["script"]


def test_table_shows_each_script_its_calls_skips_and_failures():
    runs = _runs(
        {
            mode: [{"script": 2.0, "fit": 1.0, "process": 8.0}]
            for mode in first_calls.MODES
        }
    )
    results = {
        "scripts": {
            "readme": {
                "runs": runs,
                "summary": first_calls.summarize_script(runs),
            },
            "dcn": {"skipped": "keras_rs is not importable"},
            "remote": {
                "error": "--child-script remote staged: exit status 1\n"
            },
        }
    }
    lines = first_calls.format_scripts_table(results).splitlines()
    assert lines[0].split() == [
        "script",
        "part",
        "plain",
        "s",
        "staged",
        "s",
        "staged/plain",
        "control",
        "process",
        "staged/plain",
    ]
    assert lines[1].split() == [
        "readme",
        "script",
        "2.000",
        "2.000",
        "1.00",
        "1.00",
        "1.00",
    ]
    assert lines[2].split() == ["fit", "1.000", "1.000", "1.00", "1.00"]
    assert lines[3] == f"{'dcn':20} skipped: keras_rs is not importable"
    assert lines[4].startswith(f"{'remote':20} FAILED: --child-script remote")


def test_each_decision_keras_stage_logs_is_recorded():
    logger = logging.getLogger("keras_stage")
    with first_calls.decisions_logged() as decisions:
        logger.info(
            "Model '%s': %s is staged [%s]: %s.", "m", "train", "pays", "why"
        )
        logger.info(
            "Model 'm': test runs the whole model in Keras's step, "
            "unstaged [one_batch]: one batch has nothing to overlap."
        )
        logger.info("Model 'm': something else.")
    logger.info("Model 'm': predict is staged: after, not recorded.")
    assert decisions == [
        {"phase": "train", "staged": True, "kind": "pays", "why": "why."},
        {
            "phase": "test",
            "staged": False,
            "kind": "one_batch",
            "why": "one batch has nothing to overlap.",
        },
    ]


def test_decisions_agree_says_whether_every_process_decided_alike():
    def run(*staged):
        return {
            "decisions": [
                {"phase": phase, "staged": s, "why": "-"}
                for phase, s in zip(("train", "test"), staged, strict=False)
            ]
        }

    same = first_calls.decisions_agree([run(True, False), run(True, False)])
    assert same == {
        "sequences": [[["train", True], ["test", False]]],
        "counts": [2],
        "same": True,
    }
    differ = first_calls.decisions_agree(
        [run(True, False), run(True, True), run(True, False)]
    )
    assert differ["counts"] == [2, 1] and not differ["same"]
    runs = _runs(
        {mode: [{"script": 1.0, "process": 2.0}] for mode in first_calls.MODES}
    )
    results = {
        "scripts": {
            "readme": {
                "runs": runs,
                "summary": first_calls.summarize_script(runs),
                "decisions": differ,
            }
        }
    }
    table = first_calls.format_scripts_table(results)
    assert "decisions: DIFFER" in table
    results["scripts"]["readme"]["decisions"] = same
    assert (
        "decisions: the same in all 2 staged processes "
        "(train staged, test unstaged)"
    ) in first_calls.format_scripts_table(results)


def test_script_timer_times_the_first_call_of_each_name():
    timer = scripts.ScriptTimer()
    with pytest.raises(RuntimeError, match="never called timer.start"):
        timer.stop()
    timer.start()
    with timer.measure("fit"):
        pass
    first = timer.seconds["fit"]
    with timer.measure("fit"):
        sum(range(100_000))
    seconds = timer.stop()
    assert seconds["fit"] == first
    assert seconds["script"] >= first


def test_a_script_mode_is_plain_or_staged():
    assert scripts.is_staged("staged") and not scripts.is_staged("plain")
    with pytest.raises(ValueError, match="Received: mode='plain_again'"):
        scripts.is_staged("plain_again")


def test_package_root_puts_only_its_keras_stage_first(tmp_path):
    (tmp_path / "keras_stage").mkdir()
    (tmp_path / "keras_stage" / "__init__.py").write_text("")
    # A checkout's own benchmarks must not shadow this one's.
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    with first_calls.package_path(tmp_path) as folder:
        entries = list(pathlib.Path(folder).iterdir())
        assert [entry.name for entry in entries] == ["keras_stage"]
        assert entries[0].resolve() == (tmp_path / "keras_stage").resolve()
        env = first_calls.child_environment(folder)
        assert env["PYTHONPATH"].split(":") == [folder, str(first_calls.ROOT)]
        assert env["PYTHONSAFEPATH"] == "1"
    assert not pathlib.Path(folder).exists()


def test_package_root_must_hold_keras_stage(tmp_path):
    with (
        pytest.raises(ValueError, match="Invalid value for `--package-root`"),
        first_calls.package_path(tmp_path),
    ):
        pass


def test_a_failing_child_says_which_and_why(monkeypatch):
    # The child is forked from a process that imported TensorFlow
    # (`run_forked`), not started as a fresh `python` that imports it
    # again: what is tested is what its failure is reported as. A child of
    # `subprocess.run` itself is the next test's and the harness runs'.
    def forked(command, capture_output, text, cwd, env, timeout):
        assert capture_output and text
        python, flag, module, *arguments = command
        assert (python, flag) == (sys.executable, "-m")
        return run_forked(
            ["-m", *arguments],
            module=module,
            cwd=str(cwd),
            env=env,
            timeout=timeout,
        )

    monkeypatch.setattr(first_calls.subprocess, "run", forked)
    env = first_calls.child_environment()
    with pytest.raises(first_calls.ChildFailed) as info:
        first_calls.run_child(["--child-script", "nope", "plain"], env)
    message = str(info.value)
    assert message.startswith("--child-script nope plain: exit status 1, ")
    assert "Unknown script 'nope'" in message


def test_a_child_is_killed_at_its_timeout():
    env = first_calls.child_environment()
    with pytest.raises(first_calls.ChildFailed, match="no result within"):
        first_calls.run_child(
            ["--child-script", "readme", "plain"], env, timeout=0.01
        )


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_script_runs_each_mode_in_its_own_process(tmp_path):
    logged, saved = [], []
    results = first_calls.run_scripts(
        ["readme"], 1, log=logged.append, tiny=True, save=saved.append
    )
    assert len(logged) == len(first_calls.MODES) and saved
    section = results["scripts"]["readme"]
    for mode in first_calls.MODES:
        (run,) = section["runs"][mode]
        assert set(run["seconds"]) == {"script", "fit", "process"}
        # The process holds the script, its imports and its data.
        assert run["seconds"]["process"] > (
            run["seconds"]["script"] + run["prepare_seconds"]
        )
    runs, summary = section["runs"], section["summary"]
    assert summary["fit"]["paired"]["staged/plain"] == pytest.approx(
        runs["staged"][0]["seconds"]["fit"] / runs["plain"][0]["seconds"]["fit"]
    )
    assert pathlib.Path(section["keras_stage_file"]).is_relative_to(
        first_calls.ROOT / "keras_stage"
    )
    assert "readme" in first_calls.format_scripts_table(results)
    # The staged process logged how it decided its fit; plain ones nothing.
    assert section["decisions"]["sequences"][0][0][0] == "train"
    assert runs["plain"][0]["decisions"] == []


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_package_root_times_another_checkouts_keras_stage(tmp_path):
    shutil.copytree(
        first_calls.ROOT / "keras_stage",
        tmp_path / "keras_stage",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text(
        "raise ImportError('the checkout under test shadowed benchmarks')\n"
    )
    results = first_calls.run_scripts(
        ["readme"], 1, log=lambda line: None, tiny=True, package_root=tmp_path
    )
    section = results["scripts"]["readme"]
    assert "error" not in section, section.get("error")
    for mode in first_calls.MODES:
        (run,) = section["runs"][mode]
        assert pathlib.Path(run["keras_stage_file"]).is_relative_to(
            tmp_path.resolve()
        )
        assert pathlib.Path(run["benchmarks_file"]).is_relative_to(
            first_calls.ROOT
        )
