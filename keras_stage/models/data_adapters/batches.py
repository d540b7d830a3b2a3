"""How many batches a call reads from in-memory data, as Keras runs it.

What the staging policy weighs (`decision/calls.py`): a count for arrays
and for datasets of tensors in memory, None for data whose reading a stage
overlaps (always staged).
"""

import keras
import tensorflow as tf

from keras_stage.models.data_adapters import datasets
from keras_stage.models.data_adapters.arrays import batch_count


def call_batches(x, batch_size, steps):
    """The batches a call reads from in-memory data, or None (anything else,
    always staged; see `datasets.batch_count`)."""
    if isinstance(x, tf.data.Dataset):
        return datasets.batch_count(x, steps)
    return batch_count(x, batch_size, steps)


def validation_runs(initial_epoch, epochs, validation_freq):
    """How many of a fit's epochs run validation (as Keras's fit decides)."""
    return sum(
        1
        for epoch in range(initial_epoch, epochs)
        if (
            (epoch + 1) % validation_freq == 0
            if isinstance(validation_freq, int)
            else epoch + 1 in validation_freq
        )
    )


def fit_batches(
    x,
    validation_data,
    batch_size,
    epochs,
    initial_epoch,
    steps_per_epoch,
    validation_steps,
    validation_batch_size,
    validation_freq,
):
    """A fit's `((batches, epochs), (batches, runs))`, for its training and
    its validation (batches None when not from in-memory data)."""
    epochs, first = max(epochs - initial_epoch, 0), initial_epoch
    train = call_batches(x, batch_size, steps_per_epoch)
    train = None if train is None else train * epochs
    if validation_data is None:
        return (train, epochs), (None, 0)
    runs = validation_runs(first, first + epochs, validation_freq)
    val_x, _, _ = keras.utils.unpack_x_y_sample_weight(validation_data)
    val = call_batches(
        val_x, validation_batch_size or batch_size, validation_steps
    )
    return (train, epochs), (None if val is None else val * runs, runs)
