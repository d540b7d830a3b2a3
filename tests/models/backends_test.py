"""keras_stage/models/backends.py on the TensorFlow backend.

The JAX side runs in the jax environment (tests/jax/); here: what this
backend does, and the errors of the backends keras_stage does not stage on.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.models import backends


def _model():
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput(name="stage")(inputs)
    return keras_stage.Model(inputs, keras.layers.Dense(1)(x))


def test_tensorflow_runs_graph_steps_with_device_buffers():
    assert backends.graph_steps()
    assert backends.uses_device_buffer()


@pytest.mark.parametrize("backend", ["torch", "numpy", "openvino"])
def test_other_backends_get_an_error_naming_the_supported_ones(backend):
    model = _model()
    with pytest.raises(NotImplementedError) as raised:
        backends.check_supported(model, model.get_layer("stage"), backend)
    message = str(raised.value)
    assert f"'{backend}' backend" in message
    assert "KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow" in message


def test_tensorflow_and_jax_are_supported():
    model = _model()
    backends.check_supported(model, model.get_layer("stage"), "tensorflow")
    assert backends.SUPPORTED == ("tensorflow", "jax")


def test_string_arrays_are_left_to_keras_on_tensorflow():
    words = np.array(["a", "b"], dtype=object)
    assert backends.host_arrays({"w": words})["w"] is words


def test_a_string_model_exports_on_tensorflow(tmp_path):
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput()(inputs)
    x = keras.layers.Hashing(num_bins=4)(x)
    model = keras_stage.Model(inputs, x)
    backends.check_exportable(model)  # nothing to refuse here
    model.export(str(tmp_path / "exported"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "exported"))
    assert served.serve(tf.constant(["a"])).shape == (1,)
