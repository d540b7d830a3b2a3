"""Tests for keras_stage/models/model.py: `keras_stage.Model` in both styles.

The functional style returns a `keras_stage` functional class of its own
(still a `keras_stage.Model`), the subclassing style stays a subclass of
`keras_stage.Model`, and `compile` takes `smart_stage`. Whether a staged
fit equals a plain one is tests/models/staging_mixin_test.py's; whether
`_functional_init_arguments` agrees with Keras is tests/_compat_test.py's.
"""

import keras
import numpy as np
import pytest

import keras_stage
from keras_stage.models import Functional
from keras_stage.models.model import _functional_init_arguments
from keras_stage.models.staging_mixin import StagingMixin

pytestmark = pytest.mark.timeout(120)


class Subclassed(keras_stage.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def _functional(staged=True, name=None):
    inputs = keras.Input(shape=(3,))
    x = (
        keras_stage.layers.StagedInput(num_threads=1)(inputs)
        if staged
        else inputs
    )
    return keras_stage.Model(inputs, keras.layers.Dense(1)(x), name=name)


def _data():
    rng = np.random.default_rng(0)
    return rng.random((16, 3), dtype="float32"), rng.random((16, 1))


# -- construction ------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("in", "out"), {}),
        (("in",), {"outputs": "out"}),
        ((), {"inputs": "in", "outputs": "out", "name": "m"}),
    ],
)
def test_inputs_and_outputs_mean_functional_construction(args, kwargs):
    assert _functional_init_arguments(args, kwargs)


@pytest.mark.parametrize(
    "args, kwargs",
    [((), {}), ((), {"name": "m"}), (("in",), {}), ((), {"inputs": "in"})],
)
def test_anything_else_is_subclassing_construction(args, kwargs):
    assert not _functional_init_arguments(args, kwargs)


@pytest.mark.parametrize(
    "build",
    [
        lambda i, o: keras_stage.Model(i, o),
        lambda i, o: keras_stage.Model(i, outputs=o),
        lambda i, o: keras_stage.Model(inputs=i, outputs=o),
    ],
    ids=["positional", "mixed", "keywords"],
)
def test_functional_construction_returns_the_functional_class(build):
    inputs = keras.Input(shape=(2,))
    model = build(inputs, keras.layers.Dense(1)(inputs))
    assert type(model) is Functional
    assert isinstance(model, keras_stage.Model)
    assert isinstance(model, keras.Model)
    assert model.inputs[0] is inputs


def test_subclassing_stays_a_subclass_before_and_after_functional_models():
    first = Subclassed()
    _functional()  # must not rewrite the bases of keras_stage.Model
    second = Subclassed()
    for model in (first, second):
        assert type(model) is Subclassed
        assert not isinstance(model, Functional)
    assert keras_stage.Model.__bases__ == (StagingMixin, keras.Model)
    x, y = _data()
    second.compile(optimizer="sgd", loss="mse")
    history = second.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_a_subclass_called_functionally_becomes_a_staged_functional_model():
    # As `class M(keras.Model)` called as `M(inputs, outputs)` becomes a
    # Keras Functional, a subclass of keras_stage.Model becomes one of ours.
    class Named(keras_stage.Model):
        pass

    inputs = keras.Input(shape=(3,))
    staged = keras_stage.layers.StagedInput()(inputs)
    rescale = keras.layers.Rescaling(0.5, name="rescale")
    outputs = keras.layers.Dense(1)(rescale(staged))
    models = [Named(inputs, outputs), Named(inputs=inputs, outputs=outputs)]
    for model in models:
        assert isinstance(model, Named) and isinstance(model, Functional)
    assert keras_stage.Model.__bases__ == (StagingMixin, keras.Model)
    model = models[0]
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.get_stage_plan().staged_layers[-1] == "rescale"


# -- compile(smart_stage=...) ------------------------------------------------


@pytest.mark.parametrize("value", [True, False, "longest"])
def test_compile_keeps_each_accepted_smart_stage(value):
    model = _functional()
    model.compile(optimizer="sgd", loss="mse", smart_stage=value)
    assert model.smart_stage is value  # as given, not a look-alike
    assert model.get_compile_config()["smart_stage"] == value


def test_smart_stage_defaults_to_false():
    model = _functional()
    model.compile(optimizer="sgd", loss="mse")
    assert model.smart_stage is False


@pytest.mark.parametrize(
    "value", [np.bool_(True), 0, 1.0, "true", "LONGEST", [True]]
)
def test_compile_rejects_look_alikes_naming_the_value(value):
    model = _functional()
    with pytest.raises(
        ValueError,
        match=(
            r"^Invalid value for argument `smart_stage`. Expected True, "
            r"False or \"longest\". Received: smart_stage="
        ),
    ) as raised:
        model.compile(optimizer="sgd", loss="mse", smart_stage=value)
    assert str(raised.value).endswith(f"smart_stage={value!r}")
    assert not model.compiled  # nothing half-done


def test_recompiling_changes_smart_stage():
    model = _functional()
    model.compile(optimizer="sgd", loss="mse", smart_stage="longest")
    model.compile(optimizer="sgd", loss="mse", smart_stage=False)
    assert model.smart_stage is False
    assert model.get_compile_config()["smart_stage"] is False


def test_smart_stage_survives_save_and_load(tmp_path):
    model = _functional()
    model.compile(optimizer="adam", loss="mse", smart_stage="longest")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is Functional
    assert loaded.smart_stage == "longest"
    assert loaded.optimizer.built
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6
    )


# -- without a StagedInput -----------------------------------------------------


def test_without_staged_input_it_trains_exactly_as_keras():
    x, y = _data()
    plain_inputs = keras.Input(shape=(3,))
    plain = keras.Model(plain_inputs, keras.layers.Dense(1)(plain_inputs))
    model = _functional(staged=False)
    model.set_weights(plain.get_weights())
    for m in (plain, model):
        m.compile(optimizer="sgd", loss="mse")
    expected = plain.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    assert history.history == expected.history  # no stage_* keys either
    for a, b in zip(plain.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
