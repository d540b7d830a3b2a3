"""The torch environment itself: Keras on torch beside TensorFlow's tf.data."""

import keras
import tensorflow as tf


def test_keras_runs_on_the_torch_backend():
    assert keras.backend.backend() == "torch"


def test_torch_is_the_pinned_cpu_build():
    import torch

    assert torch.__version__.split("+")[0] == "2.13.0"
    assert not torch.cuda.is_available()


def test_tf_data_iterates():
    batches = list(tf.data.Dataset.range(4).batch(2))
    assert [b.numpy().tolist() for b in batches] == [[0, 1], [2, 3]]
