"""Tests of `keras_stage.data.devices`: device resolution and MultiStream.

Device configuration must happen before TensorFlow initialises and must not
leak into the rest of the session, and warnings are given once per process,
so those tests run in a process of their own each (forked from one that
imported TensorFlow, before any op ran). The GPU code paths run there on
logical CPU devices: the internals take the device type the public
functions fix to "GPU", and TensorFlow really splits the CPU.
"""

import json
import logging
import os
import re
import textwrap
import warnings

import pytest
import tensorflow as tf

from keras_stage.data import devices
from keras_stage.data.devices import (
    configure_streams,
    resolve_device,
    stream_device,
    validate_device_argument,
)
from tests.helpers import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
needs_no_gpu = pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU paths")

# Imports first, so only warnings of the code under test are recorded; the
# "always" filter counts keras_stage's own once-per-process logic.
_PRELUDE = """
import json, logging, warnings
import tensorflow as tf
from keras_stage.data import devices
from keras_stage.data.devices import (
    configure_streams, resolve_device, stream_device)

logged = []

class _Records(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())

logging.getLogger("keras_stage").addHandler(_Records())
_catch = warnings.catch_warnings(record=True)
caught = _catch.__enter__()
warnings.simplefilter("always")

def names(device_type=None):
    return [d.name for d in tf.config.list_logical_devices(device_type)]

def error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (ValueError, RuntimeError) as e:
        cause = e.__cause__
        return [type(e).__name__, str(e), repr(cause)]
    return None

def report(**result):
    result["warnings"] = [
        [w.category.__name__, str(w.message), w.filename] for w in caught]
    result["logged"] = logged
    print(json.dumps(result))
"""


def _run(code):
    """Runs `code` in a process of its own; returns what `report` printed.

    The process is forked from one that imported TensorFlow (not
    keras_stage) and ran no op: its devices are not initialised yet.
    """
    out = run_forked(
        ["-c"],
        code=_PRELUDE + textwrap.dedent(code),
        cwd=ROOT,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _user_warnings(result):
    return [m for c, m, _ in result["warnings"] if c == "UserWarning"]


# -- forms, checked without TensorFlow's device list ------------------------


@pytest.mark.parametrize(
    "device",
    [
        "auto",
        "cpu",
        "AUTO",
        "CPU",
        "/GPU:0",
        "gpu:1",
        "GPU:1",
        "/device:GPU:1",
        "/job:localhost/replica:0/task:0/device:GPU:0",
        "/CPU:1",
        "/TPU:0",
    ],
)
def test_validate_device_argument_accepts_forms(device):
    assert validate_device_argument(device) == device


@pytest.mark.parametrize(
    "device",
    [None, 0, b"/GPU:0", "banana", "", "/GPU", "GPU:-1", "/cpu:0/gpu:1"],
)
def test_bad_device_forms_name_the_argument(device):
    match = (
        r"Invalid value for argument `device`\. Expected \"auto\", \"cpu\" "
        rf"or .*\"/GPU:0\".*Received: device={re.escape(repr(device))}"
    )
    with pytest.raises(ValueError, match=match):
        validate_device_argument(device)
    with pytest.raises(ValueError, match=match):
        resolve_device(device)


@needs_no_gpu
def test_auto_and_cpu_resolve_to_the_host_silently(caplog):
    with caplog.at_level(logging.DEBUG, logger="keras_stage"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for device in ("auto", "cpu", "Auto", "CPU"):
                assert resolve_device(device) is None
    assert [str(w.message) for w in caught] == []
    assert [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
    ] == []


@pytest.mark.parametrize("num_streams", [0, -1, 1.5, True, "2", None])
def test_configure_streams_needs_a_positive_int(num_streams):
    with pytest.raises(
        ValueError,
        match=(
            r"Invalid value for argument `num_streams`\. Expected a positive "
            rf"int .*Received: num_streams={re.escape(repr(num_streams))}"
        ),
    ):
        configure_streams(num_streams)


@pytest.mark.parametrize("limit", [0, -5, 1.5, True, "4096"])
def test_configure_streams_needs_a_positive_memory_limit(limit):
    with pytest.raises(
        ValueError,
        match=(
            r"Invalid value for argument `memory_limit_mb`\. Expected a "
            r"positive int .*Received: "
            rf"memory_limit_mb={re.escape(repr(limit))}"
        ),
    ):
        configure_streams(2, memory_limit_mb=limit)


@pytest.mark.parametrize("stream", [-1, 1.5, True, "1", None])
def test_stream_device_needs_a_non_negative_int(stream):
    with pytest.raises(
        ValueError,
        match=(
            r"Invalid value for argument `stream`\. Expected a non-negative "
            rf"int .*Received: stream={re.escape(repr(stream))}"
        ),
    ):
        stream_device(stream, "/GPU:0")


# -- memory of each logical GPU ----------------------------------------------


def test_free_memory_is_the_smallest_nvidia_smi_reports():
    assert devices._parse_free_memory_mb("15360\n 7000\n\n") == 7000
    assert devices._parse_free_memory_mb("") is None
    assert devices._parse_free_memory_mb("[N/A]\n") is None


def test_memory_split_leaves_what_tensorflow_leaves_to_cuda():
    # TensorFlow's MinSystemMemory: 225 MB under 2 GB free, else by the
    # compute capability's major version; unknown takes the largest.
    assert devices._split_memory_mb(16000, 2, [(8, 0)]) == (16000 - 1536) // 2
    assert devices._split_memory_mb(16000, 4, [(7, 5)]) == (16000 - 1050) // 4
    assert devices._split_memory_mb(16000, 2, [(6, 1)]) == (16000 - 500) // 2
    assert devices._split_memory_mb(16000, 2, [(9, 0)]) == (16000 - 1800) // 2
    assert devices._split_memory_mb(16000, 2, [None]) == (16000 - 1800) // 2
    assert devices._split_memory_mb(1800, 3, [(8, 6)]) == (1800 - 225) // 3
    # GPUs of different kinds: the largest reserve, so every GPU fits.
    assert devices._split_memory_mb(9000, 2, [(6, 0), (8, 0)]) == 3732


def test_memory_limit_is_asked_for_when_free_memory_is_unknown(
    monkeypatch, tmp_path
):
    # A PATH without nvidia-smi: the free memory cannot be read.
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        ValueError,
        match=(
            r"Invalid value for argument `memory_limit_mb`\. .*nvidia-smi is "
            r"unavailable\)\. Pass it, e\.g\. configure_streams\(3, "
            r"memory_limit_mb=4096\)\. Received: memory_limit_mb=None"
        ),
    ):
        devices._default_memory_limit_mb(
            tf.config.list_physical_devices("CPU"), 3
        )


# -- resolve_device, in a fresh process --------------------------------------


@needs_no_gpu
@pytest.mark.timeout(120)
def test_explicit_gpu_without_gpu_warns_once_and_stays_on_host():
    result = _run(
        """
        found = [resolve_device(d) for d in (
            "/GPU:0", "/GPU:0", "gpu:1", "/GPU:7",
            "/job:localhost/replica:0/task:0/device:GPU:0")]
        report(found=found, auto=resolve_device("auto"))
        """
    )
    assert result["found"] == [None] * 5
    assert result["auto"] is None
    message = (
        "device='/GPU:0' asks for a GPU, but TensorFlow sees no GPU: the "
        "stage's buffer stays on the host."
    )
    assert _user_warnings(result) == [message]
    # The warning points at the caller, not at keras_stage.
    assert result["warnings"][0][2] == "<string>"
    assert result["logged"] == [message]


@pytest.mark.timeout(120)
def test_explicit_devices_resolve_to_logical_names():
    result = _run(
        """
        cpu, = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        forms = ["/CPU:1", "cpu:1", "/device:CPU:1",
                 "/job:localhost/replica:0/task:0/device:CPU:1", "/CPU:0"]
        bad = ["/CPU:3", "/TPU:0", "/job:worker/replica:0/task:0/device:CPU:0"]
        report(
            found=[resolve_device(d) for d in forms],
            errors=[error(resolve_device, d) for d in bad],
            logical=names(),
        )
        """
    )
    assert result["logical"] == ["/device:CPU:0", "/device:CPU:1"]
    assert result["found"] == ["/device:CPU:1"] * 4 + ["/device:CPU:0"]
    bad_devices = [
        "/CPU:3",
        "/TPU:0",
        "/job:worker/replica:0/task:0/device:CPU:0",
    ]
    for (kind, message, _), bad in zip(
        result["errors"], bad_devices, strict=True
    ):
        assert kind == "ValueError"
        assert message == (
            'Invalid value for argument `device`. Expected "auto", "cpu" '
            "or a device that exists; TensorFlow sees ['/device:CPU:0', "
            f"'/device:CPU:1']. Received: device='{bad}'"
        )
    assert result["warnings"] == [] and result["logged"] == []


# -- configure_streams, in a fresh process -----------------------------------


@needs_no_gpu
@pytest.mark.timeout(120)
def test_configure_streams_without_gpu_warns_once_and_changes_nothing():
    result = _run(
        """
        cpu, = tf.config.list_physical_devices("CPU")
        report(
            returned=[configure_streams(2),
                      configure_streams(4, memory_limit_mb=1000),
                      configure_streams(1)],
            config=repr(tf.config.get_logical_device_configuration(cpu)),
            logical=names(),
        )
        """
    )
    assert result["returned"] == [0, 0, 0]
    assert result["config"] == "None"
    assert result["logical"] == ["/device:CPU:0"]
    message = (
        "configure_streams(2) changes nothing: TensorFlow sees no GPU, and "
        "staged work runs on the host."
    )
    assert _user_warnings(result) == [message]
    assert result["logged"] == [message]


@pytest.mark.timeout(120)
def test_configure_streams_splits_each_device_and_rejects_late_changes():
    # The GPU code path, on the one physical CPU.
    result = _run(
        """
        first = devices._configure_streams(3, device_type="CPU")
        logical = names("CPU")
        with tf.device(logical[2]):
            placed = (tf.constant(1) + 1).device
        again = devices._configure_streams(3, device_type="CPU")
        late = error(devices._configure_streams, 2, device_type="CPU")
        report(first=first, logical=logical, placed=placed, again=again,
               late=late, after=names("CPU"))
        """
    )
    assert result["first"] == 3
    assert result["logical"] == [f"/device:CPU:{i}" for i in range(3)]
    assert result["placed"].endswith("/device:CPU:2")
    # The same split again is a no-op, even once TensorFlow is running.
    assert result["again"] == 3
    kind, message, cause = result["late"]
    assert kind == "RuntimeError"
    assert message == (
        "configure_streams(2) came too late: TensorFlow has already "
        "initialised its devices, and they cannot be split any more. Call "
        "keras_stage.configure_streams(...) at the start of the program, "
        "before any TensorFlow op or model is created."
    )
    assert "Virtual devices cannot be modified" in cause
    assert result["after"] == result["logical"]
    assert result["warnings"] == [] and result["logged"] == []


@pytest.mark.timeout(120)
def test_configure_streams_after_tensorflow_started_names_the_fix():
    result = _run(
        """
        one = devices._configure_streams(1, device_type="CPU")
        tf.constant(1.0) * 2  # TensorFlow initialises its devices here.
        late = error(devices._configure_streams, 2, device_type="CPU")
        report(one=one, late=late, logical=names("CPU"))
        """
    )
    # One stream leaves the device whole.
    assert result["one"] == 1
    assert result["logical"] == ["/device:CPU:0"]
    kind, message, _ = result["late"]
    assert kind == "RuntimeError"
    assert "at the start of the program, before any TensorFlow op" in message


# -- stream_device, in a fresh process ---------------------------------------


@pytest.mark.timeout(120)
def test_stream_device_maps_streams_to_logical_devices():
    result = _run(
        """
        devices._configure_streams(3, device_type="CPU")
        def on(stream, base):
            return devices._stream_device(stream, base, device_type="CPU")
        mapped = [on(0, "/CPU:0"), on(1, "/CPU:0"), on(2, "/CPU:0"),
                  on(2, "auto"), on(2, "/CPU:1"), on(0, "/device:CPU:2")]
        with tf.device(on(1, "/CPU:0")):
            placed = (tf.constant(1) + 1).device
        report(
            mapped=mapped,
            placed=placed,
            too_far=error(on, 3, "/CPU:0"),
            missing_base=error(on, 1, "/CPU:5"),
            host=[on(0, None), on(1, None), on(2, None), on(1, "cpu")],
        )
        """
    )
    # Stream k of the (only) physical device is its k-th logical device,
    # whichever of its logical devices the stage names.
    assert result["mapped"] == [
        "/device:CPU:0",
        "/device:CPU:1",
        "/device:CPU:2",
        "/device:CPU:2",
        "/device:CPU:2",
        "/device:CPU:0",
    ]
    assert result["placed"].endswith("/device:CPU:1")
    assert result["too_far"][:2] == [
        "ValueError",
        "Invalid value for argument `stream`. Expected a stream below 3, the "
        "logical CPUs per physical CPU made by configure_streams. "
        "Received: stream=3",
    ]
    assert result["missing_base"][0] == "ValueError"
    assert "Received: base_device='/CPU:5'" in result["missing_base"][1]
    # A stage on the host has no stream: one warning for all such calls.
    assert result["host"] == [None] * 4
    message = (
        "stream=1 is ignored: the stage is not on a CPU (base_device=None), "
        "and streams are CPU streams."
    )
    assert _user_warnings(result) == [message]
    assert result["logged"] == [message]


@pytest.mark.timeout(120)
def test_stream_device_warns_once_when_streams_are_not_configured():
    result = _run(
        """
        def on(stream, base):
            return devices._stream_device(stream, base, device_type="CPU")
        report(mapped=[on(0, "/CPU:0"), on(1, "/CPU:0"), on(1, "/CPU:0"),
                       on(2, "auto")], logical=names("CPU"))
        """
    )
    assert result["logical"] == ["/device:CPU:0"]
    assert result["mapped"] == ["/device:CPU:0", None, None, None]
    message = (
        "stream=1 is ignored: each CPU has one stream. Call "
        "keras_stage.configure_streams(...) at the start of the program, "
        "before any TensorFlow op or model is created."
    )
    assert _user_warnings(result) == [message]
    assert result["logged"] == [message]


@needs_no_gpu
@pytest.mark.timeout(120)
def test_stream_device_without_gpu_warns_once():
    result = _run(
        """
        report(mapped=[stream_device(0, None), stream_device(0, "/GPU:0"),
                       stream_device(1, None), stream_device(2, "/GPU:0"),
                       stream_device(1, "auto")])
        """
    )
    assert result["mapped"] == [None] * 5
    message = (
        "stream=1 asks for a GPU stream, but TensorFlow sees no GPU: staged "
        "work runs on the default device."
    )
    assert _user_warnings(result) == [message]
    assert result["logged"] == [message]
