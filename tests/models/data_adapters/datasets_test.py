"""What a user's dataset tells before a call (data_adapters/datasets.py)."""

import numpy as np
import pytest
import tensorflow as tf

from keras_stage.data import stage
from keras_stage.data.source_passes import inspect_source
from keras_stage.models.data_adapters import datasets

X = np.arange(20, dtype="float32").reshape(10, 2)
Y = np.arange(10, dtype="float32").reshape(10, 1)


def _sliced():
    return tf.data.Dataset.from_tensor_slices((X, Y))


@pytest.mark.parametrize(
    "build, batches",
    [
        (lambda: _sliced().batch(4), 3),
        (lambda: _sliced().shuffle(10, seed=1).batch(4, True), 2),
        (lambda: _sliced().batch(4).prefetch(2), 3),
        (lambda: _sliced().batch(2).take(2).repeat(2), 4),
        (lambda: tf.data.Dataset.range(6).batch(3), 2),
        (
            lambda: tf.data.Dataset.zip(
                (tf.data.Dataset.range(4), tf.data.Dataset.range(4))
            ).batch(2),
            2,
        ),
    ],
)
def test_tensors_in_memory_count_their_batches(build, batches):
    dataset = build()
    assert datasets.reads_memory_only(dataset)
    assert datasets.batch_count(dataset, None) == batches
    assert datasets.batch_count(dataset, 1) == 1


@pytest.mark.parametrize(
    "build",
    [
        # A function of its own: its cost is not known (the stage overlaps it).
        lambda: _sliced().map(lambda x, y: (x * 2, y)).batch(4),
        lambda: _sliced().batch(4).filter(lambda x, y: True),
        lambda: tf.data.Dataset.range(2).interleave(
            lambda i: tf.data.Dataset.range(3)
        ),
        # A cache may be a file.
        lambda: _sliced().cache().batch(4),
        # Python.
        lambda: tf.data.Dataset.from_generator(
            lambda: iter([1, 2]), output_signature=tf.TensorSpec((), tf.int32)
        ),
    ],
)
def test_anything_else_is_not_counted(build):
    dataset = build()
    assert not datasets.reads_memory_only(dataset)
    assert datasets.batch_count(dataset, None) is None


def test_a_repeated_dataset_counts_the_steps_it_is_given():
    forever = _sliced().batch(4).repeat()
    assert datasets.reads_memory_only(forever)
    assert datasets.batch_count(forever, None) is None
    assert datasets.batch_count(forever, 7) == 7


def test_a_users_staged_dataset_is_not_counted():
    staged = stage(_sliced().batch(4))
    assert datasets.batch_count(staged, None) is None


def test_a_datasets_length_is_asked_once():
    dataset = _sliced().batch(4)
    facts = inspect_source(dataset)
    assert facts.cardinality is None
    assert datasets.cardinality(dataset) == int(dataset.cardinality())
    assert facts.cardinality == int(dataset.cardinality())
    # Kept per dataset object: another dataset of another length has its
    # own.
    shorter = _sliced().batch(8)
    assert datasets.cardinality(shorter) == int(shorter.cardinality())
    assert datasets.cardinality(shorter) != datasets.cardinality(dataset)
