"""keras_stage/models/backends/base.py: `Backend`, and its refusal.

The base is the backend of the Keras backends keras_stage does not stage
on: a staged call there says which it stages on.
"""

import keras
import pytest

import keras_stage
from keras_stage.models import backends


def _model():
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput(name="stage")(inputs)
    return keras_stage.Model(inputs, keras.layers.Dense(1)(x))


@pytest.mark.parametrize("name", ["numpy", "openvino"])
def test_other_backends_get_an_error_naming_the_supported_ones(name):
    model = _model()
    backend = backends.get(name)
    assert type(backend) is backends.Backend
    with pytest.raises(NotImplementedError) as raised:
        backend.check_supported(model, model.get_layer("stage"))
    message = str(raised.value)
    assert f"'{name}' backend" in message
    for supported in ("tensorflow", "jax", "torch"):
        assert f"KERAS_BACKEND={supported}" in message


def test_a_model_s_backend_is_chosen_once():
    model = _model()
    assert backends.for_model(model) is backends.for_model(model)
    assert backends.for_model(model).name == keras.backend.backend()


def _plan(boundary, note=""):
    from keras_stage.planner.stage_plan import BoundaryTensor, StagePlan

    return StagePlan(
        "m",
        ["stage"] if boundary else [],
        ["tower"],
        {"tower": "has trainable weights"},
        [BoundaryTensor(name, dtype, (None, 1)) for name, dtype in boundary],
        note=note,
    )


def test_off_tensorflow_a_trunk_taking_strings_is_refused_naming_the_fix():
    import tensorflow as tf

    model = _model()
    jax = backends.get("jax")
    with pytest.raises(ValueError, match="'stage'.*'tower' \\(has trainable"):
        jax.check_plan(model, _plan([("stage", "string")]))
    jax.check_plan(model, _plan([("ids", "int64")]))  # numbers cross
    strings = {"user": tf.TensorSpec([None], tf.string)}
    with pytest.raises(ValueError, match="as a keras_stage.Model"):
        jax.check_plan(model, _plan([], note="not planned: why."), strings)
    # On TensorFlow the step takes strings.
    backends.get("tensorflow").check_plan(
        model, _plan([("stage", "string")]), strings
    )
