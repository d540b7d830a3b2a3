"""The `remote` workload: every batch waits on a read from slow storage.

IO-latency bound: before the seed workload's CSV parsing, each batch goes
through `RemoteRead`, a layer that blocks 20 ms (`--remote-latency-ms`),
standing for a read from a remote object store. The read is emulated two
ways (`--remote-read`):

- `tf` (the default): a C++ sleep inside TensorFlow (`SleepDataset`), which
  blocks its thread without Python's GIL, as TensorFlow's own file systems
  (`tf.io.read_file`, `TFRecordDataset` on `gs://` or `s3://`) do;
- `python`: `tf.py_function` + `time.sleep`, as a read through a Python
  client in a `py_function` would be: `time.sleep` releases the GIL, but
  entering and leaving the Python function takes it.

The trunk is small, so the read dominates unless reads overlap with each
other and with training.
"""

import time

import keras
import tensorflow as tf

from benchmarks.workloads.base import scaled
from benchmarks.workloads.seed import (
    HASH_BUCKETS,
    ParseCsvLines,
    SeedWorkload,
    embedding_trunk,
)

READ_SECONDS = 0.020
# How the read is emulated (see the module docstring).
READ_KINDS = ("tf", "python")


def _check_read(read):
    if read not in READ_KINDS:
        raise ValueError(
            f"Invalid value for argument `read`. Expected one of "
            f"{READ_KINDS}. Received: read={read!r}"
        )


def sleep_in_tensorflow(tensor, seconds):
    """`tensor`, returned after `seconds` of a GIL-free sleep in TensorFlow.

    A one-element dataset whose element comes through TensorFlow's
    `SleepDataset` (a public raw op; `take(1)`, so the end-of-data check
    does not sleep a second time), read back in the same graph.
    """
    shapes = [tensor.shape]
    types = [tensor.dtype]
    data = tf.raw_ops.TensorDataset(components=[tensor], output_shapes=shapes)
    data = tf.raw_ops.SleepDataset(
        input_dataset=data,
        sleep_microseconds=tf.constant(round(seconds * 1e6), tf.int64),
        output_types=types,
        output_shapes=shapes,
    )
    data = tf.raw_ops.TakeDataset(
        input_dataset=data,
        count=tf.constant(1, tf.int64),
        output_types=types,
        output_shapes=shapes,
    )
    (out,) = tf.raw_ops.DatasetToSingleElement(
        dataset=data, output_types=types, output_shapes=shapes
    )
    return out


class RemoteRead(keras.layers.Layer):
    """Passes a batch of lines through after an emulated remote read.

    Args:
        seconds: Latency of one read (one batch).
        read: How the read blocks: `"tf"` (a sleep in TensorFlow's C++
            runtime, no GIL) or `"python"` (`tf.py_function` +
            `time.sleep`).
        **kwargs: Passed to `keras.layers.Layer`.
    """

    def __init__(self, seconds=READ_SECONDS, read="tf", **kwargs):
        super().__init__(**kwargs)
        _check_read(read)
        self.seconds = seconds
        self.read = read

    def _read(self, lines):
        time.sleep(self.seconds)  # releases the GIL, like real IO
        return lines

    def call(self, lines):
        if self.read == "tf":
            return sleep_in_tensorflow(lines, self.seconds)
        out = tf.py_function(self._read, [lines], tf.string)
        out.set_shape(lines.shape)
        return out

    def compute_output_spec(self, lines):
        return keras.KerasTensor(lines.shape, "string")

    def get_config(self):
        return {
            **super().get_config(),
            "seconds": self.seconds,
            "read": self.read,
        }


class RemoteWorkload(SeedWorkload):
    """Seed lines behind a 20 ms read per batch; a small trunk.

    Args:
        *args: Passed to `Workload`.
        read: How the read is emulated: `"tf"` or `"python"` (see
            `RemoteRead`). Defaults to `"tf"`.
        read_seconds: Latency of one read (one batch). Defaults to
            `READ_SECONDS` (20 ms).
        **kwargs: Passed to `Workload`.
    """

    name = "remote"
    # `{ms}`: the read's latency.
    description = (
        "IO-latency bound: each batch of 'user,item,score' lines waits {ms} "
        "ms in an emulated remote read, then decode_csv -> "
        "to_hash_bucket_fast -> 2 x Embedding(10000, 8) -> Dense(32) -> "
        "Dense(1); Adam, MSE"
    )
    # How each kind of read is described in the report.
    read_descriptions = {
        "tf": "a sleep in TensorFlow's C++ runtime (SleepDataset), which "
        "holds no GIL, as TensorFlow's own file systems do",
        "python": "tf.py_function + time.sleep: the sleep releases the GIL, "
        "entering and leaving Python takes it",
    }
    default_batch_size = 256
    default_steps = 100
    quick_steps = 30
    embedding_dim = 8
    widths = (32,)

    def __init__(self, *args, read="tf", read_seconds=READ_SECONDS, **kwargs):
        super().__init__(*args, **kwargs)
        _check_read(read)
        if isinstance(read_seconds, bool) or not (
            isinstance(read_seconds, (int, float)) and read_seconds > 0
        ):
            raise ValueError(
                "Invalid value for argument `read_seconds`. Expected a "
                f"positive number of seconds. Received: "
                f"read_seconds={read_seconds!r}"
            )
        self.read = read
        self.read_seconds = float(read_seconds)
        ms = f"{self.read_seconds * 1e3:g}"
        self.description = (
            f"{type(self).description.format(ms=ms)} (the read: "
            f"{self.read_descriptions[read]})"
        )

    def preprocessing(self):
        return [
            RemoteRead(self.read_seconds, read=self.read, name="remote_read"),
            ParseCsvLines(HASH_BUCKETS, name="parse_csv"),
        ]

    def trunk(self, features):
        widths = [scaled(w, self.trunk_scale) for w in self.widths]
        return embedding_trunk(
            features, HASH_BUCKETS, self.embedding_dim, widths
        )

    def params(self):
        return {
            **super().params(),
            "read_seconds_per_batch": self.read_seconds,
            "read": self.read,
        }
