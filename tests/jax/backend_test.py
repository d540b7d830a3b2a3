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


def test_compat_finds_the_tensorflow_seed_generator_of_a_traced_layer():
    # Fails loudly when Keras stops keeping a preprocessing layer's
    # TensorFlow generator in `_backend_generators` (see _compat).
    import tensorflow as tf

    from keras_stage import _compat

    flip = keras.layers.RandomFlip("horizontal", seed=3)
    assert _compat.backend_seed_generators(flip) == []
    tf.function(lambda x: flip(x, training=True))(tf.ones((2, 4, 4, 3)))
    (generator,) = _compat.backend_seed_generators(flip)
    assert isinstance(generator, keras.random.SeedGenerator)
    assert isinstance(generator.state.value, tf.Variable)
    assert generator is not flip.generator
