"""The `remote` workload: every batch waits on a read from slow storage.

IO-latency bound: before the seed workload's CSV parsing, each batch goes
through `RemoteRead`, a layer whose `tf.py_function` sleeps 20 ms, standing
for a read from a remote store. `time.sleep` releases the GIL as a socket
or file read does, so other threads (other reads, the training step) keep
running. The trunk is small, so the read dominates unless reads overlap
with each other and with training.
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


class RemoteRead(keras.layers.Layer):
    """Passes a batch of lines through after an emulated remote read.

    Args:
        seconds: Latency of one read (one batch).
        **kwargs: Passed to `keras.layers.Layer`.
    """

    def __init__(self, seconds=READ_SECONDS, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def _read(self, lines):
        time.sleep(self.seconds)  # releases the GIL, like real IO
        return lines

    def call(self, lines):
        out = tf.py_function(self._read, [lines], tf.string)
        out.set_shape(lines.shape)
        return out

    def compute_output_spec(self, lines):
        return keras.KerasTensor(lines.shape, "string")

    def get_config(self):
        return {**super().get_config(), "seconds": self.seconds}


class RemoteWorkload(SeedWorkload):
    """Seed lines behind a 20 ms read per batch; a small trunk."""

    name = "remote"
    description = (
        "IO-latency bound: each batch of 'user,item,score' lines waits 20 ms "
        "in an emulated remote read (tf.py_function + time.sleep, GIL "
        "released), then decode_csv -> to_hash_bucket_fast -> "
        "2 x Embedding(10000, 8) -> Dense(32) -> Dense(1); Adam, MSE"
    )
    default_batch_size = 256
    default_steps = 100
    quick_steps = 30
    embedding_dim = 8
    widths = (32,)

    def preprocessing(self):
        return [
            RemoteRead(READ_SECONDS, name="remote_read"),
            ParseCsvLines(HASH_BUCKETS, name="parse_csv"),
        ]

    def trunk(self, features):
        widths = [scaled(w, self.trunk_scale) for w in self.widths]
        return embedding_trunk(
            features, HASH_BUCKETS, self.embedding_dim, widths
        )

    def params(self):
        return {**super().params(), "read_seconds_per_batch": READ_SECONDS}
