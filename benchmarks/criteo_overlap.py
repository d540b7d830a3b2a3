"""How far overlap can go for `criteo` on this machine.

`python -m benchmarks.criteo_overlap [REPS]` trains the `criteo` workload
five ways in one process, interleaved, and prints the median ms/step, CPU
ms/step and the median of the per-repetition ratios to plain:

- `plain` and `staged` (defaults), as in `make bench`;
- `trunk alone`: the trunk on cached batches (`compute-bound`), the bound
  with input that costs nothing;
- `trunk, idle-class loop beside`: the same while a busy loop runs in
  another process in Linux's idle scheduling class (`SCHED_IDLE`: it gets
  only CPU time no other thread of the machine wants);
- `staged, stage threads idle-class`: `staged` with the threads its
  iterator made moved to `SCHED_IDLE`, the lowest priority the OS offers,
  so the parsing should run only where the trunk leaves a core idle.

A 1.3x speedup over plain needs the trunk to keep nearly all of its
speed while the parsing runs beside it; the last two modes measure how
much of it the trunk keeps when the work beside it has the lowest
priority there is. The figures in docs/benchmarks.md ("How far overlap can
go for `criteo`") come from it. The idle-class modes need Linux; elsewhere
they are left out with a message.
"""

import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time

import keras

from benchmarks.modes import ComputeBoundMode, PlainMode, StagedMode
from benchmarks.paired import paired_ratio, timed_rounds
from benchmarks.workloads.criteo import CriteoWorkload

STEPS = 100

_IDLE_LOOP = (
    "import os\n"
    "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "while True:\n"
    "    pass\n"
)


def idle_class_supported():
    """Whether threads can be moved to `SCHED_IDLE` here (Linux)."""
    return hasattr(os, "SCHED_IDLE") and os.path.isdir("/proc/self/task")


def _threads():
    """Native ids of this process's threads."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _python_threads():
    """Native ids of the threads Python runs (the step may run on one)."""
    return {thread.native_id for thread in threading.enumerate()}


def _to_idle_class(tid):
    """Moves thread `tid` to `SCHED_IDLE`; False if it has ended."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (ProcessLookupError, PermissionError):
        return False
    return True


@contextlib.contextmanager
def idle_class_loop():
    """A busy loop in another process, in the idle scheduling class."""
    loop = subprocess.Popen([sys.executable, "-c", _IDLE_LOOP])
    try:
        time.sleep(0.2)  # started and spinning before the timing begins
        yield
    finally:
        loop.kill()
        loop.wait()


class _IdleStageThreads(keras.callbacks.Callback):
    """Moves the threads made for an epoch's iterator to `SCHED_IDLE`.

    The threads that appear between the start of the epoch and the end of
    its second batch are the stage iterator's (its private pool, made with
    the iterator; its map's and buffer's, made at the first fetch): the
    rest of the process's threads exist by then. Armed only after the
    warm-up, when the trunk's own thread pools have been made; Python's
    threads (the stage's helper thread may run the step) are never moved.
    """

    def __init__(self):
        super().__init__()
        self.armed = False
        self.moved = []
        self._before = set()

    def on_epoch_begin(self, epoch, logs=None):
        self._before = _threads()

    def on_train_batch_end(self, batch, logs=None):
        if self.armed and batch == 1:
            new = _threads() - self._before - _python_threads()
            self.moved.append(sum(_to_idle_class(tid) for tid in new))


class _IdleStaged(StagedMode):
    """`staged` with its iterator's threads in the idle class."""

    def __init__(self, workload):
        super().__init__(workload, name="staged-idle-class")
        self.mover = _IdleStageThreads()
        self._runs = 0

    def callbacks(self):
        return super().callbacks() + [self.mover]

    def run(self):
        self.mover.armed = self._runs > 0  # not during the warm-up
        self._runs += 1
        return super().run()


class _TrunkBesideIdleLoop(ComputeBoundMode):
    """The trunk alone, with an idle-class busy loop in another process."""

    name = "compute-bound-idle-loop"

    def run(self):
        with idle_class_loop():
            return super().run()


def main(argv=None):
    """Runs the comparison; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    reps = int(argv[0]) if argv else 12
    workload = CriteoWorkload(steps=STEPS)
    modes = {
        "plain": PlainMode(workload),
        "trunk alone": ComputeBoundMode(workload),
        "staged": StagedMode(workload),
    }
    idle_staged = None
    if idle_class_supported():
        idle_staged = _IdleStaged(workload)
        modes["trunk, idle-class loop beside"] = _TrunkBesideIdleLoop(workload)
        modes["staged, stage threads idle-class"] = idle_staged
    else:
        print("no SCHED_IDLE here (Linux only): idle-class modes left out")
    _, seconds, cpu = timed_rounds(modes, reps)
    workload.close()
    print(
        f"{'mode':34} ms/step  CPU ms/step  time / plain (paired)  "
        "speedup over plain (paired)"
    )
    for name in modes:
        ratio = paired_ratio(seconds[name], seconds["plain"])
        speedup = paired_ratio(seconds["plain"], seconds[name])
        print(
            f"{name:34} {statistics.median(seconds[name]) * 1e3:7.2f}  "
            f"{statistics.median(cpu[name]) * 1e3:11.2f}  "
            f"{ratio:20.3f}  {speedup:27.3f}"
        )
    if idle_staged is not None:
        print(
            "staged, stage threads idle-class: threads moved per repetition "
            f"{idle_staged.mover.moved}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
