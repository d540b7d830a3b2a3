"""Tests of the stage's Python boundary: `StageRunner` and error annotation."""

import threading

import pytest
import tensorflow as tf

from keras_stage.data import StageOptions, StageTimeoutError
from keras_stage.data import runner as runner_module
from keras_stage.data.errors import annotate
from keras_stage.data.runner import EndOfData, SkipElement, StageRunner
from keras_stage.data.stats import StageStats
from tests.helpers import counters_with, run_forked


def _runner(**options):
    options = StageOptions(name="unit", **options)
    return StageRunner(options, StageStats(options.name))


def _raise(error):
    raise error


def _csv_error(text="Field 0 in record 0 is not a valid int32: x"):
    return tf.errors.InvalidArgumentError(None, None, text)


# -- annotate ----------------------------------------------------------------


@pytest.mark.parametrize(
    "error_type",
    [
        tf.errors.InvalidArgumentError,
        tf.errors.NotFoundError,
        tf.errors.DataLossError,
        tf.errors.UnknownError,
    ],
)
def test_annotate_keeps_type_and_message(error_type):
    error = error_type(None, None, "original text")
    annotated = annotate(error, "parse", hint="check the shards")
    assert type(annotated) is error_type
    assert annotated.message.startswith("original text")
    assert "raised inside stage 'parse': check the shards" in annotated.message


def test_annotate_marks_once():
    once = annotate(_csv_error(), "parse")
    assert annotate(once, "parse") is once
    assert once.message.count("raised inside stage") == 1


def test_annotate_leaves_errors_without_message_alone():
    error = ValueError("plain python")
    assert annotate(error, "parse") is error


def test_stage_timeout_error_is_a_deadline_error():
    error = StageTimeoutError("too slow")
    assert isinstance(error, tf.errors.DeadlineExceededError)
    assert error.message == "too slow"
    assert error.error_code == tf.errors.DEADLINE_EXCEEDED


# -- policies ----------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout", [None, 5.0])
def test_call_returns_the_value(timeout):
    runner = _runner(timeout=timeout)
    try:
        assert runner.call(lambda a, b: a + b, 2, 3) == 5
    finally:
        assert runner.close() is True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout", [None, 5.0])
def test_ignored_error_skips_and_is_recorded(timeout):
    runner = _runner(
        timeout=timeout,
        ignored_exception_types=(tf.errors.InvalidArgumentError,),
    )
    try:
        for _ in range(7):
            with pytest.raises(SkipElement):
                runner.call(_raise, _csv_error())
        snap = runner.stats.snapshot()
        assert snap["skipped"] == 7
        # Messages are capped, the count is not.
        assert 1 <= len(snap["skipped_messages"]) < 7
        assert snap["skipped_messages"][0] == (
            "InvalidArgumentError: Field 0 in record 0 is not a valid int32: x"
        )
    finally:
        runner.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout", [None, 5.0])
def test_closed_error_and_stop_iteration_end_the_data(timeout):
    runner = _runner(
        timeout=timeout, closed_exception_types=(tf.errors.DataLossError,)
    )
    try:
        with pytest.raises(EndOfData):
            runner.call(_raise, tf.errors.DataLossError(None, None, "eof"))
        with pytest.raises(EndOfData):
            runner.call(next, iter(()))
    finally:
        runner.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout", [None, 5.0])
def test_other_errors_keep_their_type_with_the_stage_named(timeout):
    runner = _runner(
        timeout=timeout,
        ignored_exception_types=(tf.errors.InvalidArgumentError,),
    )
    try:
        with pytest.raises(tf.errors.NotFoundError) as info:
            runner.call(_raise, tf.errors.NotFoundError(None, None, "no file"))
        assert info.value.message.startswith("no file")
        assert "raised inside stage 'unit'" in info.value.message
        with pytest.raises(KeyError, match="plain"):
            runner.call(_raise, KeyError("plain"))
    finally:
        runner.close()


@pytest.mark.timeout(30)
def test_without_timeout_calls_run_in_the_caller_thread():
    runner = _runner(timeout=None)
    assert runner.call(threading.get_ident) == threading.get_ident()
    assert runner.close() is True


@pytest.mark.timeout(30)
def test_with_timeout_calls_run_in_one_named_helper_thread():
    runner = _runner(timeout=5.0)
    names = {runner.call(lambda: threading.current_thread().name)}
    names.add(runner.call(lambda: threading.current_thread().name))
    assert names == {"keras_stage-unit"}
    assert runner.close() is True
    assert not [
        t for t in threading.enumerate() if t.name == "keras_stage-unit"
    ]


@pytest.mark.timeout(30)
def test_slow_call_outside_an_input_wait_never_times_out():
    # Only the consumer's wait for input counts against the timeout; a call
    # that is not waiting on the pipeline (a training step) may take long.
    runner = _runner(timeout=0.2)
    done = threading.Event()
    try:
        assert runner.call(lambda: done.wait(1.2) or "finished") == "finished"
    finally:
        assert runner.close() is True


# A call the timeout abandoned on a source that never answers; the process
# then ends as a user's script would (see `_CallThread`).
_ABANDONED_AT_EXIT = """
import threading
from keras_stage.data.errors import StageTimeoutError
from keras_stage.data.options import StageOptions
from keras_stage.data.runner import StageRunner
from keras_stage.data.stats import StageStats
from tests.helpers import counters_with

options = StageOptions(name="at_exit", timeout=0.5)
stats = StageStats(options.name)
runner = StageRunner(options, stats)

def fetch():
    stats.begin_wait()  # the fetch starts; its source never answers
    threading.Event().wait()

try:
    runner.call(fetch)
except StageTimeoutError:
    print("timed out; thread left:", not runner.close(timeout=1.0))
"""


@pytest.mark.slow  # a process of its own
@pytest.mark.timeout(120)
def test_a_call_abandoned_on_a_hung_source_does_not_block_exit():
    # A process of its own, forked from one that imported TensorFlow: it
    # ends as a fresh interpreter does (atexit, threads joined).
    done = run_forked(["-c"], code=_ABANDONED_AT_EXIT, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "timed out; thread left: True" in done.stdout


# -- calls whose elements are buffered ---------------------------------------


class _Iterator:
    """Stands for a consumer's iterator (the runner keeps a weak reference)."""


def _in_step_runner(name):
    """A runner of a consumer recording its fetches in its step, its stats."""
    options = StageOptions(name=name, timeout=None)
    stats = StageStats(options.name)
    runner = StageRunner(options, stats, counts_in_order=True)
    runner.records_in_step = True
    return runner, stats


def _call(runner, iterator, ran):
    """One call of `iterator`, noting in `ran` which of the two ran."""
    runner.call(
        lambda it: ran.append("recorded"),
        iterator,
        elements=1,
        ready_fn=lambda it: ran.append("unrecorded"),
    )


def test_a_buffered_call_runs_unrecorded_but_one_in_ready_sample():
    # A consumer recording its fetches in its step hands the runner the
    # same call without that recording (`ready_fn`); the runner uses it
    # for calls whose element is known to be buffered, counting their
    # fetches in Python, and keeps recording one in READY_SAMPLE.
    runner, stats = _in_step_runner("ready")
    iterator = _Iterator()
    ran = []
    # The first call of an iterator is never known to be ready.
    _call(runner, iterator, ran)
    assert ran == ["recorded"]
    counters = counters_with(stats, 100)
    stats._counters.assign(counters)
    # The consumer's step reports the counters after it.
    runner.take_report(iterator, list(counters))
    ran.clear()
    calls = 2 * runner_module.READY_SAMPLE
    for _ in range(calls):
        _call(runner, iterator, ran)
    assert ran.count("recorded") == 2
    assert ran.count("unrecorded") == calls - 2
    snapshot = stats.snapshot()
    assert snapshot["consumed"] == calls - 2
    # Each saw the 99 other elements the report showed.
    assert snapshot["buffered_sum"] == 99 * (calls - 2)
    assert stats.unconsumed() == 100 - (calls - 2)


def test_a_call_not_known_ready_records_its_fetch():
    runner, stats = _in_step_runner("not_ready")
    iterator = _Iterator()
    ran = []
    for _ in range(3):
        _call(runner, iterator, ran)
    # Nothing was produced, nor reported: no call knew its element ready.
    assert ran == ["recorded"] * 3
    assert stats.snapshot()["consumed"] == 0
