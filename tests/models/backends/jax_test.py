"""keras_stage/models/backends/jax.py: `JaxBackend`, read on TensorFlow.

Its runs are in the jax environment (tests/jax/); here, what it answers
and refuses without running a JAX step.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.models.backends.jax import JaxBackend


def test_jax_reads_every_batch_in_python_with_host_buffers():
    backend = JaxBackend("jax")
    assert not backend.reads_in_graph("train")
    assert not backend.uses_device_buffer and not backend.pool_shrinks
    assert not backend.may_run_unstaged and not backend.native_tf
    options = keras_stage.data.StageOptions()
    assert backend.pool_start(options) == options.smallest_pool_size()
    # One process: Keras does not shard the dataset.
    assert backend.shard_batches(tf.data.Dataset.range(3).batch(2)) is None


def test_string_arrays_become_tensors_on_jax():
    words = np.array(["a", "b"], dtype=object)
    converted = JaxBackend("jax").host_arrays({"w": words, "n": np.ones(2)})
    assert converted["w"].dtype == tf.string
    assert isinstance(converted["n"], np.ndarray)


def test_a_string_model_is_refused_export_with_the_way_that_works():
    inputs = keras.Input(shape=(), dtype="string", name="words")
    x = keras_stage.layers.StagedInput()(inputs)
    model = keras_stage.Model(inputs, keras.layers.Hashing(num_bins=4)(x))
    with pytest.raises(ValueError, match="cannot export on the jax backend"):
        JaxBackend("jax").check_exportable(model)


def test_a_device_buffer_option_is_said_unused_once(caplog):
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput(name="stage", device="gpu:0")(inputs)
    model = keras_stage.Model(inputs, x)
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        for _ in range(2):
            JaxBackend("jax").check_supported(model, model.get_layer("stage"))
    warned = [r for r in caplog.records if "stays on the host" in r.message]
    assert len(warned) == 1
