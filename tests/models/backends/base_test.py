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
