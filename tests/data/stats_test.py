"""Tests of `StageStats`: its two sides of a fetch, and life without a clock.

A step's fetch is accumulated in its graph or, reported, in Python: both
give the same figures. TensorFlow refuses `tf.timestamp` once op
determinism is on; the stats decide when a graph is traced whether it may
take one, count without it, and report the times they could not take as
NaN.
"""

import logging
import math

import pytest
import tensorflow as tf

from keras_stage.data import stats as stats_module
from keras_stage.data.stats import NO_CLOCK_NOTE, StageStats, clock_allowed
from tests.helpers import counters_with
from tests.op_determinism import enabled, op_determinism

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def determinism():
    with op_determinism():
        yield


def _step(stats, accumulate=False):
    """A consumer's step recording its fetch of one element, compiled."""

    @tf.function
    def step(element):
        fetch = stats.record_fetch(element, accumulate=accumulate)
        end = stats.record_step_end(element * 2)
        if accumulate:
            return end
        return stats.report(fetch, end)

    return step


def _produce(stats, elements):
    """Counts `elements` finished, as the stage's map does."""
    gate = tf.Variable(True)

    @tf.function
    def produce():
        stats.count_produced(None, gate)

    for _ in range(elements):
        produce()


# A consumer's fetches: (start mark, seconds from it to the batch, finished
# elements not consumed when it arrived). A negative mark is an epoch's
# first fetch; one unconsumed element is the batch itself (the buffer was
# empty: the fetch waited); more, and it was ready.
_FETCHES = [
    (-100.0, 5.0, 1),
    (200.0, 0.002, 3),
    (300.0, 0.004, 2),
    (400.0, 0.050, 1),
    (500.0, 0.001, 1),
    (600.0, 0.003, 4),
    (700.0, 0.030, 1),
]


def test_reported_fetches_add_up_like_fetches_recorded_in_the_graph():
    # keras_stage's step hands each fetch's facts to Python (`report`,
    # `take_report`), other steps accumulate them in the graph: both must
    # give the same wait, buffer fill and baseline.
    in_graph = StageStats("in_graph", track_peak=True)
    reported = StageStats("reported", track_peak=True)

    @tf.function
    def record(stats, marked, took, counters):
        fetch = (marked, tf.abs(marked) + took, counters)
        stats.accumulate(fetch, count=True)

    for marked, took, unconsumed in _FETCHES:
        counters = counters_with(in_graph, unconsumed)
        in_graph._counters.assign(counters)
        record(
            in_graph,
            tf.constant(marked, tf.float64),
            tf.constant(took, tf.float64),
            tf.constant(counters),
        )
        values = [marked, abs(marked) + took, *counters, *counters]
        assert reported.take_report(values) == unconsumed
    graph, python = in_graph.snapshot(), reported.snapshot()
    # The first fetch's 5 s (tracing) is not waiting; those that found the
    # buffer empty waited what they took beyond the baseline that the
    # ready ones set (0.0478 + 0 + 0.0277 s).
    assert python["wait_seconds"] == pytest.approx(graph["wait_seconds"])
    assert 0.05 < python["wait_seconds"] < 0.08
    assert python["wait_seconds"] == pytest.approx(0.0478 + 0.02772)
    assert python["buffered_sum"] == graph["buffered_sum"] == 2 + 1 + 3
    assert python["buffered_peak"] == graph["buffered_peak"] == 3
    assert reported._baseline == pytest.approx(in_graph._counters.numpy()[6])


def test_a_fetch_timed_from_its_call_leaves_out_the_gap_before_it():
    # An input-bound stage: a batch is ready only after a long gap between
    # steps (callbacks, a slow dispatch), when the stage caught up. Timed
    # from the previous step's end, that ready fetch teaches the baseline
    # the gap, and every real wait after it looks like overhead; timed from
    # its call, the baseline is the call's own dispatch.
    def run(with_call):
        stats = StageStats("from_call" if with_call else "from_step_end")
        fetches = [
            # (previous step end, call start, arrival, other ready batches)
            (100.0, 100.300, 100.301, 1),  # ready, after a 0.3 s gap
            (101.0, 101.002, 101.022, 0),  # waited 20 ms
            (102.0, 102.002, 102.022, 0),  # waited 20 ms
        ]
        for marked, called, arrived, ready in fetches:
            counters = counters_with(stats, ready + 1)
            stats._counters.assign(counters)
            values = [marked, arrived, *counters, *counters]
            stats.take_report(values, called if with_call else None)
        return stats.snapshot()["wait_seconds"]

    assert run(with_call=True) == pytest.approx(2 * 0.019, abs=1e-6)
    assert run(with_call=False) == 0.0  # the 0.3 s gap hid both waits


def test_a_report_of_counters_only_gives_the_count():
    stats = StageStats("count_only")
    counters = counters_with(stats, 5)
    assert stats.take_report(list(counters)) == 5
    assert stats.snapshot()["wait_seconds"] == 0.0


def test_clock_allowed_follows_tensorflows_determinism_setting():
    assert enabled() is False
    assert clock_allowed() is True
    with op_determinism():
        # TensorFlow's own (private) getter says the same: if this fails,
        # TensorFlow changed what refuses the clock.
        assert enabled() is True
        assert clock_allowed() is False
    assert clock_allowed() is True


def test_stats_made_before_determinism_trace_without_a_clock(determinism):
    # The stats (and keras_stage) exist before determinism is on: the
    # choice is the trace's, not the constructor's or the import's.
    stats = StageStats("made_before")
    assert stats.fetches_timed is False
    report = _step(stats)(tf.constant(1.0)).numpy().tolist()
    assert len(report) == StageStats.REPORT_SIZE
    assert math.isnan(report[1])  # no arrival time
    stats.take_report(report)
    snapshot = stats.snapshot()
    assert snapshot["consumed"] == 1
    assert math.isnan(snapshot["wait_seconds"])
    assert stats.fetches_timed is False


def test_a_step_traced_before_determinism_keeps_its_clock_and_says_so():
    stats = StageStats("traced_before")
    step = _step(stats)
    step(tf.constant(1.0))
    assert stats.clock_refused is False
    with op_determinism():
        assert stats.clock_refused is True
        with pytest.raises(
            tf.errors.FailedPreconditionError, match="Timestamp cannot"
        ):
            step(tf.constant(1.0))
    assert stats.clock_refused is False
    assert math.isfinite(stats.snapshot()["wait_seconds"])


def test_untimed_reports_count_the_buffer_fill_but_no_wait(determinism):
    stats = StageStats("fill")
    step = _step(stats)
    stats.mark_request()
    _produce(stats, 3)
    for _ in range(2):
        stats.take_report(step(tf.constant(1.0)).numpy().tolist())
    snapshot = stats.snapshot()
    assert snapshot["consumed"] == 2
    # The first fetch saw two others buffered, the second one.
    assert snapshot["buffered_sum"] == 3
    assert math.isnan(snapshot["wait_seconds"])


def test_steps_accumulating_in_the_graph_run_without_a_clock(determinism):
    # Steps running several batches per call accumulate in the graph.
    stats = StageStats("accumulating", track_peak=True)
    stats.mark_request()
    _produce(stats, 2)
    step = _step(stats, accumulate=True)
    for _ in range(2):
        step(tf.constant(1.0))
    snapshot = stats.snapshot()
    assert snapshot["consumed"] == 2
    assert snapshot["buffered_sum"] == 1
    assert snapshot["buffered_peak"] == 1
    assert math.isnan(snapshot["wait_seconds"])


def test_waits_timed_on_the_host_are_measured(determinism):
    stats = StageStats("host")
    _step(stats)  # traced lazily: nothing yet
    stats.begin_wait()  # a pipeline's marker, traced without a clock
    assert stats.fetches_timed is False
    assert math.isnan(stats.snapshot()["wait_seconds"])
    stats.record_host_fetch(0.25)
    snapshot = stats.snapshot()
    assert snapshot["wait_seconds"] == pytest.approx(0.25)
    assert snapshot["consumed"] == 1


def test_busy_time_is_not_measured_without_a_clock(determinism):
    stats = StageStats("busy")
    assert stats.start_busy() is None
    assert math.isnan(stats.snapshot()["busy_seconds"])


def test_the_note_is_logged_once_per_process(determinism, caplog):
    caplog.set_level(logging.WARNING, logger="keras_stage")
    for name in ("first", "second"):
        stats = StageStats(name)
        stats.start_busy()
        _step(stats)(tf.constant(1.0))
    notes = [r for r in caplog.records if r.getMessage() == NO_CLOCK_NOTE]
    assert len(notes) == 1
    assert stats_module._no_clock_noted is True
    assert "\n" not in NO_CLOCK_NOTE
