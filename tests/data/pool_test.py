"""Tests of `keras_stage.data.pool`: the stage's resizable thread pool."""

import threading
import time

import pytest
import tensorflow as tf

from keras_stage.data import StageOptions, stage
from keras_stage.data.pool import StagePool
from keras_stage.data.staging import build_stage, new_stats


def _thread_recording(seconds=0.005):
    """A staged fn that records which thread ran each element."""
    threads = []
    lock = threading.Lock()

    def record(x):
        time.sleep(seconds)  # long enough for the autotuner to run several
        with lock:
            threads.append(threading.get_native_id())
        return x

    def fn(x):
        y = tf.py_function(record, [x], tf.int64)
        y.set_shape(())
        return y

    return fn, threads


def test_auto_stage_starts_with_the_largest_pool():
    staged = stage(tf.data.Dataset.range(3), lambda x: x + 1, name="p")
    pool = staged.thread_pool
    assert isinstance(pool, StagePool)
    options = staged.stage_options
    assert pool.largest == options.resolved_pool_size()
    assert pool.smallest == options.smallest_pool_size()
    assert pool.most == options.most_pool_size() > pool.largest
    assert pool.size == pool.largest
    assert [int(x) for x in staged] == [1, 2, 3]
    assert staged.close()


@pytest.mark.timeout(60)
def test_resize_bounds_the_threads_of_the_next_iterator():
    fn, threads = _thread_recording()
    staged = stage(tf.data.Dataset.range(40), fn, name="resized")
    staged.thread_pool.resize(1)
    assert [int(x) for x in staged] == list(range(40))
    assert len(set(threads)) == 1
    threads.clear()
    staged.thread_pool.resize(2)
    assert [int(x) for x in staged] == list(range(40))
    assert 1 <= len(set(threads)) <= 2
    assert staged.close()


@pytest.mark.timeout(60)
def test_resize_leaves_a_running_iterator_alone():
    fn, threads = _thread_recording()
    staged = stage(tf.data.Dataset.range(30), fn, name="running")
    staged.thread_pool.resize(1)
    iterator = iter(staged)
    first = [int(next(iterator)) for _ in range(5)]
    staged.thread_pool.resize(8)
    rest = [int(x) for x in iterator]
    assert first + rest == list(range(30))
    assert len(set(threads)) == 1
    assert staged.close()


@pytest.mark.parametrize(
    "dataset, cardinality",
    [
        (tf.data.Dataset.range(5), 5),
        (tf.data.Dataset.range(5).repeat(), tf.data.INFINITE_CARDINALITY),
        (
            tf.data.Dataset.range(5).filter(lambda x: x > 1),
            tf.data.UNKNOWN_CARDINALITY,
        ),
    ],
    ids=["finite", "infinite", "unknown"],
)
def test_pooled_stage_keeps_the_cardinality(dataset, cardinality):
    staged = stage(dataset, lambda x: x * 2, name="card")
    assert staged.thread_pool is not None
    assert int(staged.cardinality()) == cardinality
    assert staged.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_threads=2),
        dict(thread_pool_size=4),
    ],
    ids=["num_threads", "thread_pool_size"],
)
def test_stages_with_a_fixed_pool_have_none(kwargs):
    staged = stage(tf.data.Dataset.range(3), lambda x: x, name="f", **kwargs)
    assert staged.thread_pool is None
    assert [int(x) for x in staged] == [0, 1, 2]
    assert staged.close()


def test_stage_without_a_function_has_no_pool_to_adapt():
    staged = stage(tf.data.Dataset.range(3), name="nofn")
    assert staged.thread_pool is None
    assert staged.close()


def test_infinite_stage_that_skips_still_adapts():
    staged = stage(
        tf.data.Dataset.range(3).repeat(),
        lambda x: x,
        ignored_exception_types=(tf.errors.InvalidArgumentError,),
        name="skips_forever",
    )
    assert staged.thread_pool is not None
    assert staged.close()


def _checked(x):
    """Fails for elements from 3 on (InvalidArgumentError)."""
    with tf.control_dependencies(
        [tf.debugging.assert_less(x, tf.constant(3, tf.int64))]
    ):
        return tf.identity(x)


@pytest.mark.timeout(60)
def test_finite_stage_that_skips_adapts_and_keeps_the_source_count():
    # Each pool size has a pipeline of its own (no one-element flat_map
    # hiding the count): nothing asserts a count the skips would break.
    staged = stage(
        tf.data.Dataset.range(6),
        _checked,
        ignored_exception_types=(tf.errors.InvalidArgumentError,),
        name="skips_finite",
    )
    assert staged.thread_pool is not None
    assert int(staged.cardinality()) == 6
    for size in (staged.thread_pool.largest, 1):
        staged.thread_pool.resize(size)
        assert [int(x) for x in staged] == [0, 1, 2]
    assert staged.stats.snapshot()["skipped"] == 6
    assert staged.close()


@pytest.mark.timeout(60)
def test_skipping_stage_with_unknown_cardinality_skips_on_the_pool():
    dataset = tf.data.Dataset.range(6).filter(lambda x: x >= 0)
    staged = stage(
        dataset,
        _checked,
        ignored_exception_types=(tf.errors.InvalidArgumentError,),
        name="skip_unknown",
    )
    assert staged.thread_pool is not None
    assert [int(x) for x in staged] == [0, 1, 2]
    assert staged.stats.snapshot()["skipped"] == 3
    assert staged.close()


def test_adapt_gives_an_input_bound_epoch_the_largest_pool():
    pool = StagePool("a", largest=16, smallest=2, most=64)
    pool.resize(3)
    assert pool.adapt(input_bound=True, needed_threads=1) == 16
    assert pool.size == 16
    # Busy cores: the stage computes, and more threads would share them.
    assert pool.adapt(input_bound=True, needed_threads=40) == 16


def test_adapt_grows_a_stage_that_waits_on_idle_cores_to_its_suggestion():
    pool = StagePool("io", largest=16, smallest=2, most=64)
    grown = pool.adapt(input_bound=True, needed_threads=22, cores_busy=False)
    assert grown == pool.size == 22
    # Still waiting: never fewer threads than it had, never past `most`.
    assert pool.adapt(True, needed_threads=5, cores_busy=False) == 22
    assert pool.adapt(True, needed_threads=22, cores_busy=True) == 22
    assert pool.adapt(True, needed_threads=100, cores_busy=False) == 64
    # Keeping up needing more than the cores: the pool stays.
    assert pool.adapt(False, needed_threads=30) == 64
    assert pool.adapt(False, needed_threads=2) == 2


@pytest.mark.timeout(60)
def test_a_pool_grown_past_largest_runs_that_many_threads():
    fn, threads = _thread_recording(seconds=0.05)
    staged = stage(tf.data.Dataset.range(120), fn, name="grown")
    pool = staged.thread_pool
    pool.resize(pool.largest + 8)
    assert [int(x) for x in staged] == list(range(120))
    assert pool.largest < len(set(threads)) <= pool.largest + 8
    assert staged.close()


@pytest.mark.parametrize("needed, threads", [(0, 1), (1, 1), (2, 2)])
def test_adapt_shrinks_a_stage_that_kept_up_on_the_cores(needed, threads):
    # To the threads its verdict asks for: at least one, at most the cores.
    pool = StagePool("b", largest=16, smallest=2)
    assert pool.adapt(input_bound=False, needed_threads=needed) == threads
    assert pool.size == threads


def test_adapt_never_shrinks_again_to_a_size_that_kept_the_step_waiting():
    pool = StagePool("floor", largest=16, smallest=4)
    assert pool.adapt(False, needed_threads=1) == 1
    # One thread was too few: the step waited; the full pool comes back.
    assert pool.adapt(True, needed_threads=1) == 16
    assert pool.adapt(False, needed_threads=1) == 2
    # Nor past the cores, however often a small pool fell behind.
    pool.resize(3)
    pool.adapt(True, needed_threads=1)
    assert pool.adapt(False, needed_threads=1) == 4
    pool.resize(4)
    pool.adapt(True, needed_threads=1)
    assert pool.adapt(False, needed_threads=1) == 4


@pytest.mark.parametrize("size", [16, 2, 5])
def test_adapt_leaves_a_stage_that_needs_more_than_the_cores(size):
    # Threads waiting on IO cost no CPU; a suggestion above the cores says
    # the stage uses more than the cores could run, so it keeps its pool.
    pool = StagePool("c", largest=16, smallest=2)
    pool.resize(size)
    assert pool.adapt(input_bound=False, needed_threads=3) == size
    assert pool.size == size


@pytest.mark.parametrize(
    "threads, error",
    [
        (0, ValueError),
        (-1, ValueError),
        (5, ValueError),
        (2.0, TypeError),
        (True, TypeError),
    ],
)
def test_resize_rejects_a_bad_size_naming_it(threads, error):
    pool = StagePool("bad", largest=4, smallest=1)
    with pytest.raises(error, match=r"stage 'bad'.*threads="):
        pool.resize(threads)
    assert pool.size == 4


def test_a_pool_can_start_below_its_largest_and_only_grow():
    # keras_stage on JAX: a pool at the cores that only grows (see
    # keras_stage.models.backends.jax.JaxBackend.pool_start).
    pool = StagePool("grows", largest=16, smallest=2, most=64, start=2)
    assert pool.size == 2
    # Keeping up on the cores: left as it is, never shrunk.
    assert pool.adapt(False, needed_threads=1, shrink=False) == 2
    assert pool.adapt(False, needed_threads=30, shrink=False) == 2
    # Keeping the step waiting: grown as `adapt` grows any pool.
    assert pool.adapt(True, needed_threads=1, shrink=False) == 16
    assert pool.adapt(False, needed_threads=1, shrink=False) == 16
    assert pool.adapt(True, 40, cores_busy=False, shrink=False) == 40


def test_a_stage_s_pool_starts_at_the_size_it_is_built_with():
    options = StageOptions(name="started")
    staged = build_stage(
        tf.data.Dataset.range(3), lambda x: x + 1, options, pool_start=1
    )
    assert staged.thread_pool.size == 1
    assert [int(x) for x in staged] == [1, 2, 3]
    assert staged.close()


def test_pool_bounds_are_checked():
    with pytest.raises(ValueError, match="smallest=5, largest=4"):
        StagePool("bounds", largest=4, smallest=5)
    with pytest.raises(ValueError, match="largest=4, most=3"):
        StagePool("bounds", largest=4, smallest=1, most=3)
    with pytest.raises(ValueError, match="stage 'bounds'.*start=9"):
        StagePool("bounds", largest=4, smallest=1, most=8, start=9)


def test_stages_built_with_the_same_stats_share_their_pool():
    # The Keras integration keeps one StageStats per phase across fit
    # calls: the size an epoch chose carries over to the next call.
    options = StageOptions(name="shared")
    stats = new_stats(options)
    first = build_stage(tf.data.Dataset.range(2), lambda x: x, options, stats)
    first.thread_pool.resize(3)
    second = build_stage(tf.data.Dataset.range(2), lambda x: x, options, stats)
    assert second.thread_pool is first.thread_pool
    assert second.thread_pool.size == 3
    assert first.close() and second.close()


def test_smallest_pool_is_the_cores_bounded_by_the_largest():
    options = StageOptions()
    assert 1 <= options.smallest_pool_size() <= options.resolved_pool_size()
    assert options.adaptive_pool
    assert not StageOptions(num_threads=3).adaptive_pool
    assert not StageOptions(thread_pool_size=3).adaptive_pool


def test_each_size_builds_its_pipeline_once():
    traced = []

    def fn(x):
        traced.append(1)  # runs when a pipeline is built, not per element
        return x + 1

    staged = stage(tf.data.Dataset.range(3), fn, name="built_once")
    built_at_start = len(traced)
    for size in (1, 1, 2, staged.thread_pool.largest, 1):
        staged.thread_pool.resize(size)
        assert [int(x) for x in staged] == [1, 2, 3]
    # Sizes 1 and 2 were new; the largest was built with the stage.
    assert len(traced) == 3 * built_at_start
    assert staged.close()


def test_a_dataset_made_from_the_stage_is_the_pipeline_built_with_it():
    # Transformed further, the stage is one graph, which cannot change
    # pools per iterator: the one built with the stage, at its size then.
    traced = []

    def fn(x):
        traced.append(1)
        return x + 1

    staged = stage(tf.data.Dataset.range(3), fn, name="transformed")
    built_at_start = len(traced)
    staged.thread_pool.resize(1)
    doubled = staged.pipeline.map(lambda x: x * 2)
    assert [int(x) for x in doubled] == [2, 4, 6]
    assert len(traced) == built_at_start
    assert staged.close()
