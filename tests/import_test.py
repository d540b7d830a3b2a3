"""Importing keras_stage without TensorFlow names the fix."""

import configparser
import pathlib
import re

import pytest

from tests.helpers import printed_in_fresh_python

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    out = printed_in_fresh_python(code)
    assert "keras_stage needs TensorFlow" in out
    # The commands work: the pinned TensorFlow of the primary environment,
    # and the checkout's own extra (keras-stage is on no package index).
    pinned = re.search(
        r"^tensorflow-cpu==(\S+)$",
        (ROOT / "requirements" / "primary.txt").read_text(),
        re.MULTILINE,
    ).group(1)
    assert f"`pip install tensorflow-cpu=={pinned}`" in out
    assert f"`pip install tensorflow[and-cuda]=={pinned}`" in out
    assert '`pip install -e ".[tensorflow-cpu]"` in the keras_stage' in out
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert "tensorflow-cpu" in setup["options.extras_require"]
    assert "keras-stage[" not in out
