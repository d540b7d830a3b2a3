"""`criteo` and `criteo_columns`: Criteo display-ads rows, two ways.

`criteo` parses TSV lines in the model (`tf.io.decode_csv`: TensorFlow
only) into a DLRM-like trunk; `criteo_columns` takes the fields as columns
through Keras layers only, so it runs on every backend.
"""

import keras
import numpy as np
import tensorflow as tf

from benchmarks.workloads.base import Workload

INTEGERS, CATEGORIES, BUCKETS, DIM = 13, 26, 1000, 16
# Vocabulary of each categorical field: some small, some above the hash range.
_VOCABULARY = [10, 100, 1000, 10_000, 100_000, 500, 50, 20_000] * 4


def criteo_lines(rows, seed):
    """`(lines, labels)`: deterministic Criteo-format TSV lines."""
    rng = np.random.default_rng(seed)
    columns, logit = [], np.zeros(rows)
    for field in range(INTEGERS):
        scale = np.minimum(rng.exponential(1.0 + field % 4, rows), 20.0)
        values = np.floor(np.expm1(scale)).astype(np.int64)  # heavy-tailed
        logit += 0.05 * np.log1p(values) * (1 if field % 2 else -1)
        text = values.astype(str).astype(object)
        text[rng.random(rows) < 0.05] = ""  # missing values
        columns.append(text)
    for field in range(CATEGORIES):
        index = (rng.zipf(1.3, rows) - 1) % _VOCABULARY[field]
        logit += 0.2 * ((index % 3) - 1) * (field < 4)
        ids = (index * 2654435761 + field * 40503) & 0xFFFFFFFF
        text = np.char.mod("%08x", ids).astype(object)
        text[rng.random(rows) < 0.03] = ""
        columns.append(text)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype("float32")
    label_text = labels.astype(np.int64).astype(str).astype(object)
    lines = ["\t".join(row) for row in zip(label_text, *columns, strict=True)]
    return lines, labels[:, None]


class ParseCriteoTsv(keras.layers.Layer):
    """TSV lines -> log1p of the integers and per-field hashed ids."""

    def call(self, lines):
        defaults = [[0.0]] * (1 + INTEGERS) + [[""]] * CATEGORIES
        fields = tf.io.decode_csv(
            lines, record_defaults=defaults, field_delim="\t"
        )
        numeric = tf.math.log1p(
            tf.maximum(tf.stack(fields[1 : 1 + INTEGERS], 1), 0.0)
        )
        ids = tf.strings.to_hash_bucket_fast(
            tf.stack(fields[1 + INTEGERS :], 1), BUCKETS
        )
        # Field i hashes into [i * BUCKETS, (i + 1) * BUCKETS): one table.
        offsets = tf.range(CATEGORIES, dtype=tf.int64) * BUCKETS
        return {"numeric": numeric, "hashed_ids": ids + offsets}

    def compute_output_spec(self, lines):
        batch = lines.shape[0]
        return {
            "numeric": keras.KerasTensor((batch, INTEGERS), "float32"),
            "hashed_ids": keras.KerasTensor((batch, CATEGORIES), "int64"),
        }


class DotInteraction(keras.layers.Layer):
    """DLRM's interaction: the bottom vector and the upper triangle of the
    dot products of it and the field embeddings."""

    def call(self, inputs):
        bottom, embedded = inputs
        vectors = keras.ops.concatenate([bottom[:, None], embedded], axis=1)
        dots = keras.ops.matmul(
            vectors, keras.ops.transpose(vectors, (0, 2, 1))
        )
        count = vectors.shape[1]
        rows, cols = np.triu_indices(count, k=1)
        flat = keras.ops.reshape(dots, (-1, count * count))
        pairs = keras.ops.take(flat, rows * count + cols, axis=1)
        return keras.ops.concatenate([bottom, pairs], axis=1)

    def compute_output_shape(self, shapes):
        count = shapes[1][1] + 1
        return (shapes[0][0], shapes[0][1] + count * (count - 1) // 2)


class Criteo(Workload):
    name = "criteo"
    description = (
        "DLRM-like on Criteo TSV lines: decode_csv, log1p, per-field "
        "to_hash_bucket_fast in the model; bottom MLP (32, 16), "
        "Embedding(26 x 1000, 16), dot interaction, top MLP (128, 64, 1); "
        "Adam, binary cross-entropy"
    )
    batch_size, steps, quick_steps = 512, 100, 25

    def data(self, rows, seed=0):
        lines, labels = criteo_lines(rows, seed)
        return np.array(lines, dtype=object), labels

    def inputs(self):
        return keras.Input(shape=(), dtype="string", name="tsv_line")

    def preprocessing(self, adapt):
        return ParseCriteoTsv(name="parse_tsv")

    def trunk(self, features):
        x = keras.layers.Dense(32, activation="relu")(features["numeric"])
        bottom = keras.layers.Dense(DIM, activation="relu")(x)
        embedded = keras.layers.Embedding(CATEGORIES * BUCKETS, DIM)(
            features["hashed_ids"]
        )
        x = DotInteraction()([bottom, embedded])
        for width in (128, 64):
            x = keras.layers.Dense(width, activation="relu")(x)
        return keras.layers.Dense(1, activation="sigmoid")(x)

    def compile_kwargs(self, learning_rate=1e-3):
        kwargs = super().compile_kwargs(learning_rate)
        return {**kwargs, "loss": "binary_crossentropy"}


class CriteoColumns(Criteo):
    name = "criteo_columns"
    description = (
        "Criteo-like columns: 13 log1p counts -> adapted Normalization; 26 "
        "string columns -> Hashing(1000) each; trunk: Embedding(1000, 8) per "
        "column, Concatenate -> Dense(64, relu) -> Dense(1, sigmoid)"
    )
    batch_size, steps, quick_steps = 256, 80, 4
    backends = ("tensorflow", "jax", "torch")
    names = tuple(f"C{i + 1}" for i in range(CATEGORIES))

    def data(self, rows, seed=0):
        lines, labels = criteo_lines(rows, seed)
        fields = np.array([line.split("\t") for line in lines], dtype=object)
        counts = fields[:, 1 : 1 + INTEGERS]
        counts = np.where(counts == "", "0", counts).astype(np.float64)
        x = {"dense": np.log1p(counts).astype("float32")}
        for i, name in enumerate(self.names):
            x[name] = fields[:, 1 + INTEGERS + i].copy()
        return x, labels

    def inputs(self):
        dense = keras.Input(shape=(INTEGERS,), name="dense")
        ids = {n: keras.Input((), dtype="string", name=n) for n in self.names}
        return {"dense": dense, **ids}

    def preprocessing(self, adapt):
        normalize = keras.layers.Normalization(name="dense_norm")
        normalize.adapt(adapt["dense"])
        hashes = {
            n: keras.layers.Hashing(BUCKETS, name=f"{n}_hash")
            for n in self.names
        }
        return lambda x: (
            [normalize(x["dense"])]
            + [hashes[name](x[name]) for name in self.names]
        )

    def trunk(self, columns):
        numeric, *ids = columns
        embedded = [keras.layers.Embedding(BUCKETS, 8)(i) for i in ids]
        x = keras.layers.Concatenate(name="features")([numeric, *embedded])
        # Named: Keras would name the first Dense "dense", as the input is.
        x = keras.layers.Dense(64, activation="relu", name="hidden")(x)
        return keras.layers.Dense(1, activation="sigmoid", name="click")(x)
