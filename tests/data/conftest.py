"""Setup for the engine's tests: no stage outlives the test that made it."""

import pytest

from keras_stage.data import live_stages


@pytest.fixture(autouse=True)
def _close_stages():
    # A failing test must not leave a helper thread that makes the next
    # test's thread checks fail too; tests that check threads do so before
    # this runs.
    yield
    for staged in live_stages():
        staged.close(timeout=1.0)
