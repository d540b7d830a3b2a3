"""The PyTorch environment's tests: Keras on the torch backend, tf.data
staging.

These tests run in the torch environment (`make test-torch`, which builds
.venv-torch and sets KERAS_BACKEND=torch). Elsewhere, on the TensorFlow
backend of the rest of the suite, they are collected and reported as
skipped with the reason below, not silently left out.
"""

import pathlib

import keras
import pytest

HERE = pathlib.Path(__file__).resolve().parent
SKIP_REASON = (
    "PyTorch backend tests: run `make test-torch` (KERAS_BACKEND=torch)"
)


def torch_backend():
    """Whether Keras runs on the torch backend in this process."""
    return keras.backend.backend() == "torch"


def pytest_collection_modifyitems(config, items):
    # Called with the whole session's items: mark only those under here.
    if torch_backend():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in pathlib.Path(item.path).resolve().parents:
            item.add_marker(skip)
