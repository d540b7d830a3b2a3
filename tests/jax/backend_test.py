"""The jax environment itself: Keras on JAX, with tf.data alongside."""

import keras


def test_keras_runs_on_the_jax_backend():
    assert keras.backend.backend() == "jax"


def test_jax_imports():
    import jax

    assert jax.numpy.arange(3).tolist() == [0, 1, 2]


def test_tf_data_iterates():
    # The stage runs in tf.data, so TensorFlow must load beside JAX.
    import tensorflow as tf

    dataset = tf.data.Dataset.range(3)
    assert [int(x) for x in dataset.as_numpy_iterator()] == [0, 1, 2]
