"""tensorflow-io support: a clear error where its ops do not load, and readers.

Each tensorflow-io release's native ops fit one TensorFlow minor version:
the errors name the pairing that works.
"""

import functools
import importlib.metadata
import importlib.util
import io
import re
import wave

import tensorflow as tf

__all__ = [
    "WORKING_PAIRING",
    "explain_tfio_error",
    "read_hdf5",
    "read_parquet",
    "require_tensorflow_io",
]

# The pairing the `io` environment (requirements/io.txt) is tested on.
WORKING_PAIRING = "tensorflow-cpu==2.16.2 + tensorflow-io==0.37.1 + numpy<2"
_INSTALL = 'pip install tensorflow-cpu==2.16.2 tensorflow-io==0.37.1 "numpy<2"'
_FIX = (
    f"The working pairing is {WORKING_PAIRING}: build it with `make "
    f"venv-io` in a keras_stage checkout, or install it with `{_INSTALL}`."
)
# Signs in an error that tfio's shared library did not load.
_LOAD_FAILURE_SIGNS = (
    "undefined symbol",
    "unable to open file",
    "cannot open shared object file",
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_UNDEFINED_SYMBOL = re.compile(r"undefined symbol: [^'\"\]\s,]+")


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _message(error, installed=True):
    """The clear message for `error`, the failure to load tfio's ops."""
    text = _ANSI.sub("", str(error)).strip()
    lines = text.splitlines() or [""]
    # The line naming the library (Keras may put its own line first).
    first = next((line for line in lines if "libtensorflow_io" in line), None)
    first = (first or lines[0]).strip()
    symbol = _UNDEFINED_SYMBOL.search(text)
    detail = f"{type(error).__name__}: {first}"
    if symbol and symbol.group(0) not in first:
        detail += f" ({symbol.group(0)})"
    tf_version = f"TensorFlow {tf.__version__}"
    if not installed:
        problem = f"tensorflow-io is not installed ({tf_version})"
    else:
        tfio_version = _version("tensorflow-io") or "(unknown version)"
        problem = (
            f"tensorflow-io {tfio_version}'s ops do not load on "
            f"{tf_version}: each tensorflow-io release is built for one "
            "TensorFlow minor version"
        )
    return f"{problem}. Underlying error: {detail}. {_FIX}"


def _is_load_failure(text):
    return "libtensorflow_io" in text and any(
        sign in text for sign in _LOAD_FAILURE_SIGNS
    )


def _empty_wav():
    """A valid WAV file with no frames: the probe's input."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(8000)
    return buffer.getvalue()


def require_tensorflow_io():
    """Returns the `tensorflow_io` module once its native ops load.

    Runs one real tfio op once per process; a release known to be built
    for another TensorFlow is reported without being imported.

    Returns:
        The `tensorflow_io` module.

    Raises:
        ImportError: If tensorflow-io is not installed or its ops do not
            load, naming the versions, the error and `WORKING_PAIRING`.

    Example:

    >>> from keras_stage.data.tfio_support import require_tensorflow_io
    >>> try:
    ...     tfio = require_tensorflow_io()
    ... except ImportError as e:
    ...     assert "tensorflow-io==0.37.1" in str(e)
    """
    return _load_tensorflow_io()


# tensorflow-io release -> the TensorFlow its ops are built for: a known
# mismatch is reported without importing (loading can break TensorFlow).
_BUILT_FOR = {"0.37": "2.16"}


def _minor(version):
    return ".".join(version.split(".")[:2])


def _known_mismatch():
    """The message for a tfio known not to fit this TensorFlow, or None."""
    tfio_version = _version("tensorflow-io")
    try:
        importable = importlib.util.find_spec("tensorflow_io") is not None
    except (ImportError, ValueError):  # e.g. sys.modules entry set to None
        importable = False
    if tfio_version is None or not importable:
        return None
    built_for = _BUILT_FOR.get(_minor(tfio_version))
    if built_for is None or built_for == _minor(tf.__version__):
        return None
    return (
        f"tensorflow-io {tfio_version}'s ops do not load on TensorFlow "
        f"{tf.__version__}: it is built for TensorFlow {built_for} (not "
        "imported: loading its ops into another TensorFlow can leave "
        f"TensorFlow broken in this process). {_FIX}"
    )


@functools.cache  # caches the module only: a failure raises each time
def _load_tensorflow_io():
    mismatch = _known_mismatch()
    if mismatch is not None:
        raise ImportError(mismatch)
    try:
        import tensorflow_io as tfio
    except ModuleNotFoundError as e:
        if e.name != "tensorflow_io":
            raise ImportError(_message(e)) from e
        raise ImportError(_message(e, installed=False)) from e
    except ImportError as e:
        raise ImportError(_message(e)) from e
    try:
        tfio.audio.decode_wav(_empty_wav(), dtype=tf.int16)
    except (NotImplementedError, tf.errors.NotFoundError, OSError) as e:
        raise ImportError(_message(e)) from e
    return tfio


def explain_tfio_error(exc):
    """The clear message for an error from a tfio op that did not load.

    The message `require_tensorflow_io` raises if `exc`, or an exception it
    was raised from, is tensorflow-io failing to load its ops; else `None`.

    Example:

    >>> from keras_stage.data.tfio_support import explain_tfio_error
    >>> error = NotImplementedError(
    ...     "unable to open file: libtensorflow_io.so, from paths: [...]\\n"
    ...     "caused by: ['libtensorflow_io.so: undefined symbol: _ZN3tsl']"
    ... )
    >>> message = explain_tfio_error(error)
    >>> "undefined symbol: _ZN3tsl" in message
    True
    >>> "tensorflow-cpu==2.16.2 + tensorflow-io==0.37.1" in message
    True
    >>> explain_tfio_error(ValueError("bad input")) is None
    True
    """
    found, seen = None, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _is_load_failure(str(exc)):
            # The innermost match: tfio's own error, not a wrapper's.
            found = exc
        exc = exc.__cause__ or exc.__context__
    return None if found is None else _message(found)


def _by_name(element):
    # tfio keys columns it found itself by bytes; Keras matches str names.
    return {
        key.decode() if isinstance(key, bytes) else key: value
        for key, value in element.items()
    }


def read_parquet(path, columns=None):
    """Reads a Parquet file into a dataset of dicts, one row per element.

    `tfio.IODataset.from_parquet` with `str` keys (as Keras matches them).

    Args:
        path: The Parquet file.
        columns: The column names to read, or `None` for all of them, in
            the file's order. Defaults to `None`.

    Returns:
        A `tf.data.Dataset` of `{column: scalar tensor}` dicts.

    Example:

    >>> import keras_stage
    >>> rows = read_parquet("train.parquet", ["x", "y"])  # doctest: +SKIP
    >>> staged = keras_stage.data.stage(  # doctest: +SKIP
    ...     rows.batch(32), lambda b: (b["x"] * 2.0, b["y"])
    ... )
    """
    tfio = require_tensorflow_io()
    if columns is not None:
        columns = list(columns)
    dataset = tfio.IODataset.from_parquet(path, columns=columns)
    return dataset.map(_by_name)


def read_hdf5(path, datasets):
    """Reads HDF5 datasets row by row, zipped into a dataset of dicts.

    Element `i` holds row `i` of each (`tfio.IODataset.from_hdf5`), keyed
    by the dataset's name without the leading "/"; the shortest ends it.

    Args:
        path: The HDF5 file.
        datasets: The HDF5 dataset paths, e.g. `["/x", "/y"]`.

    Returns:
        A `tf.data.Dataset` of `{name: row tensor}` dicts.

    Example:

    >>> import keras_stage
    >>> rows = read_hdf5("train.h5", ["/x", "/y"])  # doctest: +SKIP
    >>> staged = keras_stage.data.stage(  # doctest: +SKIP
    ...     rows.batch(32), lambda b: (b["x"] / 255.0, b["y"])
    ... )
    """
    if isinstance(datasets, str) or not datasets:
        raise ValueError(
            "Invalid value for argument `datasets`. Expected a non-empty "
            f'list of HDF5 dataset paths, e.g. ["/x", "/y"]. Received: '
            f"datasets={datasets!r}"
        )
    tfio = require_tensorflow_io()
    names = [name.lstrip("/") for name in datasets]
    parts = {
        name: tfio.IODataset.from_hdf5(path, dataset=dataset)
        for name, dataset in zip(names, datasets, strict=True)
    }
    return tf.data.Dataset.zip(parts)
