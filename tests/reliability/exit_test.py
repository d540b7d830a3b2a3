"""A process's exit waits for keras_stage's helper threads still in a call.

A daemon thread still inside a TensorFlow call when the interpreter
finalizes is ended as it takes the interpreter lock back; ended inside a
C++ destructor, that aborts the process ("terminate called after throwing
...", exit code -6) after the script's last line ran. Each child here ends
as a fresh interpreter does (`interpreter_exit`), with a helper thread
still busy when its script's last line has run.
"""

import pytest

from tests.helpers import run_forked

_BUSY_HELPER = """
import time
from keras_stage.data import runner

caller = runner._CallThread("keras_stage-exit-test")
caller.stalled = {stalled}

def call():
    time.sleep({seconds})
    print("call ended", flush=True)

caller.submit(call, ())
print("script ended", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "stalled, seconds, printed",
    [
        # A helper still in its call is waited for.
        (False, 0.5, ["script ended", "call ended"]),
        # One a timeout left blocked on a source that never answers is
        # not: waiting for it would hang the exit.
        (True, 600, ["script ended"]),
    ],
)
def test_the_exit_waits_for_a_busy_helper_thread_unless_stalled(
    stalled, seconds, printed
):
    done = run_forked(
        ["-c"],
        code=_BUSY_HELPER.format(stalled=stalled, seconds=seconds),
        timeout=60,
        interpreter_exit=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == printed


_LATE_RELEASE = """
import atexit, threading, time

class Pipeline:
    def __del__(self):
        time.sleep(0.5)
        print("dropped in", threading.current_thread().name, flush=True)

def late():
    from keras_stage.data import epochs
    held = [Pipeline()]
    epochs.release(held)

# Registered before the module's own exit hooks, so run after them (as
# `weakref.finalize`'s hook is when something used it before keras_stage
# was imported): a release the exit's wait has already passed.
atexit.register(late)
from keras_stage.data import epochs  # noqa: F401
print("script ended", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_release_after_the_exits_wait_is_made_in_the_exiting_thread():
    done = run_forked(
        ["-c"], code=_LATE_RELEASE, timeout=60, interpreter_exit=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines == ["script ended", "dropped in MainThread"]
