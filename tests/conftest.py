"""Shared test setup: quiet TensorFlow, seed everything, check for leaks."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_everything():
    # Python, NumPy and the backend, so staged and plain runs start alike.
    keras.utils.set_random_seed(1234)
    yield
