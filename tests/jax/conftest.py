"""The JAX environment's tests: Keras on the JAX backend, tf.data staging.

These tests run in the jax environment (`make test-jax`, which builds
.venv-jax and sets KERAS_BACKEND=jax). Elsewhere, on the TensorFlow
backend of the rest of the suite, they are collected and reported as
skipped with the reason below, not silently left out.
"""

import pathlib

import keras
import pytest

HERE = pathlib.Path(__file__).resolve().parent
SKIP_REASON = "JAX backend tests: run `make test-jax` (KERAS_BACKEND=jax)"


def jax_backend():
    """Whether Keras runs on the JAX backend in this process."""
    return keras.backend.backend() == "jax"


def pytest_collection_modifyitems(config, items):
    # Called with the whole session's items: mark only those under here.
    if jax_backend():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in pathlib.Path(item.path).resolve().parents:
            item.add_marker(skip)
