"""Importing keras_stage without TensorFlow names the fix.

What keras_stage's own import loads is checked in a process forked from
one that imported TensorFlow, Keras and NumPy but no keras_stage module
(`printed_in_forked_python`); an import blocked before TensorFlow's, in a
fresh interpreter.
"""

import configparser
import pathlib
import re

import pytest

from tests.helpers import printed_in_forked_python, printed_in_fresh_python

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


# keras_stage's modules that need Keras. (`_compat` is shared: it imports
# Keras only inside the functions that need it.)
_KERAS_HALF = (
    "keras_stage.callbacks",
    "keras_stage.layers",
    "keras_stage.models",
    "keras_stage.planner",
)


@pytest.mark.timeout(120)
def test_the_engine_imports_and_runs_without_keras():
    # Keras blocked: TensorFlow then skips its own eager import of Keras's
    # optimizers, so only keras_stage could bring Keras in, and must not.
    code = (
        "import sys; sys.modules['keras'] = None\n"
        "import tensorflow as tf\n"
        "import keras_stage.data\n"
        "staged = keras_stage.data.stage(\n"
        "    tf.data.Dataset.range(6).batch(2), lambda x: x * 2, capacity=2)\n"
        "print([int(v) for batch in staged for v in batch])\n"
        "staged.close()\n"
        f"print(sorted(m for m in {_KERAS_HALF!r} if m in sys.modules))\n"
    )
    out = printed_in_fresh_python(code).splitlines()
    assert out[-2] == "[0, 2, 4, 6, 8, 10]"
    assert out[-1] == "[]"


@pytest.mark.timeout(120)
def test_importing_the_engine_loads_none_of_the_keras_half():
    # Keras installed (TensorFlow itself imports part of it): keras_stage
    # loads none of its own modules that need it.
    code = (
        "import sys\n"
        "import keras_stage.data\n"
        f"print(sorted(m for m in {_KERAS_HALF!r} if m in sys.modules))\n"
        "print(sorted(m for m in sys.modules if m.startswith('keras_stage.')"
        " and not m.startswith(('keras_stage.data', 'keras_stage._compat'))))\n"
    )
    assert printed_in_forked_python(code).splitlines()[-2:] == ["[]", "[]"]


@pytest.mark.timeout(120)
def test_import_keras_stage_gives_the_whole_package():
    code = (
        "import sys\n"
        "import keras_stage\n"
        f"print(sorted(m for m in {_KERAS_HALF!r} if m not in sys.modules))\n"
        "print(keras_stage.Model.__module__, keras_stage.Sequential.__name__)\n"
        "print(keras_stage.layers.StagedInput.__name__,"
        " keras_stage.callbacks.PrefetchCallback.__name__,"
        " keras_stage.StagePlan.__name__)\n"
        "print(sorted(set(keras_stage.__all__) - set(dir(keras_stage))))\n"
        "from keras_stage import Model, layers\n"
        "print(Model is keras_stage.models.Model)\n"
    )
    assert printed_in_forked_python(code).splitlines()[-5:] == [
        "[]",
        "keras_stage.models.model Sequential",
        "StagedInput PrefetchCallback StagePlan",
        "[]",
        "True",
    ]


@pytest.mark.timeout(120)
def test_after_the_engine_alone_the_keras_names_load_on_first_use():
    code = (
        "import keras_stage.data\n"
        "import keras_stage\n"
        "print(keras_stage.Model.__module__)\n"
        "print(keras_stage.layers.StagedInput.__name__)\n"
    )
    assert printed_in_forked_python(code).splitlines()[-2:] == [
        "keras_stage.models.model",
        "StagedInput",
    ]


def test_an_unknown_name_is_an_attribute_error():
    import keras_stage

    with pytest.raises(AttributeError, match="no attribute 'Modle'"):
        keras_stage.Modle  # noqa: B018


@pytest.mark.timeout(180)
def test_a_saved_model_loads_in_a_script_that_imports_keras_stage(tmp_path):
    # A serving script: `import keras_stage` registers the classes that
    # `load_model` looks up; the script uses no keras_stage name itself.
    # Saved here: only the loading needs a process of its own.
    import keras

    import keras_stage

    path = tmp_path / "model.keras"
    inputs = keras.Input((2,))
    x = keras_stage.layers.StagedInput()(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(loss="mse", smart_stage=True)
    model.save(path)
    code = (
        "import keras\n"
        "import keras_stage  # noqa: F401\n"
        f"model = keras.saving.load_model({str(path)!r})\n"
        "print(type(model).__module__, model.layers[1].__class__.__name__)\n"
    )
    assert printed_in_forked_python(code).splitlines()[-1] == (
        "keras_stage.models.model StagedInput"
    )
