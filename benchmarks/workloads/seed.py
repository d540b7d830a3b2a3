"""The `seed` workload: DeepRec's `tf.staged` seed example, small.

Batches of CSV text lines such as `user_123,item_45,0.7` are parsed with
`tf.io.decode_csv`, the user and item fields hashed into ids with
`tf.strings.to_hash_bucket_fast`, and fed to two embeddings and a small
Dense trunk. The parsing layer, `ParseCsvLines`, is shared with the
`remote` workload.
"""

import keras
import numpy as np
import tensorflow as tf

from benchmarks.workloads.base import Workload, scaled

NUM_USERS = 5000
NUM_ITEMS = 2000
HASH_BUCKETS = 10_000


def make_lines(count, seed):
    """`count` deterministic lines `user_<id>,item_<id>,<score>` and scores.

    Returns:
        `(lines, scores)`: a list of str and a float32 array `(count, 1)`.
    """
    rng = np.random.default_rng(seed)
    users = rng.integers(0, NUM_USERS, count)
    items = rng.integers(0, NUM_ITEMS, count)
    scores = ((users % 7) + (items % 5)) / 10.0
    lines = [
        f"user_{u},item_{i},{s:.1f}"
        for u, i, s in zip(users, items, scores, strict=True)
    ]
    return lines, scores.astype("float32")[:, None]


def parse_csv_lines(lines, hash_buckets):
    """Parses a batch of `user,item,score` lines into hashed user/item ids."""
    user, item, _ = tf.io.decode_csv(lines, record_defaults=[[""], [""], [0.0]])
    return {
        "user": tf.strings.to_hash_bucket_fast(user, hash_buckets),
        "item": tf.strings.to_hash_bucket_fast(item, hash_buckets),
    }


class ParseCsvLines(keras.layers.Layer):
    """Raw `user,item,score` lines -> `{"user": ids, "item": ids}` (int64).

    Args:
        hash_buckets: Number of hash buckets of the ids.
        **kwargs: Passed to `keras.layers.Layer`.
    """

    def __init__(self, hash_buckets=HASH_BUCKETS, **kwargs):
        super().__init__(**kwargs)
        self.hash_buckets = hash_buckets

    def call(self, lines):
        return parse_csv_lines(lines, self.hash_buckets)

    def compute_output_spec(self, lines):
        # Keras cannot infer int64 outputs from string inputs by itself.
        return {
            "user": keras.KerasTensor(lines.shape, "int64"),
            "item": keras.KerasTensor(lines.shape, "int64"),
        }

    def get_config(self):
        return {**super().get_config(), "hash_buckets": self.hash_buckets}


def embedding_trunk(features, hash_buckets, dim, widths):
    """Two embeddings, concatenated, then Dense layers and a linear head."""
    user = keras.layers.Embedding(hash_buckets, dim)(features["user"])
    item = keras.layers.Embedding(hash_buckets, dim)(features["item"])
    x = keras.layers.Concatenate()([user, item])
    for width in widths:
        x = keras.layers.Dense(width, activation="relu")(x)
    return keras.layers.Dense(1)(x)


class SeedWorkload(Workload):
    """DeepRec's seed example: CSV lines -> decode_csv -> hash -> embed."""

    name = "seed"
    description = (
        "DeepRec seed example: 'user,item,score' CSV lines -> decode_csv -> "
        "to_hash_bucket_fast -> 2 x Embedding(10000, 16) -> Dense(64) x 2 "
        "-> Dense(1); Adam, MSE"
    )
    default_batch_size = 256
    default_steps = 200
    quick_steps = 60
    embedding_dim = 16
    widths = (64, 64)

    def make_raw_data(self):
        lines, scores = make_lines(self.steps * self.batch_size, self.seed)
        return np.array(lines, dtype=object), scores

    def raw_inputs(self):
        return keras.Input(shape=(), dtype="string", name="line")

    def preprocessing(self):
        return [ParseCsvLines(HASH_BUCKETS, name="parse_csv")]

    def trunk(self, features):
        widths = [scaled(w, self.trunk_scale) for w in self.widths]
        return embedding_trunk(
            features, HASH_BUCKETS, self.embedding_dim, widths
        )

    def params(self):
        return {
            "hash_buckets": HASH_BUCKETS,
            "embedding_dim": self.embedding_dim,
            "widths": [scaled(w, self.trunk_scale) for w in self.widths],
        }
