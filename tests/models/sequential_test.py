"""Tests for keras_stage/models/sequential.py: a `keras.Sequential` that stages.

With a `StagedInput` first, `keras_stage.Sequential` trains, evaluates and
predicts through a stage and ends with the weights a `keras.Sequential`
of the same layers ends with; without one it is that `keras.Sequential`.
The errors for a misplaced `StagedInput` are tests/models/errors_test.py's;
its save/load round trip is tests/layers/staged_input_test.py's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.layers import StagedInput

pytestmark = pytest.mark.timeout(120)

_rng = np.random.default_rng(0)
X = _rng.normal(size=(32, 4)).astype("float32")
Y = _rng.normal(size=(32, 1)).astype("float32")
STAGE_KEYS = {"stage_wait_ratio", "stage_buffer_fill", "stage_skipped"}


def _layers():
    keras.utils.set_random_seed(3)  # the same initial weights every time
    return [
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dense(1, name="head"),
    ]


def _plain():
    model = keras.Sequential([keras.Input(shape=(4,)), *_layers()])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def _staged(build="list"):
    # adaptive=False: every call is staged (calls that skip their stage are
    # tests/models/model_state_test.py's).
    staged_input = StagedInput(capacity=2, num_threads=2, adaptive=False)
    if build == "list":
        model = keras_stage.Sequential(
            [keras.Input(shape=(4,)), staged_input, *_layers()]
        )
    else:
        model = keras_stage.Sequential()
        model.add(keras.Input(shape=(4,)))
        model.add(staged_input)
        for layer in _layers():
            model.add(layer)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def _assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def _without_stage_keys(history):
    return {k: v for k, v in history.history.items() if k not in STAGE_KEYS}


@pytest.mark.parametrize(
    "build", ["list", pytest.param("add", marks=pytest.mark.long)]
)
def test_staged_fit_ends_with_the_weights_of_a_keras_sequential(build):
    plain, staged = _plain(), _staged(build)
    _assert_same_weights(plain, staged)  # the same start
    kwargs = dict(
        batch_size=8, epochs=3, verbose=0, validation_data=(X[:8], Y[:8])
    )
    expected = plain.fit(X, Y, **kwargs)
    history = staged.fit(X, Y, **kwargs)
    assert STAGE_KEYS <= set(history.history)  # it was staged
    assert _without_stage_keys(history).keys() == expected.history.keys()
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5)
    _assert_same_weights(plain, staged)


def test_staged_fit_on_a_dataset_equals_a_keras_sequential():
    def dataset():
        return (
            tf.data.Dataset.from_tensor_slices((X, Y))
            .shuffle(32, seed=5)
            .batch(8)
        )

    plain, staged = _plain(), _staged()
    plain.fit(dataset(), epochs=2, verbose=0, shuffle=False)
    history = staged.fit(dataset(), epochs=2, verbose=0, shuffle=False)
    assert "stage_wait_ratio" in history.history
    _assert_same_weights(plain, staged)


def test_staged_evaluate_and_predict_equal_a_keras_sequential():
    plain, staged = _plain(), _staged()
    np.testing.assert_allclose(
        staged.evaluate(X, Y, batch_size=8, verbose=0),
        plain.evaluate(X, Y, batch_size=8, verbose=0),
        rtol=1e-6,
    )
    predicted = staged.predict(X, batch_size=8, verbose=0)
    assert predicted.shape == (32, 1)
    np.testing.assert_allclose(
        predicted, plain.predict(X, batch_size=8, verbose=0), rtol=1e-6
    )


def test_it_is_a_keras_sequential_and_a_registered_class():
    model = _staged()
    assert isinstance(model, keras.Sequential)
    assert not isinstance(model, keras_stage.Model)
    assert [layer.name for layer in model.layers][1:] == ["hidden", "head"]
    assert (
        keras.saving.get_registered_name(keras_stage.Sequential)
        == "keras_stage>Sequential"
    )
    clone = keras_stage.Sequential.from_config(model.get_config())
    assert type(clone) is keras_stage.Sequential
    assert isinstance(clone.layers[0], StagedInput)


def test_without_staged_input_it_trains_as_keras_sequential():
    plain = _plain()
    model = keras_stage.Sequential([keras.Input(shape=(4,)), *_layers()])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    expected = plain.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    history = model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    assert history.history.keys() == expected.history.keys()
    _assert_same_weights(plain, model)


def test_smart_stage_stages_the_stateless_prefix_of_a_sequential():
    model = keras_stage.Sequential(
        [
            keras.Input(shape=(4,)),
            StagedInput(adaptive=False, name="stage"),
            keras.layers.Rescaling(0.5, name="rescale"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    plan = model.get_stage_plan()
    assert plan.staged_layers == ["stage", "rescale"]
    assert plan.trunk_layers == ["head"]
    history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert "stage_wait_ratio" in history.history
