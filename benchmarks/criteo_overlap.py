"""How far overlap can go for `criteo` on this machine.

`python -m benchmarks.criteo_overlap [REPS]` trains the `criteo` workload
eight ways in one process, interleaved, and prints the median ms/step, CPU
ms/step and the median of the per-repetition ratios to plain:

- `plain`, `expert` and `staged` (defaults), as in `make bench`;
- `trunk alone`: the trunk on cached batches (`compute-bound`), the bound
  with input that costs nothing;
- `trunk, a process parses beside`: the trunk on cached batches while
  another process parses one batch of the same lines (one thread, as the
  stage's `"auto"` settles on) for each step, started as the step starts.
  This is a stage with nothing of its own to pay: no transfer, no
  waiting, no thread in the trunk's process, so it bounds what a stage of
  this parsing at the default priority can buy here;
- `trunk, idle-class process parses`: the same with that process in
  Linux's idle scheduling class (below): the bound at the lowest priority;
- `trunk, idle-class loop beside`: the trunk alone while a busy loop runs in
  another process in Linux's idle scheduling class (`SCHED_IDLE`: it gets
  only CPU time no other thread of the machine wants);
- `staged, stage threads idle-class`: `staged` with the threads its
  iterator made moved to `SCHED_IDLE`, the lowest priority the OS offers,
  so the parsing should run only where the trunk leaves a core idle.

A 1.3x speedup over plain needs the trunk to keep nearly all of its
speed while the parsing runs beside it; the modes beside the trunk
measure how much of it the trunk keeps, with the parsing itself and with
the lowest priority there is. The figures in docs/benchmarks.md ("How
far overlap can go for `criteo`") come from it. The idle-class modes need
Linux; elsewhere they are left out with a message.
"""

import contextlib
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

import keras
import tensorflow as tf

from benchmarks.modes import (
    ComputeBoundMode,
    ExpertMode,
    PlainMode,
    StagedMode,
)
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


def parse_server(steps, batch_size, seed, idle):
    """The parsing process of `_TrunkBesideParsing` (runs there).

    Parses one batch of `criteo`'s lines, the next in order, for each `p`
    read on stdin; answers each `s` with `s` once every batch asked for
    before it is parsed; ends at the end of stdin. Writes `r` when ready.
    """
    if idle:
        # Before TensorFlow makes its thread pools (at its first op): they
        # inherit it.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    # One thread, as the stage's "auto" settles on for criteo.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    workload = CriteoWorkload(steps=steps, batch_size=batch_size, seed=seed)
    preprocess = workload.preprocess_fn()
    dataset = workload.raw_dataset().map(lambda x, y: preprocess(x)).repeat()
    batches = iter(dataset)
    next(batches)  # tracing
    if idle:  # any thread made before the class was set
        for tid in _threads():
            _to_idle_class(tid)
    out = sys.stdout.buffer
    out.write(b"r")
    out.flush()
    while command := sys.stdin.buffer.read(1):
        if command == b"p":
            next(batches)
        else:
            out.write(b"s")
            out.flush()


class _AskForOneBatch(keras.callbacks.Callback):
    """Asks the parsing process for one batch as each step starts."""

    def __init__(self):
        super().__init__()
        self.pipe = None

    def on_train_batch_begin(self, batch, logs=None):
        if self.pipe is not None:
            self.pipe.write(b"p")


class _TrunkBesideParsing(ComputeBoundMode):
    """The trunk alone while another process parses one batch per step.

    Args:
        workload: The `criteo` workload.
        idle: Whether the parsing process runs in `SCHED_IDLE`.
    """

    def __init__(self, workload, idle=False):
        super().__init__(workload)
        self.name = "compute-bound-parsing-beside" + ("-idle" if idle else "")
        self.idle = idle
        self.asker = _AskForOneBatch()
        self.lag_seconds = []
        self._process = None

    def callbacks(self):
        return super().callbacks() + [self.asker]

    def setup(self):
        super().setup()
        workload = self.workload
        code = (
            "from benchmarks.criteo_overlap import parse_server; "
            f"parse_server({workload.steps}, {workload.batch_size}, "
            f"{workload.seed}, {self.idle})"
        )
        self._process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # each request reaches the process at once
            cwd=pathlib.Path(__file__).resolve().parent.parent,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        if self._process.stdout.read(1) != b"r":
            raise RuntimeError("the parsing process did not start")

    def run(self):
        self.asker.pipe = self._process.stdin
        try:
            record = super().run()
        finally:
            self.asker.pipe = None
        # Waits until every batch asked for is parsed, so no parsing runs
        # into the next mode's time; how long it took says whether the
        # parsing kept up with the trunk (0 when it did).
        started = time.perf_counter()
        self._process.stdin.write(b"s")
        if self._process.stdout.read(1) != b"s":
            raise RuntimeError("the parsing process ended")
        self.lag_seconds.append(time.perf_counter() - started)
        return record

    def close(self):
        super().close()
        if self._process is not None:
            self._process.stdin.close()  # the end of stdin ends it
            self._process.wait(timeout=60)
            self._process.stdout.close()
            self._process = None


def main(argv=None):
    """Runs the comparison; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    reps = int(argv[0]) if argv else 12
    workload = CriteoWorkload(steps=STEPS)
    modes = {
        "plain": PlainMode(workload),
        "expert": ExpertMode(workload),
        "trunk alone": ComputeBoundMode(workload),
        "staged": StagedMode(workload),
        "trunk, a process parses beside": _TrunkBesideParsing(workload),
    }
    idle_staged = None
    if idle_class_supported():
        idle_staged = _IdleStaged(workload)
        modes["trunk, idle-class process parses"] = _TrunkBesideParsing(
            workload, idle=True
        )
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
    lags = [
        f"{name}: {max(mode.lag_seconds) * 1e3:.1f} ms"
        for name, mode in modes.items()
        if isinstance(mode, _TrunkBesideParsing)
    ]
    print(
        "parsing left when the trunk's epoch ended, the most of any "
        f"repetition (about 0 when it kept up): {'; '.join(lags)}"
    )
    if idle_staged is not None:
        print(
            "staged, stage threads idle-class: threads moved per repetition "
            f"{idle_staged.mover.moved}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
