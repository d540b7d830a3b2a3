"""`python -m benchmarks scripts`: user scripts run once in fresh processes.

The scripts are read, not run, here (their source: each differs between
plain and staged only in keras_stage's marked lines); the one run of the
command, each mode in its own process, is `long`.
"""

import ast
import io
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

from benchmarks import runner, scripts
from benchmarks.__main__ import parse
from benchmarks.modes import MODES
from benchmarks.scenarios.scripts import SCENARIO, cannot_run

FOLDER = pathlib.Path(scripts.__file__).parent
MODULES = sorted({module for module, _, _ in scripts.SCRIPTS.values()})
MARKS = {"# 1", "# 2", "# 3"}


def _cases(monkeypatch, backend, *argv):
    monkeypatch.setenv("KERAS_BACKEND", backend)
    return SCENARIO.cases(parse(["scripts", *argv])[1])


def test_the_cases_are_the_scripts_this_backend_runs(monkeypatch, capsys):
    monkeypatch.setattr(scripts, "NEEDS", {"dcn": "no_such_module_here"})
    everything = [name for name in scripts.SCRIPTS if name != "dcn"]
    assert _cases(monkeypatch, "tensorflow") == everything
    # A script that cannot run is said, not dropped silently.
    assert (
        "scripts: dcn cannot run here: no_such_module_here is not installed"
        in capsys.readouterr().out
    )
    assert _cases(monkeypatch, "torch") == [
        "featurespace_split",
        "tabular_split",
        "criteo_split",
        "recommender",
    ]
    assert _cases(monkeypatch, "jax", "--scripts", "recommender") == [
        "recommender"
    ]


def test_scripts_that_cannot_run_or_do_not_exist_are_named(monkeypatch, capsys):
    assert _cases(
        monkeypatch, "torch", "--scripts", "criteo,tabular_split"
    ) == ["tabular_split"]
    assert "criteo cannot run here: plain Keras cannot fit its string" in (
        capsys.readouterr().out
    )
    with pytest.raises(SystemExit, match=r"none of \['readme'\] can run"):
        _cases(monkeypatch, "jax", "--scripts", "readme")
    with pytest.raises(SystemExit, match=r"Unknown scripts \['nope'\]"):
        _cases(monkeypatch, "tensorflow", "--scripts", "readme,nope")
    assert cannot_run("readme", "tensorflow") is None


def test_a_trial_runs_the_script_of_its_mode(monkeypatch):
    args = parse(["scripts", "--tiny"])[1]
    ran = []

    def one_script(name, staged, tiny):
        ran.append((name, staged, tiny))
        return {"script": 1.0, "fit": 0.5}

    monkeypatch.setattr(scripts, "one_script", one_script)
    for mode in ("plain", "staged", "plain_again"):
        state = SCENARIO.setup("readme", MODES[mode], args)
        assert SCENARIO.trial(state) == {"script": 1.0, "fit": 0.5}
    # The control is plain run again.
    assert ran == [("readme", s, True) for s in (False, True, False)]
    assert SCENARIO.process == "round"
    assert SCENARIO.modes == ("plain", "staged", "plain_again")


def _run(module):
    """The `run` function of script module `module`, and its source."""
    source = (FOLDER / f"{module}.py").read_text()
    tree = ast.parse(source)
    (run,) = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "run"
    ]
    return run, source


@pytest.mark.parametrize("module", MODULES)
def test_every_script_module_has_run_with_its_options(module):
    run, _ = _run(module)
    names = [arg.arg for arg in run.args.args]
    assert names[:3] == ["staged", "timer", "tiny"], names
    for _, _, options in (
        s for s in scripts.SCRIPTS.values() if s[0] == module
    ):
        assert set(options) <= set(names[3:]), (options, names)
    calls = {
        node.func.attr
        for node in ast.walk(run)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and getattr(node.func.value, "id", None) == "timer"
    }
    assert {"start", "measure"} <= calls


def _staged_statements(module):
    """`([(line, marks)], marks)`: each statement of `run` naming `staged`
    or `keras_stage` (an `if`: its test), with the marks on its lines; and
    every mark in `run`."""
    run, source = _run(module)
    comments = {
        token.start[0]: token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    out = []
    for node in ast.walk(run):
        if isinstance(node, ast.If):
            part, end = node.test, node.test.end_lineno
        elif isinstance(node, ast.stmt) and not isinstance(
            node, (ast.With, ast.For, ast.FunctionDef)
        ):
            part, end = node, node.end_lineno
        else:
            continue
        names = {n.id for n in ast.walk(part) if isinstance(n, ast.Name)}
        if names & {"staged", "keras_stage"}:
            lines = range(node.lineno, end + 1)
            out.append((node.lineno, {comments.get(i) for i in lines} - {None}))
    lines = range(run.lineno, run.end_lineno + 1)
    return out, {comments[i] for i in lines if i in comments} & (
        MARKS | {"# split"}
    )


@pytest.mark.parametrize("module", MODULES)
def test_plain_and_staged_differ_only_in_the_marked_lines(module):
    statements, found = _staged_statements(module)
    for line, marks in statements:
        assert len(marks) == 1 and marks <= MARKS | {"# split"}, (line, marks)
    # Where plain Keras cannot fit the whole model, plain is the hand
    # split: one line chooses it; elsewhere the three lines are all.
    everywhere = any(
        s[0] == module and "jax" in s[1] for s in scripts.SCRIPTS.values()
    )
    assert ("# split" in found) == everywhere
    # A subclassed model has no `StagedInput` line (it makes its own).
    expected = MARKS - {"# 1"} if module == "recommender" else MARKS
    assert found - {"# split"} == expected


def test_the_timer_times_the_script_and_the_first_call_of_each_name():
    timer = scripts.ScriptTimer()
    with pytest.raises(RuntimeError, match="never called `timer.start"):
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


@pytest.mark.long
@pytest.mark.timeout(600)
def test_the_command_runs_every_mode_in_its_own_process():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "scripts", "--scripts", "readme"]
        + ["--rounds", "1", "--tiny", "--no-write"],
        cwd=runner.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == "readme":
            rows[cells[1]] = cells[2:]
    assert {"script", "fit", "seconds", "process"} <= set(rows)
    for metric, (plain, staged, control, ran) in rows.items():
        # Every mode has its row: plain's median, staged's and the
        # control's (plain_again's) ratios to it.
        assert float(plain) > 0 and float(staged) > 0, metric
        assert float(control.split()[0]) > 0, metric  # then its range
        assert re.fullmatch(r"\d+/\d+", ran), ran  # one staged mode
