"""Devices of a stage: where its buffer lives and which GPU stream it uses."""

import logging
import shutil
import subprocess
import warnings

import tensorflow as tf

logger = logging.getLogger("keras_stage")

_AUTO = "auto"
_HOST = "cpu"
_DEVICE_FORMS = (
    '"auto", "cpu" or a TensorFlow device string with a type and an index '
    'such as "/GPU:0", "gpu:1" or "/job:localhost/replica:0/task:0/device:'
    'GPU:0"'
)
_FIX_STREAMS = (
    "Call keras_stage.configure_streams(...) at the start of the program, "
    "before any TensorFlow op or model is created."
)
_warned = set()  # keys of the warnings given: each once per process


def _warn_once(key, message):
    if key in _warned:
        return
    _warned.add(key)
    # Past this function, the internal one and the public one: the caller.
    warnings.warn(message, stacklevel=4)
    logger.warning(message)


def _physical_devices(device_type: str) -> list:
    """Visible devices of `device_type` (tests run GPU paths on CPUs)."""
    return tf.config.get_visible_devices(device_type)


def _is_int(value, minimum):
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= minimum
    )


def _parse_device(device, name):
    """The `tf.DeviceSpec` of an explicit device string."""
    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError:
        spec = None
    if (
        spec is None
        or spec.device_type is None
        or not _is_int(spec.device_index, 0)
    ):
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected {_DEVICE_FORMS}. "
            f"Received: {name}={device!r}"
        )
    return spec


def _check_device(device, name):
    if not isinstance(device, str):
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected {_DEVICE_FORMS}. "
            f"Received: {name}={device!r}"
        )
    if device.lower() not in (_AUTO, _HOST):
        _parse_device(device, name)
    return device


def validate_device_argument(device):
    """`device` if it has a form of `_DEVICE_FORMS`, else `ValueError`; the
    devices are not initialised (`resolve_device` checks they exist).

    Example:

    >>> validate_device_argument("gpu:1")
    'gpu:1'
    >>> validate_device_argument("/GPU")
    Traceback (most recent call last):
        ...
    ValueError: Invalid value for argument `device`. ... Received: device='/GPU'
    """
    return _check_device(device, "device")


def _same_task(wanted, found):
    # A local context's logical devices name no job: localhost, task 0.
    local = {"job": "localhost", "replica": 0, "task": 0}
    for part, default in local.items():
        want = getattr(wanted, part)
        have = getattr(found, part)
        if want is not None and want != (default if have is None else have):
            return False
    return True


def _find_logical_device(device, name):
    spec = _parse_device(device, name)
    logical = tf.config.list_logical_devices()
    for candidate in logical:
        found = tf.DeviceSpec.from_string(candidate.name)
        if (
            found.device_type == spec.device_type
            and found.device_index == spec.device_index
            and _same_task(spec, found)
        ):
            return candidate.name
    names = [d.name for d in logical]
    raise ValueError(
        f'Invalid value for argument `{name}`. Expected "auto", "cpu" or '
        f"a device that exists; TensorFlow sees {names}. "
        f"Received: {name}={device!r}"
    )


def _resolve_device(device, device_type="GPU", name="device"):
    _check_device(device, name)
    if device.lower() == _HOST:
        return None
    if device.lower() == _AUTO:
        if not _physical_devices(device_type):
            return None
        logical = tf.config.list_logical_devices(device_type)
        return logical[0].name if logical else None
    spec = _parse_device(device, name)
    if spec.device_type == device_type and not _physical_devices(device_type):
        _warn_once(
            ("no_device", device_type),
            f"{name}={device!r} asks for a {device_type}, but TensorFlow "
            f"sees no {device_type}: the stage's buffer stays on the host.",
        )
        return None
    return _find_logical_device(device, name)


def resolve_device(device):
    """The full name of the device a stage's buffer lives on, or None for the
    host: `device` is `"auto"` (the first logical GPU, or the host without
    one), `"cpu"` or a device string such as `"/GPU:1"`. Warns for a GPU on
    a machine without one; `ValueError` for another form or a missing device.

    Example:

    >>> resolve_device("cpu") is None
    True
    >>> resolve_device("/cpu:0")
    '/device:CPU:0'
    """
    return _resolve_device(device, "GPU", "device")


def _parse_free_memory_mb(text):
    """The smallest free memory (MiB) in `nvidia-smi` CSV output, or None."""
    values = []
    for line in text.splitlines():
        if line.strip():
            try:
                values.append(int(float(line.strip())))
            except ValueError:
                return None
    return min(values) if values else None


def _free_gpu_memory_mb():
    """The least free memory (MiB) of any GPU, from nvidia-smi, or None."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    try:
        out = subprocess.run(
            [
                nvidia_smi,
                "--query-gpu=memory.free",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return _parse_free_memory_mb(out)


def _reserved_memory_mb(free_mb, compute_capability):
    """Memory TensorFlow leaves to CUDA on a GPU it uses whole (its
    `MinSystemMemory`, not applied to logical GPUs with explicit limits)."""
    if free_mb < 2048:
        return 225
    major = compute_capability[0] if compute_capability else None
    if major is None:
        return 1800
    if major <= 6:
        return 500
    if major <= 7:
        return 1050
    if major <= 8:
        return 1536
    return 1800


def _split_memory_mb(free_mb, num_streams, compute_capabilities):
    reserve = max(
        _reserved_memory_mb(free_mb, cc) for cc in compute_capabilities
    )
    return (free_mb - reserve) // num_streams


def _default_memory_limit_mb(devices, num_streams):
    """Memory of each logical GPU: the least free memory of any GPU (from
    nvidia-smi), less what TensorFlow leaves to CUDA, split evenly."""
    free_mb = _free_gpu_memory_mb()
    limit = None
    if free_mb is not None:
        capabilities = [
            tf.config.experimental.get_device_details(d).get(
                "compute_capability"
            )
            for d in devices
        ]
        limit = _split_memory_mb(free_mb, num_streams, capabilities)
    if limit is None or limit < 1:
        found = (
            "could not be read (nvidia-smi is unavailable)"
            if free_mb is None
            else f"is {free_mb} MB, too little to split"
        )
        raise ValueError(
            "Invalid value for argument `memory_limit_mb`. Expected the MB "
            "of memory for each logical GPU: TensorFlow needs one for every "
            f"logical GPU, and the GPUs' free memory {found}. Pass it, e.g. "
            f"configure_streams({num_streams}, memory_limit_mb=4096). "
            "Received: memory_limit_mb=None"
        )
    return limit


def _logical_counts(devices):
    """Logical devices configured on each of `devices`."""
    return [
        len(tf.config.get_logical_device_configuration(d) or [None])
        for d in devices
    ]


def _configure_streams(num_streams, memory_limit_mb=None, device_type="GPU"):
    if not _is_int(num_streams, 1):
        raise ValueError(
            "Invalid value for argument `num_streams`. Expected a positive "
            f"int (1 leaves each GPU whole). Received: num_streams="
            f"{num_streams!r}"
        )
    if memory_limit_mb is not None and not _is_int(memory_limit_mb, 1):
        raise ValueError(
            "Invalid value for argument `memory_limit_mb`. Expected a "
            "positive int (MB of memory for each logical GPU) or None. "
            f"Received: memory_limit_mb={memory_limit_mb!r}"
        )
    devices = _physical_devices(device_type)
    if not devices:
        if num_streams > 1 or memory_limit_mb is not None:
            _warn_once(
                ("no_streams", device_type),
                f"configure_streams({num_streams}) changes nothing: "
                f"TensorFlow sees no {device_type}, and staged work runs on "
                "the host.",
            )
        return 0
    if num_streams == 1 and memory_limit_mb is None:
        return min(_logical_counts(devices))
    # A repeated call must not re-read the free memory TensorFlow holds.
    todo = [
        d
        for d in devices
        if memory_limit_mb is not None
        or len(tf.config.get_logical_device_configuration(d) or ())
        != num_streams
    ]
    if todo:
        if device_type == "GPU":
            limit = memory_limit_mb or _default_memory_limit_mb(
                devices, num_streams
            )
            config = tf.config.LogicalDeviceConfiguration(memory_limit=limit)
        else:
            # TensorFlow rejects memory limits on logical CPUs.
            config = tf.config.LogicalDeviceConfiguration()
        for device in todo:
            try:
                tf.config.set_logical_device_configuration(
                    device, [config] * num_streams
                )
            except RuntimeError as e:
                raise RuntimeError(
                    f"configure_streams({num_streams}) came too late: "
                    "TensorFlow has already initialised its devices, and "
                    f"they cannot be split any more. {_FIX_STREAMS}"
                ) from e
    return min(_logical_counts(devices))


def configure_streams(num_streams, memory_limit_mb=None):
    """Gives every GPU `num_streams` streams for staged work (MultiStream).

    Splits each physical GPU into `num_streams` logical GPUs (each has its
    own CUDA streams): the training step runs on the first (stream 0), a
    stage with `stream=k` on the k-th. Call it at the very start of the
    program, before TensorFlow initialises its devices.

    Args:
        num_streams: Logical GPUs per physical GPU: a positive int. `1`
            leaves the GPUs whole (no change).
        memory_limit_mb: MB of GPU memory for each logical GPU. Defaults to
            `None`: the GPUs' free memory (nvidia-smi) split evenly.

    Returns:
        The logical GPUs per physical GPU now configured, or 0 without a
        GPU (with a warning).

    Raises:
        ValueError: for an invalid argument, or when the free memory cannot
            be read and `memory_limit_mb` is None.
        RuntimeError: if TensorFlow has already initialised its devices.

    Example:

    >>> import keras_stage
    >>> keras_stage.configure_streams(2)  # doctest: +SKIP
    2
    """
    return _configure_streams(num_streams, memory_limit_mb, "GPU")


def _stream_device(stream, base_device, device_type="GPU"):
    if not _is_int(stream, 0):
        raise ValueError(
            "Invalid value for argument `stream`. Expected a non-negative "
            "int (a stream made by keras_stage.configure_streams). "
            f"Received: stream={stream!r}"
        )
    devices = _physical_devices(device_type)
    if not devices:
        if stream > 0:
            _warn_once(
                ("no_stream_device", device_type),
                f"stream={stream} asks for a {device_type} stream, but "
                f"TensorFlow sees no {device_type}: staged work runs on the "
                "default device.",
            )
        return None
    base = None
    if base_device is not None:
        base = _resolve_device(base_device, device_type, "base_device")
    base_spec = None if base is None else tf.DeviceSpec.from_string(base)
    if base_spec is None or base_spec.device_type != device_type:
        if stream > 0:
            _warn_once(
                ("stream_off_device", device_type),
                f"stream={stream} is ignored: the stage is not on a "
                f"{device_type} (base_device={base_device!r}), and streams "
                f"are {device_type} streams.",
            )
        return None
    counts = _logical_counts(devices)
    logical = {
        tf.DeviceSpec.from_string(d.name).device_index: d.name
        for d in tf.config.list_logical_devices(device_type)
    }
    if len(logical) != sum(counts):
        # TensorFlow skipped a GPU it cannot use: the numbering is unknown.
        _warn_once(
            ("stream_unmapped", device_type),
            f"stream={stream} is ignored: TensorFlow made {len(logical)} "
            f"logical {device_type}s from {len(devices)} physical ones "
            f"configured for {sum(counts)}, so streams cannot be mapped.",
        )
        return None
    # Logical devices are numbered physical device by physical device.
    first = 0
    for count in counts:
        if base_spec.device_index < first + count:
            break
        first += count
    if stream >= count:
        if count == 1:
            _warn_once(
                ("streams_not_configured", device_type),
                f"stream={stream} is ignored: each {device_type} has one "
                f"stream. {_FIX_STREAMS}",
            )
            return None
        raise ValueError(
            "Invalid value for argument `stream`. Expected a stream below "
            f"{count}, the logical {device_type}s per physical "
            f"{device_type} made by configure_streams. "
            f"Received: stream={stream!r}"
        )
    return logical[first + stream]


def stream_device(stream, base_device=None):
    """The logical GPU running a stage's staged work on stream `stream` (of
    those `configure_streams` made) of `base_device`'s physical GPU, or None
    for the default device (with a warning when `stream > 0` cannot be
    honoured). `ValueError` for a stream not configured.

    Example:

    >>> stream_device(0, base_device=None) is None
    True
    """
    return _stream_device(stream, base_device, "GPU")
