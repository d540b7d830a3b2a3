"""Tests for keras_stage/models/data_adapters/batches.py: batch counts."""

import numpy as np
import tensorflow as tf

from keras_stage.models.data_adapters.batches import call_batches, fit_batches


def test_call_batches_counts_in_memory_data_only():
    assert call_batches(np.zeros((100, 2)), 32, None) == 4
    assert call_batches(np.zeros((100, 2)), 32, 2) == 2
    assert call_batches(tf.data.Dataset.range(10).batch(4), None, None) == 3
    assert (
        call_batches(tf.data.Dataset.range(3).map(lambda x: x), None, None)
        is None
    )
    assert call_batches(iter([]), 32, None) is None


def test_fit_batches_counts_epochs_and_validation_runs_as_keras_runs_them():
    x, val = np.zeros((100, 2)), (np.zeros((40, 2)), np.zeros((40, 1)))
    kwargs = dict(
        batch_size=10,
        epochs=5,
        initial_epoch=1,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=2,
    )
    # Epochs 1..4 train; epochs 2 and 4 (1-based) validate.
    assert fit_batches(x, val, **kwargs) == ((40, 4), (8, 2))
    assert fit_batches(x, None, **kwargs) == ((40, 4), (None, 0))
    kwargs.update(validation_freq=[1, 5], validation_batch_size=20)
    assert fit_batches(x, val, **kwargs) == ((40, 4), (2, 1))
    # A dataset of tensors in memory counts as arrays do: 3 batches an
    # epoch. One that maps may read anything (always staged): None.
    dataset = tf.data.Dataset.range(3)
    assert fit_batches(dataset, None, **kwargs)[0] == (12, 4)
    mapped = dataset.map(lambda x: x + 1)
    assert fit_batches(mapped, None, **kwargs)[0] == (None, 4)
