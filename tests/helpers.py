"""Helpers shared by the tests."""

import gc
import sys
import threading
import time
import traceback


def stage_threads():
    """The keras_stage helper threads alive now."""
    return {
        t for t in threading.enumerate() if t.name.startswith("keras_stage")
    }


# Stacks taken by a test's hang watchdog, printed again at the very end of
# the run (conftest.py): CI shows a failing run's last lines, where the
# full dump in the test's captured stderr may be cut.
HANG_REPORTS = []


def record_hang(test, frames_per_thread=12):
    """Keeps where every other thread is now: its innermost frames.

    As in a traceback, innermost last; the stage's helper threads come
    last, so a log's last lines show the innermost frames of the thread
    that runs the stage's calls.
    """
    here = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sorted(
        sys._current_frames().items(),
        key=lambda item: str(names.get(item[0])).startswith("keras_stage"),
    )
    lines = [f"{test}: threads when the watchdog fired"]
    for ident, frame in frames:
        if ident == here:
            continue
        lines.append(f"  thread {names.get(ident, ident)}:")
        for entry in traceback.extract_stack(frame)[-frames_per_thread:]:
            where = "/".join(entry.filename.split("/")[-2:])
            lines.append(f"    {where}:{entry.lineno} {entry.name}")
    HANG_REPORTS.append("\n".join(lines))


class GcClock:
    """Seconds the garbage collector ran while the clock was started.

    A slow example may be slow because collections of a process full of
    models take long, not because a stage stalled; a watchdog's report
    says which.
    """

    def __init__(self):
        self.seconds = 0.0
        self.collections = 0
        self._began = None

    def _callback(self, phase, info):
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.collections += 1
            self._began = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info):
        gc.callbacks.remove(self._callback)
