"""The test helpers that report on hangs."""

import gc
import threading

import pytest

from tests.helpers import HANG_REPORTS, GcClock, busiest_threads, record_hang


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
    # The spinner first (Python threads share the process's OS name).
    busiest = int(lines[1].rsplit(": ", 1)[1].split("%")[0])
    assert busiest >= 50, lines
