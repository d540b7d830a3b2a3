"""tensorflow-io that cannot load its ops fails with a clear error.

The primary environment has tensorflow-io 0.37.1 installed on TensorFlow
2.21 (requirements/primary.txt), where its native ops do not load: these
tests check that real "undefined symbol" failure, not a simulated one.
Where tfio's ops do load (the io environment, TF 2.16) they are skipped;
tests/io_env_test.py covers that side.
"""

import importlib.util
import io
import os
import re
import struct
import sys
import wave

import keras
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.data.tfio_support import (
    WORKING_PAIRING,
    explain_tfio_error,
    require_tensorflow_io,
)
from tests.helpers import printed_in_forked_python, run_forked

# tensorflow-io 0.37.1 is built for TensorFlow 2.16.
where_ops_do_not_load = pytest.mark.skipif(
    tf.__version__.startswith("2.16."),
    reason="tensorflow-io 0.37.1's ops load on TensorFlow 2.16",
)
# Importing tfio into TensorFlow 2.21 leaves this process's TensorFlow
# broken (a later MirroredStrategy test failed), so the tests that import
# it run in a fresh process: test_import_cases_in_a_fresh_process.
_CHILD = "KERAS_STAGE_TFIO_CHILD"
in_a_fresh_process = pytest.mark.skipif(
    os.environ.get(_CHILD) != "1",
    reason="imports tensorflow-io: run by test_import_cases_in_a_fresh_process",
)


def _tfio():
    assert importlib.util.find_spec("tensorflow_io") is not None, (
        "tensorflow-io==0.37.1 is pinned in requirements/primary.txt: "
        "rebuild the environment with `make venv`"
    )
    import tensorflow_io

    return tensorflow_io


def _wav(samples=(1, 2, 3, 4)):
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(8000)
        f.writeframes(struct.pack(f"<{len(samples)}h", *samples))
    return buffer.getvalue()


@where_ops_do_not_load
@pytest.mark.timeout(120)
def test_require_names_versions_and_pairing_without_importing_tfio():
    assert importlib.util.find_spec("tensorflow_io") is not None, (
        "tensorflow-io==0.37.1 is pinned in requirements/primary.txt: "
        "rebuild the environment with `make venv`"
    )
    imported = "tensorflow_io" in sys.modules
    expected = (
        rf"tensorflow-io 0\.37\.1's ops do not load on TensorFlow "
        rf"{re.escape(tf.__version__)}: it is built for TensorFlow 2\.16 "
        r"\(not imported.*"
        rf"{re.escape(WORKING_PAIRING)}.*`make venv-io`"
    )
    with pytest.raises(ImportError, match=expected):
        require_tensorflow_io()
    assert ("tensorflow_io" in sys.modules) == imported
    # The failure is not cached away: a second call raises it again.
    with pytest.raises(ImportError, match=expected):
        require_tensorflow_io()


@where_ops_do_not_load
@pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="the child itself")
@pytest.mark.timeout(600)
def test_import_cases_in_a_fresh_process():
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    # `python -m pytest` in a process of its own, forked from one that
    # imported TensorFlow (not tensorflow-io): what tensorflow-io's import
    # does to TensorFlow stays there.
    done = run_forked(
        ["-m", "-q", "-p", "no:randomly", __file__],
        module="pytest",
        cwd=root,
        env={_CHILD: "1"},
        timeout=580,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    # Every case ran there (the two that import tfio included); only this
    # test skipped itself.
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\b5 passed, 1 skipped\b", summary), summary


@where_ops_do_not_load
@in_a_fresh_process
@pytest.mark.timeout(120)
def test_explain_names_the_real_failure_of_a_tfio_op():
    tfio = _tfio()
    with pytest.raises(NotImplementedError, match="undefined symbol") as op:
        tfio.audio.decode_wav(_wav(), dtype=tf.int16)
    message = explain_tfio_error(op.value)
    expected = (
        rf"tensorflow-io 0\.37\.1's ops do not load on TensorFlow "
        rf"{re.escape(tf.__version__)}.*Underlying error: "
        r"NotImplementedError: unable to open file: libtensorflow_io\.so"
        r".*\(undefined symbol: \w+\).*"
        rf"{re.escape(WORKING_PAIRING)}.*`make venv-io`"
    )
    assert re.search(expected, message), message


def _decode_wavs(batch):
    import tensorflow_io as tfio

    def one(contents):
        audio = tfio.audio.decode_wav(contents, dtype=tf.int16)[:, 0]
        return tf.cast(audio, tf.float32)

    return tf.map_fn(
        one, batch, fn_output_signature=tf.TensorSpec([4], tf.float32)
    )


@where_ops_do_not_load
@in_a_fresh_process
@pytest.mark.timeout(300)
def test_a_keras_fit_stops_at_the_tfio_failure_naming_the_pairing():
    _tfio()
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput(capacity=2, num_threads=2)(inputs)
    x = keras.layers.Lambda(_decode_wavs, output_shape=(4,), name="decode")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    data = tf.data.Dataset.from_tensor_slices(
        ([_wav()] * 4, [[1.0]] * 4)
    ).batch(2)
    # The planner's trace of the decode layer hits tfio's load failure
    # and stops the fit there, with the pairing that works.
    with pytest.raises(ImportError) as info:
        model.fit(data, epochs=1, shuffle=False, verbose=0)
    message = str(info.value)
    assert "could not trace layer 'decode'" in message
    assert "Underlying error: NotImplementedError: unable to open file" in (
        message
    )
    assert WORKING_PAIRING in message
    assert isinstance(info.value.__cause__, NotImplementedError)
    # Keras's own wrapping of the same failure is explained too.
    assert explain_tfio_error(info.value.__cause__) is not None


@pytest.mark.timeout(60)
def test_explain_ignores_other_errors():
    assert explain_tfio_error(ValueError("Invalid value for `x`")) is None
    try:
        try:
            raise KeyError("libtensorflow_io.so is fine")
        except KeyError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        assert explain_tfio_error(e) is None


@pytest.mark.timeout(120)
def test_missing_tensorflow_io_names_the_pairing():
    # sys.modules[name] = None makes `import name` raise ImportError.
    code = (
        "import sys; sys.modules['tensorflow_io'] = None\n"
        "from keras_stage.data.tfio_support import require_tensorflow_io\n"
        "try:\n"
        "    require_tensorflow_io()\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = printed_in_forked_python(code)
    assert f"tensorflow-io is not installed (TensorFlow {tf.__version__})" in (
        out
    )
    assert "Underlying error: ModuleNotFoundError: import of tensorflow_io" in (
        out
    )
    assert WORKING_PAIRING in out
    assert "`make venv-io`" in out
