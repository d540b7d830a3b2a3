"""`seed` and `remote`: CSV lines parsed and hashed in the model.

`seed` is DeepRec's `tf.staged` example, small. `remote` reads each batch
20 ms first: a sleep without the GIL, as TensorFlow's `gs://` reads.
"""

import keras
import numpy as np
import tensorflow as tf

from benchmarks.workloads.base import Workload

HASH_BUCKETS = 10_000


class ParseCsvLines(keras.layers.Layer):
    """`user,item,score` lines -> `{"user": ids, "item": ids}` (int64)."""

    def call(self, lines):
        user, item, _ = tf.io.decode_csv(
            lines, record_defaults=[[""], [""], [0.0]]
        )
        return {
            "user": tf.strings.to_hash_bucket_fast(user, HASH_BUCKETS),
            "item": tf.strings.to_hash_bucket_fast(item, HASH_BUCKETS),
        }

    def compute_output_spec(self, lines):
        return {
            k: keras.KerasTensor(lines.shape, "int64") for k in ("user", "item")
        }


class RemoteRead(keras.layers.Layer):
    """A batch of lines, passed on after `seconds` of a GIL-free sleep."""

    def __init__(self, seconds=0.020, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def call(self, lines):
        # A one-element dataset through TensorFlow's SleepDataset, read back.
        kw = {"output_types": [lines.dtype], "output_shapes": [lines.shape]}
        data = tf.raw_ops.TensorDataset(
            components=[lines], output_shapes=[lines.shape]
        )
        micros = tf.constant(round(self.seconds * 1e6), tf.int64)
        data = tf.raw_ops.SleepDataset(
            input_dataset=data, sleep_microseconds=micros, **kw
        )
        data = tf.raw_ops.TakeDataset(
            input_dataset=data, count=tf.constant(1, tf.int64), **kw
        )
        return tf.raw_ops.DatasetToSingleElement(dataset=data, **kw)[0]

    def compute_output_spec(self, lines):
        return keras.KerasTensor(lines.shape, "string")

    def get_config(self):
        return {**super().get_config(), "seconds": self.seconds}


class Seed(Workload):
    name = "seed"
    description = (
        "DeepRec's seed example: 'user,item,score' lines -> decode_csv -> "
        "to_hash_bucket_fast -> 2 x Embedding(10000, 16) -> Dense(64) x 2 -> "
        "Dense(1); Adam, MSE"
    )
    steps, quick_steps = 200, 60
    dim, widths = 16, (64, 64)

    def data(self, rows, seed=0):
        rng = np.random.default_rng(seed)
        users, items = rng.integers(0, 5000, rows), rng.integers(0, 2000, rows)
        scores = ((users % 7) + (items % 5)) / 10.0
        lines = [
            f"user_{u},item_{i},{s:.1f}"
            for u, i, s in zip(users, items, scores, strict=True)
        ]
        return np.array(lines, dtype=object), scores.astype("float32")[:, None]

    def inputs(self):
        return keras.Input(shape=(), dtype="string", name="line")

    def preprocessing(self, adapt):
        return ParseCsvLines(name="parse_csv")

    def trunk(self, features):
        embedded = [
            keras.layers.Embedding(HASH_BUCKETS, self.dim)(features[key])
            for key in ("user", "item")
        ]
        x = keras.layers.Concatenate()(embedded)
        for width in self.widths:
            x = keras.layers.Dense(width, activation="relu")(x)
        return keras.layers.Dense(1)(x)


class Remote(Seed):
    name = "remote"
    description = (
        "IO-latency bound: each batch of seed's lines waits 20 ms in a read "
        "(a sleep in TensorFlow's C++ runtime, no GIL), then decode_csv -> "
        "to_hash_bucket_fast -> 2 x Embedding(10000, 8) -> Dense(32) -> "
        "Dense(1); Adam, MSE"
    )
    steps, quick_steps = 100, 30
    dim, widths = 8, (32,)
    read_seconds = 0.020

    def preprocessing(self, adapt):
        read = RemoteRead(self.read_seconds, name="remote_read")
        parse = ParseCsvLines(name="parse_csv")
        return lambda lines: parse(read(lines))
