"""The stage's figures read from tf.data's own model of its iterator."""

import time

import pytest
import tensorflow as tf

from keras_stage.data import pipeline_model, stage
from keras_stage.data.pipeline_model import PipelineModel, read_model
from keras_stage.data.stats import StageStats
from tests.op_determinism import needs_tf_data_model, op_determinism

pytestmark = pytest.mark.timeout(120)

SLEEP = 0.01
# A slow map's time per element: well above what a fetch of a ready
# element and a sample take on a loaded machine (the other test workers
# share its cores), which the consumer spends outside its wait.
SLOW_MAP = 0.03


def _sleepy(x, seconds=SLEEP):
    def sleep(value):
        time.sleep(seconds)
        return value

    return tf.ensure_shape(tf.py_function(sleep, [x], x.dtype), x.shape)


def _pipeline(fn=None, packs=False, source=None):
    """A pipeline shaped as a stage builds one under op determinism."""
    data = tf.data.Dataset.range(10**6) if source is None else source
    if fn is not None:
        data = data.map(fn, num_parallel_calls=2)
    if packs:
        data = data.map(lambda x: x + 0, num_parallel_calls=2)
    return data.prefetch(3)


@needs_tf_data_model
def test_tf_data_s_model_is_readable_on_tensorflow_2_17_and_later():
    # Not a silent skip of the tests below on a TensorFlow that has it.
    major, minor = (int(v) for v in tf.__version__.split(".")[:2])
    assert pipeline_model.AVAILABLE == ((major, minor) >= (2, 17))


@needs_tf_data_model
def test_the_consumer_s_gaps_make_its_time_and_the_rest_its_wait():
    model = PipelineModel()
    iterator = iter(_pipeline(lambda x: x * 2))
    model.watch(iterator)
    started = time.time()
    for _ in range(30):
        next(iterator)
        time.sleep(SLEEP)  # the consumer's step
        model.sample()
    elapsed = time.time() - started
    assert model.measures
    assert model.fetches == 30
    # 29 gaps of one step each; the first fetch of an iterator has none.
    assert 29 * SLEEP <= model.gap_seconds <= elapsed
    # Nothing slow to wait for: the wait is the first fetch and Python.
    assert model.wait_seconds < 0.5 * elapsed


@needs_tf_data_model
def test_a_slow_staged_map_is_waited_for_and_timed():
    model = PipelineModel()
    iterator = iter(_pipeline(lambda x: _sleepy(x, SLOW_MAP)))
    model.watch(iterator)
    started = time.time()
    for _ in range(12):
        next(iterator)
        model.sample()
    elapsed = time.time() - started
    # Two elements at once, 30 ms each, and a consumer with no step.
    assert model.wait_seconds > 0.5 * elapsed
    assert model.busy_seconds >= 12 * SLOW_MAP
    assert 0 <= model.buffered_peak <= 3


@needs_tf_data_model
def test_samples_further_apart_than_tf_data_s_window_are_scaled():
    model = PipelineModel()
    iterator = iter(_pipeline(lambda x: x * 2))
    model.watch(iterator)
    for _ in range(pipeline_model.GAP_WINDOW + 51):
        next(iterator)
    model.sample()
    assert model.fetches == pipeline_model.GAP_WINDOW + 51
    assert model.gap_seconds > 0


@needs_tf_data_model
def test_a_new_iterator_is_sampled_from_its_start_and_the_old_one_to_its_end():
    model = PipelineModel()
    first = iter(_pipeline(lambda x: x * 2))
    model.watch(first)
    for _ in range(5):
        next(first)
    second = iter(_pipeline(lambda x: x * 2))
    model.watch(second)  # samples the first one's last fetches
    for _ in range(7):
        next(second)
    model.sample()
    assert model.fetches == 12


@needs_tf_data_model
def test_packing_above_the_stage_s_map_is_skipped():
    iterator = iter(_pipeline(_sleepy, packs=True))
    next(iterator)
    buffer, stage_map = pipeline_model.stage_nodes(read_model(iterator), 1)
    assert buffer.name == "Prefetch"
    # The stage's map is the slow one, below the packing map.
    assert stage_map.processing_time > 0
    _, packing = pipeline_model.stage_nodes(read_model(iterator), 0)
    assert packing.processing_time < stage_map.processing_time


def test_a_pipeline_not_shaped_as_a_stage_is_not_measured():
    # No buffer at its end: not a stage's pipeline (or one tf.data keeps no
    # model of); its figures stay unknown rather than read from elsewhere.
    model = PipelineModel()
    iterator = iter(tf.data.Dataset.range(8).map(lambda x: x))
    model.watch(iterator)
    next(iterator)
    model.sample()
    assert not model.measures


def test_no_model_without_autotuning():
    options = tf.data.Options()
    options.autotune.enabled = False
    iterator = iter(_pipeline(lambda x: x * 2).with_options(options))
    next(iterator)
    model = PipelineModel()
    model.watch(iterator)
    model.sample()
    assert read_model(iterator) is None
    assert not model.measures
    assert read_model(object()) is None  # not a tf.data iterator


def test_the_model_never_keeps_a_dropped_iterator_running():
    model = PipelineModel()
    iterator = iter(_pipeline(lambda x: x * 2))
    model.watch(iterator)
    next(iterator)
    del iterator
    model.sample()  # nothing to sample: gone
    assert model.fetches == 0


@needs_tf_data_model
def test_stats_under_determinism_snapshot_what_tf_data_measured():
    # A stage built under op determinism holds no counter: its snapshot's
    # wait, busy time and buffer fill come from tf.data's model.
    with op_determinism():
        staged = stage(
            tf.data.Dataset.range(40), _sleepy, capacity=2, num_threads=2
        )
        stats = staged.stats
        assert stats.samples and not stats.pipeline_counts

        @tf.function
        def step(iterator):
            # A consumer's step as Keras's records its fetch: no clock.
            return stats.record_fetch(next(iterator))

        before = stats.snapshot()
        iterator = iter(staged.lean_pipeline)
        for _ in range(40):
            step(iterator)
            stats.sample()
        after = stats.snapshot()
        assert not stats.fetches_timed
    assert after["busy_seconds"] - before["busy_seconds"] >= 40 * SLEEP
    assert after["wait_seconds"] - before["wait_seconds"] > 0
    assert after["buffered_sum"] >= 0
    assert after["buffered_peak"] <= 2


def test_stats_counting_in_the_pipeline_sample_nothing():
    stats = StageStats("counted")
    assert not stats.samples
    stats.sample()  # nothing to read
    stats.watch(iter(tf.data.Dataset.range(2)))
