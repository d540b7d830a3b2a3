"""Helpers shared by the tests."""

import threading


def stage_threads():
    """The keras_stage helper threads alive now."""
    return {
        t for t in threading.enumerate() if t.name.startswith("keras_stage")
    }
