"""Fixtures shared by the model tests."""

import gc
import threading
import time

import pytest

from tests.helpers import stage_threads


@pytest.fixture
def release():
    """An event a hanging source waits on; set when the test ends.

    Then the pipelines the test hung are collected here, once their threads
    have finished, not by whichever later allocation sets off a
    collection: a tf.data iterator's finalizer waits for its threads. A
    suspected cause, not a proven one, of a rare stall of the first fuzz
    example after these tests: its thread dump showed a collection under
    way while the stage's helper thread traced the step.
    """
    event = threading.Event()
    yield event
    event.set()
    deadline = time.monotonic() + 10.0
    while stage_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
