"""Fixtures shared by the model tests."""

import threading

import pytest


@pytest.fixture
def release():
    """An event a hanging source waits on; set when the test ends."""
    event = threading.Event()
    yield event
    event.set()
