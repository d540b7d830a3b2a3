"""Tests for keras_stage/models/array_source.py: Keras's batches, gathered."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage import _compat
from keras_stage.models.array_source import array_dataset

ROWS = 25  # 6 batches of 4 and a partial one of 1


def _keras_adapter(x, **kwargs):
    """Keras's adapter of `x`, its other arguments defaulted as fit's."""
    args = dict(
        y=None,
        sample_weight=None,
        batch_size=None,
        steps_per_epoch=None,
        shuffle=False,
        class_weight=None,
    )
    args.update(kwargs)
    return _compat.get_data_adapter(x=x, **args)


def _adapter(shuffle, **kwargs):
    x = {
        "a": np.arange(ROWS * 2, dtype="float64").reshape(ROWS, 2),
        "s": np.array([f"row{i}" for i in range(ROWS)], dtype=object),
    }
    args = dict(y=np.arange(ROWS) % 3, batch_size=4, shuffle=shuffle)
    args.update(kwargs)
    return _keras_adapter(x, **args)


def _epochs(dataset, count=2):
    return [
        [keras.tree.map_structure(lambda t: t.numpy(), b) for b in dataset]
        for _ in range(count)
    ]


def _assert_same_batches(expected, got):
    tf.nest.assert_same_structure(expected, got)
    for want, have in zip(
        tf.nest.flatten(expected), tf.nest.flatten(got), strict=True
    ):
        assert want.dtype == have.dtype
        np.testing.assert_array_equal(want, have)


@pytest.mark.parametrize("shuffle", [False, True, "batch"])
@pytest.mark.parametrize(
    "weights",
    [
        {},
        {"sample_weight": np.linspace(0.0, 1.0, ROWS)},
        {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}},
    ],
    ids=["none", "sample_weight", "class_weight"],
)
def test_the_batches_are_keras_s_in_keras_s_order(shuffle, weights):
    keras.utils.set_random_seed(7)
    expected = _adapter(shuffle, **weights).get_tf_dataset()
    want = _epochs(expected)
    keras.utils.set_random_seed(7)
    dataset = array_dataset(_adapter(shuffle, **weights), shuffle)
    assert dataset.element_spec == expected.element_spec
    _assert_same_batches(want, _epochs(dataset))
    if shuffle:  # the order is Keras's shuffle, not the rows' order
        labels = np.concatenate([batch[1] for batch in want[0]])
        assert not np.array_equal(labels, np.arange(ROWS) % 3)


def test_floats_are_cast_to_floatx_as_keras_does():
    dataset = array_dataset(_adapter(False), False)
    assert dataset.element_spec[0]["a"].dtype == tf.float32


def test_the_options_are_those_keras_sets():
    for shuffle in (False, True):
        options = array_dataset(_adapter(shuffle), shuffle).options()
        assert not options.experimental_optimization.apply_default_optimizations
        assert (
            options.experimental_distribute.auto_shard_policy
            == tf.data.experimental.AutoShardPolicy.DATA
        )


def test_other_sources_keep_keras_s_dataset():
    adapter = _keras_adapter(tf.data.Dataset.range(4).batch(2))
    assert array_dataset(adapter, False) is None
    ragged = tf.ragged.constant([[1], [2, 3], [4], [5, 6, 7]])
    adapter = _keras_adapter(ragged, y=np.zeros((4,)), batch_size=2)
    assert array_dataset(adapter, False) is None


def test_a_staged_fit_on_arrays_reads_the_gathered_batches(monkeypatch):
    # The stage's source is this module's dataset, and the fit trains on
    # the same data as plain Keras (same weights, shuffled).
    built = []
    original = keras_stage.models.inputs.array_dataset

    def spy(adapter, shuffle):
        dataset = original(adapter, shuffle)
        built.append(dataset)
        return dataset

    monkeypatch.setattr(keras_stage.models.inputs, "array_dataset", spy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = rng.normal(size=(40, 1)).astype("float32")

    def fitted(model_class, staged):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        h = keras_stage.layers.StagedInput()(inputs) if staged else inputs
        model = model_class(inputs, keras.layers.Dense(1)(h))
        model.compile("sgd", "mse")
        callbacks = [keras_stage.callbacks.PrefetchCallback()] if staged else []
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=True,
            verbose=0,
            callbacks=callbacks,
        )
        return model.get_weights()

    plain = fitted(keras.Model, staged=False)
    staged = fitted(keras_stage.Model, staged=True)
    assert built and all(dataset is not None for dataset in built)
    for a, b in zip(plain, staged, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
