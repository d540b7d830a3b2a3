"""Importing keras_stage without TensorFlow names the fix."""

import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_missing_tensorflow_names_the_fix():
    # sys.modules[name] = None makes `import name` raise ImportError.
    code = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "try:\n"
        "    import keras_stage\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    ).stdout
    assert "keras_stage needs TensorFlow" in out
    assert "pip install keras-stage[tensorflow]" in out
    assert "keras-stage[tensorflow-cpu]" in out
