"""The epoch figures and verdict of a stage that could not time itself.

Under op determinism the stage's snapshots report its wait and busy
seconds as NaN (not measured). The epoch's statistics carry them as None,
and the verdict says what was measured and advises nothing, rather than
calling a 0.0 wait "compute-bound".
"""

import math

from keras_stage.callbacks.prefetch_callback import epoch_statistics, verdict
from keras_stage.data import StageOptions


def _snapshot(consumed, wait, busy, buffered=0):
    return {
        "produced": consumed,
        "consumed": consumed,
        "skipped": 0,
        "skipped_messages": [],
        "wait_seconds": wait,
        "busy_seconds": busy,
        "buffered_sum": buffered,
        "buffered_peak": 2,
    }


OPTIONS = StageOptions(name="untimed", capacity=4, num_threads=2)


def test_unmeasured_times_are_none_not_zero():
    stats = epoch_statistics(
        _snapshot(0, math.nan, math.nan),
        _snapshot(10, math.nan, math.nan, buffered=10),
        2.0,
        OPTIONS,
    )
    assert stats["wait_seconds"] is None
    assert stats["busy_seconds"] is None
    assert stats["wait_ratio"] is None
    # Counted without a clock: still measured.
    assert stats["consumed"] == 10
    assert stats["buffer_fill"] == 0.25


def test_a_snapshot_timed_before_and_not_after_is_not_measured():
    stats = epoch_statistics(
        _snapshot(0, 0.5, 0.2), _snapshot(10, math.nan, 0.4), 2.0, OPTIONS
    )
    assert stats["wait_ratio"] is None
    assert stats["busy_seconds"] == 0.2


def test_the_verdict_of_an_untimed_epoch_says_the_wait_was_not_measured():
    stats = epoch_statistics(
        _snapshot(0, math.nan, math.nan),
        _snapshot(10, math.nan, math.nan, buffered=10),
        2.0,
        OPTIONS,
    )
    result = verdict(stats, OPTIONS)
    assert result["message"] == (
        "Stage 'untimed': the training step's wait for data was not "
        "measured; per batch, the stage delivered one every 200.0 ms and "
        "its buffer was 25% full. Op determinism is on, and TensorFlow "
        "forbids the clock that times the wait and the staged computation"
        ": no advice on num_threads or capacity."
    )
    for key in (
        "input_bound",
        "source_bound",
        "wait_ratio",
        "prepare_seconds_per_batch",
        "train_seconds_per_batch",
        "suggested_num_threads",
        "suggested_capacity",
    ):
        assert result[key] is None, key
    assert result["delivery_seconds_per_batch"] == 0.2
    assert result["buffer_fill"] == 0.25


def test_a_wait_timed_on_the_host_is_reported_without_advice():
    # An eager consumer times its fetches on the host; the staged
    # computation still had no clock.
    stats = epoch_statistics(
        _snapshot(0, 0.0, math.nan),
        _snapshot(10, 0.5, math.nan),
        2.0,
        OPTIONS,
    )
    result = verdict(stats, OPTIONS)
    assert result["wait_ratio"] == 0.25
    assert result["input_bound"] is None
    assert result["message"].startswith(
        "Stage 'untimed': the training step waited 25% of the epoch for data"
    )
    assert "the clock that times the staged computation:" in (result["message"])
