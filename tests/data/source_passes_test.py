"""Tests for keras_stage/data/source_passes.py, on plain pipelines.

What a source's facts say (what it draws per iterator, what it refuses)
and the passes `long_lived_source` reads on one iterator; that they read
plain Keras's epochs behind `stage_data` and a real `fit` is
tests/models/data_adapters/epoch_plans_test.py's.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_stage.data.source_passes import (
    inspect_source,
    long_lived_source,
    nbytes,
    one_pass,
)

pytestmark = pytest.mark.timeout(60)


def _values(dataset):
    return [int(v) for v in dataset]


@pytest.mark.parametrize(
    "make, draws",
    [
        (lambda: tf.data.Dataset.range(8).map(lambda i: i * 2).batch(2), False),
        (lambda: tf.data.Dataset.range(8).shuffle(8, seed=1).batch(2), True),
        (lambda: tf.data.Dataset.range(8).shuffle(8).batch(2), True),
        (lambda: tf.data.Dataset.random(seed=1).take(4), True),
        (
            lambda: tf.data.Dataset.from_generator(
                lambda: iter(range(3)),
                output_signature=tf.TensorSpec((), tf.int64),
            ),
            True,
        ),
    ],
)
def test_which_datasets_draw_when_an_iterator_starts(make, draws):
    assert inspect_source(make()).iterator_draws is draws


def test_the_facts_are_kept_per_dataset_object():
    dataset = tf.data.Dataset.range(4).map(lambda i: i + 1)
    facts = inspect_source(dataset)
    assert inspect_source(dataset) is facts
    assert facts.runs_functions and facts.refusal is None
    assert {"_MapDataset", "_RangeDataset"} <= facts.kinds
    assert facts.free_passes and not facts.iterator_draws


def test_sources_built_on_one_dataset_share_its_object():
    base = tf.data.Dataset.range(4)
    mapped, batched = base.map(lambda i: i * 2), base.batch(2)
    assert inspect_source(mapped).objects & inspect_source(batched).objects
    other = tf.data.Dataset.range(4)
    assert not inspect_source(mapped).objects & inspect_source(other).objects


def test_a_seeded_shuffle_draws_passes_that_depend_on_earlier_iterators():
    facts = inspect_source(tf.data.Dataset.range(8).shuffle(8, seed=1))
    assert facts.resource_seeded and facts.seeded_draws
    assert facts.refusal is None and not facts.free_passes


@pytest.mark.parametrize(
    "transform, refusal",
    [
        (
            lambda d: d.map(
                lambda i: tf.py_function(lambda v: v, [i], tf.int64)
            ),
            "calls Python",
        ),
        (lambda d: d.map(lambda i: i + _variable()), "reads or changes state"),
        (
            lambda d: tf.data.Dataset.range(1).flat_map(lambda _: d),
            "captured",
        ),
    ],
)
def test_what_a_pass_read_ahead_cannot_follow_is_refused(transform, refusal):
    facts = inspect_source(transform(tf.data.Dataset.range(4)))
    assert refusal in facts.refusal
    assert facts.iterator_draws and not facts.free_passes


_VARIABLES = []


def _variable():
    if not _VARIABLES:
        _VARIABLES.append(tf.Variable(1, dtype=tf.int64))
    return _VARIABLES[0]


def test_a_fixed_seed_stateful_random_op_is_kernel_seeded():
    dataset = tf.data.Dataset.range(4).map(
        lambda i: tf.random.uniform((), seed=5) + tf.cast(i, tf.float32)
    )
    facts = inspect_source(dataset)
    assert facts.kernel_seeded and facts.refusal is None
    assert not facts.free_passes


def test_nbytes_counts_nested_arrays_and_tensors():
    values = (np.zeros((4, 2), "float32"), None, {"t": tf.zeros((3,), "int64")})
    assert nbytes(values) == 4 * 2 * 4 + 3 * 8
    assert nbytes([object()]) is None


def test_one_pass_opens_an_unread_iterator_after_its_pass():
    dataset = tf.data.Dataset.range(3)
    assert one_pass(dataset) is dataset
    assert _values(one_pass(dataset, opens=1)) == [0, 1, 2]


def test_long_lived_passes_read_on_one_iterator():
    dataset = tf.data.Dataset.range(3)
    assert _values(long_lived_source(dataset, 2)) == [0, 1, 2, 0, 1, 2]
    forever = long_lived_source(dataset, None)
    assert _values(forever.take(7)) == [0, 1, 2, 0, 1, 2, 0]


def test_long_lived_passes_keep_the_sources_options():
    options = tf.data.Options()
    options.deterministic = False
    dataset = tf.data.Dataset.range(3).with_options(options)
    for epochs in (None, 2):
        source = long_lived_source(dataset, epochs)
        assert source.options().deterministic is False


def test_a_start_variable_skips_the_passes_before_it():
    start = tf.Variable(0, dtype=tf.int64)
    source = long_lived_source(tf.data.Dataset.range(2), 3, start=start)
    start.assign(2)
    assert _values(source) == [0, 1]  # the last pass only
    stop = tf.Variable(3, dtype=tf.int64)
    source = long_lived_source(
        tf.data.Dataset.range(2), 3, start=start, stop=stop
    )
    start.assign(0)
    stop.assign(1)
    assert _values(source) == [0, 1]  # the first pass only


def test_a_replayed_source_repeats_its_first_pass():
    dataset = tf.data.Dataset.range(16).shuffle(16, seed=3)
    drawn = _values(long_lived_source(dataset, 2))
    assert drawn[:16] != drawn[16:]  # a new draw per pass
    replayed = _values(long_lived_source(dataset, 2, replay=True))
    assert replayed[:16] == replayed[16:]
