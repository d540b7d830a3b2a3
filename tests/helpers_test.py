"""The test helpers that wait for other threads and report on hangs."""

import gc
import pathlib
import subprocess
import sys
import threading
import time
import types

import pytest

from tests import helpers
from tests.helpers import (
    HANG_REPORTS,
    GcClock,
    busiest_threads,
    record_hang,
    run_forked,
    run_forked_together,
    wait_until,
)


@pytest.mark.timeout(30)
def test_hang_report_ends_with_the_stage_threads_innermost_frames():
    release = threading.Event()

    def blocked_call():
        release.wait(20)

    thread = threading.Thread(target=blocked_call, name="keras_stage-hung")
    thread.start()
    try:
        record_hang("a test")
        report = HANG_REPORTS.pop()
    finally:
        release.set()
        thread.join(5)
    lines = report.splitlines()
    assert lines[0] == "a test: threads when the watchdog fired"
    assert "  thread keras_stage-hung:" in lines
    # The stage's thread is last; its innermost frames end the report.
    last = lines.index("  thread keras_stage-hung:")
    assert not any(line.startswith("  thread") for line in lines[last + 1 :])
    assert any("blocked_call" in line for line in lines[last + 1 :])
    assert lines[-1].endswith(" wait")


def test_gc_clock_times_the_collections_while_it_runs():
    with GcClock() as clock:
        gc.collect()
        gc.collect()
    assert clock.collections == 2
    assert clock.seconds > 0
    gc.collect()  # stopped: no longer counted
    assert clock.collections == 2


@pytest.mark.timeout(30)
def test_busiest_threads_name_a_spinning_thread():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, name="spinner")
    thread.start()
    try:
        lines = busiest_threads(seconds=0.5, count=3)
    finally:
        stop.set()
        thread.join(5)
    assert lines[0].startswith("  busiest threads over 0.5 s")
    assert len(lines) == 4
    # The spinner first (Python threads share the process's OS name). On
    # a loaded machine it gets only a share of a core; the process's other
    # threads idle, so a tenth of a core still singles it out.
    busiest = int(lines[1].rsplit(": ", 1)[1].split("%")[0])
    assert busiest >= 10, lines


@pytest.mark.timeout(30)
def test_wait_until_returns_once_another_thread_made_it_true():
    done = threading.Event()
    timer = threading.Timer(0.1, done.set)
    timer.start()
    try:
        assert wait_until(done.is_set, timeout=20) is True
    finally:
        timer.cancel()


def test_wait_until_gives_the_false_value_after_its_deadline():
    started = time.monotonic()
    assert wait_until(lambda: [], timeout=0.2) == []
    assert time.monotonic() - started >= 0.2


@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_hang_report_reaches_the_summary_from_an_xdist_worker(tmp_path):
    # `make test` runs the suite in pytest-xdist workers: the report a
    # test's watchdog takes there must still end the run's output.
    root = pathlib.Path(__file__).resolve().parent.parent
    (tmp_path / "hang_test.py").write_text(
        "from tests.helpers import record_hang\n"
        "def test_hangs():\n"
        "    record_hang('the worker test')\n"
        "    raise AssertionError('hung')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-n", "1"]
        + ["-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
        + ["-o", "addopts=", str(tmp_path / "hang_test.py")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    tail = done.stdout[done.stdout.rindex("hang watchdog") :]
    assert "the worker test: threads when the watchdog fired" in tail


@pytest.mark.timeout(120)
def test_run_forked_runs_code_and_modules_as_fresh_processes(tmp_path):
    # No keras_stage module and no TensorFlow device yet: the child starts
    # as `python -c` would after TensorFlow's import.
    code = (
        "import sys, warnings\n"
        "import tensorflow as tf\n"
        "mine = [m for m in sys.modules if m.startswith('keras_stage')]\n"
        "print(sys.argv, mine)\n"
        "cpu, = tf.config.list_physical_devices('CPU')\n"
        "tf.config.set_logical_device_configuration(\n"
        "    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "print(len(tf.config.list_logical_devices('CPU')))\n"
        "import atexit; atexit.register(lambda: print('at exit'))\n"
        "print('to stderr', file=sys.stderr)\n"
        "raise SystemExit(3)\n"
    )
    done = run_forked(["-c", "x"], code=code, env={"ONLY_HERE": "1"})
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["['-c', 'x'] []", "2", "at exit"]
    assert done.stderr.endswith("to stderr\n")
    # An uncaught error: its traceback, exit status 1; each child starts
    # from the forking process, not from the one before.
    done = run_forked(
        ["-c"],
        code="import os; print(os.environ.get('ONLY_HERE')); 1 / 0",
        cwd=str(tmp_path),
    )
    assert done.returncode == 1
    assert done.stdout == "None\n"
    assert "ZeroDivisionError" in done.stderr
    # A module, as `python -m`; killed by a signal, a negative status.
    (tmp_path / "forked_module.py").write_text(
        "import os, sys\nprint(sys.argv[1:])\nos.kill(os.getpid(), 9)\n"
    )
    done = run_forked(["-m", "a"], module="forked_module", cwd=str(tmp_path))
    assert done.stdout == "['a']\n" and done.returncode == -9


@pytest.mark.timeout(120)
def test_run_forked_with_interpreter_exit_tears_down_the_modules():
    # A finalizer that fails in the modules' teardown: reported only when
    # the child exits as an interpreter does, not by the usual quick end.
    code = (
        "class Failing:\n"
        "    def __del__(self):\n"
        "        raise RuntimeError('in the teardown')\n"
        "kept = Failing()\n"
        "print('ended')\n"
    )
    quick = run_forked(["-c"], code=code)
    assert (quick.returncode, quick.stdout) == (0, "ended\n")
    assert "in the teardown" not in quick.stderr
    whole = run_forked(["-c"], code=code, interpreter_exit=True)
    assert (whole.returncode, whole.stdout) == (0, "ended\n")
    assert "Exception ignored" in whole.stderr
    assert "in the teardown" in whole.stderr
    # Its exit status is the code's, and the forking process serves on.
    done = run_forked(["-c"], code="raise SystemExit(5)", interpreter_exit=True)
    assert done.returncode == 5
    assert run_forked(["-c"], code="print(1)").stdout == "1\n"


@pytest.mark.timeout(120)
def test_run_forked_kills_a_child_past_its_timeout():
    # A child's process group is its forking process's.
    code = "import os, time; print(os.getpgrp(), flush=True); time.sleep(60)"
    forking = int(
        run_forked(["-c"], code="import os; print(os.getpgrp())").stdout
    )
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_forked(["-c"], code=code, timeout=1)
    assert time.monotonic() - started < 30
    # The same forking process serves the next call.
    done = run_forked(["-c"], code="import os; print(os.getpgrp())")
    assert int(done.stdout) == forking


@pytest.mark.timeout(120)
def test_run_forked_answers_when_it_reads_after_a_quick_child_ended(
    monkeypatch,
):
    # A loaded machine: the caller reads the forking process's answers only
    # after the child has ended, so both of them (the pid and the exit
    # code) are on the pipe at once. A buffered readline took both and the
    # next select waited for the second until the timeout (a 120 s hang).
    run_forked(["-c"], code="pass")  # the forking process, TF imported
    real_select = helpers.select.select

    def late_select(*args):
        time.sleep(0.5)
        return real_select(*args)

    monkeypatch.setattr(
        helpers, "select", types.SimpleNamespace(select=late_select)
    )
    started = time.monotonic()
    done = run_forked(["-c"], code="print(1)", timeout=20)
    assert done.stdout == "1\n"
    assert time.monotonic() - started < 15


@pytest.mark.timeout(120)
def test_run_forked_together_runs_its_children_side_by_side(tmp_path):
    # Each child waits for the other's file: they run at the same time.
    code = (
        "import os, sys, time\n"
        "me, other = sys.argv[1:3]\n"
        "open(me, 'w').close()\n"
        "deadline = time.monotonic() + 30\n"
        "while not os.path.exists(other) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(os.path.exists(other)); raise SystemExit(int(sys.argv[3]))\n"
    )
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    done = run_forked_together(
        [
            dict(argv=["-c", a, b, "0"], code=code),
            dict(argv=["-c", b, a, "4"], code=code),
        ]
    )
    assert [d.stdout for d in done] == ["True\n", "True\n"]
    assert [d.returncode for d in done] == [0, 4]


@pytest.mark.parametrize("kind", ["layer", "lambda"])
def test_a_layer_of_tensorflow_ops_is_staged_on_tensorflow_too(kind):
    # The check tests/jax and tests/torch run on their backends.
    helpers.check_a_tensorflow_ops_layer_is_staged(kind)
