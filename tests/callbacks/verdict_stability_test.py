"""The verdict gives the same classification on the same work, every time.

Two cases with wide margins, each fit in 3 fresh models (in `make
test-long`; `make test` fits one): a dataset whose
reading before the stage sleeps on every batch, with a trunk that takes
far less, is input-bound (and the pipeline before the stage the
bottleneck) in every measured epoch; in-memory batches with a trunk of
large Dense layers are compute-bound in every one. Only the
classification is asserted, never a time: on a loaded machine every
figure moves, and the margins are there so that the answer does not.
"""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.callbacks import PrefetchCallback
from keras_stage.layers import StagedInput

FITS = 3
EPOCHS = 2
BATCHES = 20
# The reading before the stage: far longer than the cheap trunk's step.
READ_SECONDS = 0.02
# The heavy trunk: Dense layers wide enough for a step many times longer
# than handing over an in-memory batch.
WIDTH = 1024
FEATURES = 256
BATCH_SIZE = 128


def _slow_read(x):
    time.sleep(READ_SECONDS)
    return x


def _read_before_the_stage():
    x = np.ones((BATCHES * 4, 2), "float32")
    y = np.ones((BATCHES * 4, 1), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    # One batch at a time, no parallel calls: the stage pulls from it.
    return dataset.map(
        lambda a, b: (
            tf.ensure_shape(
                tf.py_function(_slow_read, [a], tf.float32), a.shape
            ),
            b,
        )
    )


def _in_memory():
    x = np.ones((BATCHES * BATCH_SIZE, FEATURES), "float32")
    y = np.ones((BATCHES * BATCH_SIZE, 1), "float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE)


def _model(features, heavy_trunk):
    inputs = keras.Input(shape=(features,))
    # adaptive=False: every call and epoch staged, whatever the costs say.
    x = StagedInput(capacity=2, num_threads=1, adaptive=False)(inputs)
    if heavy_trunk:
        for _ in range(3):
            x = keras.layers.Dense(WIDTH, activation="relu")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


class _Keep(keras.callbacks.Callback):
    """Keeps each epoch's verdict of `prefetch`, which runs before it."""

    def __init__(self, prefetch, verdicts):
        super().__init__()
        self._prefetch = prefetch
        self._verdicts = verdicts

    def on_epoch_end(self, epoch, logs=None):
        # The model moves its PrefetchCallback first: its verdict of this
        # epoch is in place.
        self._verdicts.append(dict(self._prefetch.verdict))


def _verdicts_of_fresh_fits(dataset, features, heavy_trunk, fits):
    """Every epoch's verdict of `fits` fits, each of a fresh model."""
    verdicts = []
    for _ in range(fits):
        callback = PrefetchCallback()
        _model(features, heavy_trunk).fit(
            dataset,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[callback, _Keep(callback, verdicts)],
        )
    assert len(verdicts) == fits * EPOCHS
    assert all(v["staged"] for v in verdicts), verdicts
    return verdicts


# `make test` classifies each case in one fit (two epochs); the repeats
# that show the verdict stable across fresh models are in `make test-long`.
fits = pytest.mark.parametrize(
    "fits", [1, pytest.param(FITS, marks=pytest.mark.long)]
)


@pytest.mark.slow
@pytest.mark.timeout(120)
@fits
def test_a_slow_read_before_the_stage_is_input_bound_every_time(fits):
    verdicts = _verdicts_of_fresh_fits(
        _read_before_the_stage(), 2, heavy_trunk=False, fits=fits
    )
    for v in verdicts:
        assert v["input_bound"] is True, v["message"]
        assert v["source_bound"] is True, v["message"]
        assert (
            "The pipeline before the stage is the bottleneck" in (v["message"])
        )


@pytest.mark.slow
@pytest.mark.timeout(120)
@fits
def test_a_heavy_trunk_fed_from_memory_is_compute_bound_every_time(fits):
    verdicts = _verdicts_of_fresh_fits(_in_memory(), FEATURES, True, fits)
    for v in verdicts:
        assert v["input_bound"] is False, v["message"]
        assert "': compute-bound, " in v["message"], v["message"]
