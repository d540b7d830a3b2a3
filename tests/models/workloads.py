"""Realistic smart-stage workloads: custom layers, data and model builders.

Four models whose first layers are preprocessing that training does not
change, so `compile(smart_stage=True)` can run them inside the stage:

- `build_csv_model`: the DeepRec stage example ported to Keras: CSV text
  lines parsed with `tf.io.decode_csv`, a hashed categorical column, an
  embedding and a small MLP.
- `build_structured_model`: dict inputs of numbers, strings and ints
  through adapted `Normalization`, `StringLookup`, `IntegerLookup` and
  `CategoryEncoding`.
- `build_criteo_model`: a DLRM-like model on Criteo-style TSV lines (13
  numeric, 26 categorical fields) parsed with `tf.strings.split`.
- `build_image_model`: encoded PNG bytes decoded, resized and rescaled in
  the model, then a small CNN.

Each `make_*_data` returns `(x, y)` numpy data for its model; each builder
takes the data it adapts on (when it adapts) and returns an uncompiled
`keras_stage.Model` whose first layer after the inputs is a `StagedInput`
named "stage". Layer names are fixed so tests can check stage plans layer
by layer. Parsing layers are `keras.layers.Layer` subclasses with
`compute_output_spec`, because Keras cannot infer string (or int64)
outputs of a `Lambda`.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_stage
from keras_stage.layers import StagedInput

PACKAGE = "keras_stage_tests"


def _text_array(strings):
    """A 1-D numpy array of Python strings, the form of text Keras's array
    adapter takes (it rejects numpy's fixed-width string dtypes)."""
    return np.array(list(strings), dtype=object)


def _staged_input(inputs):
    return StagedInput(capacity=2, num_threads=2, name="stage")(inputs)


# -- custom layers --------------------------------------------------------


@keras.saving.register_keras_serializable(package=PACKAGE)
class DecodeCsv(keras.layers.Layer):
    """Parses CSV lines with `tf.io.decode_csv`.

    Takes a string tensor of shape `(batch,)` and returns
    `[numeric, strings]`: the `numeric_columns` as float32 of shape
    `(batch, len(numeric_columns))` (empty fields read as 0) and the
    `string_columns` as strings of shape `(batch, len(string_columns))`.
    Other columns (the label, say) are not parsed.
    """

    def __init__(
        self, numeric_columns, string_columns, field_delim=",", **kwargs
    ):
        super().__init__(**kwargs)
        self.numeric_columns = list(numeric_columns)
        self.string_columns = list(string_columns)
        self.field_delim = field_delim

    def call(self, lines):
        columns = sorted(self.numeric_columns + self.string_columns)
        defaults = [
            [0.0] if c in self.numeric_columns else [""] for c in columns
        ]
        fields = tf.io.decode_csv(
            lines,
            record_defaults=defaults,
            field_delim=self.field_delim,
            select_cols=columns,
        )
        by_column = dict(zip(columns, fields, strict=True))
        numeric = tf.stack([by_column[c] for c in self.numeric_columns], -1)
        strings = tf.stack([by_column[c] for c in self.string_columns], -1)
        return [numeric, strings]

    def compute_output_spec(self, lines):
        batch = lines.shape[0]
        return [
            keras.KerasTensor(
                (batch, len(self.numeric_columns)), dtype="float32"
            ),
            keras.KerasTensor(
                (batch, len(self.string_columns)), dtype="string"
            ),
        ]

    def get_config(self):
        return {
            **super().get_config(),
            "numeric_columns": self.numeric_columns,
            "string_columns": self.string_columns,
            "field_delim": self.field_delim,
        }


@keras.saving.register_keras_serializable(package=PACKAGE)
class CriteoParse(keras.layers.Layer):
    """Parses Criteo TSV lines with `tf.strings.split`.

    A line is `label \\t I1..I13 \\t C1..C26`. Returns `[dense, cats]`:
    the 13 integer features as float32 `(batch, 13)` (empty fields read as
    0) and the 26 categorical fields as strings `(batch, 26)` (empty
    fields stay empty strings, a category of their own).
    """

    def __init__(self, num_dense=13, num_cats=26, **kwargs):
        super().__init__(**kwargs)
        self.num_dense = num_dense
        self.num_cats = num_cats

    def call(self, lines):
        width = 1 + self.num_dense + self.num_cats
        fields = tf.strings.split(lines, sep="\t").to_tensor(
            default_value="", shape=[None, width]
        )
        dense = fields[:, 1 : 1 + self.num_dense]
        dense = tf.where(dense == "", "0", dense)
        dense = tf.strings.to_number(dense, out_type=tf.float32)
        cats = fields[:, 1 + self.num_dense :]
        return [dense, cats]

    def compute_output_spec(self, lines):
        batch = lines.shape[0]
        return [
            keras.KerasTensor((batch, self.num_dense), dtype="float32"),
            keras.KerasTensor((batch, self.num_cats), dtype="string"),
        ]

    def get_config(self):
        return {
            **super().get_config(),
            "num_dense": self.num_dense,
            "num_cats": self.num_cats,
        }


@keras.saving.register_keras_serializable(package=PACKAGE)
class Log1p(keras.layers.Layer):
    """`log(1 + max(x, 0))`, the usual transform of Criteo's counts."""

    def call(self, x):
        return tf.math.log1p(tf.maximum(x, 0.0))

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, dtype="float32")


@keras.saving.register_keras_serializable(package=PACKAGE)
class FieldOffset(keras.layers.Layer):
    """Moves field `i`'s hash bucket ids to `[i * num_bins, (i+1) * num_bins)`.

    So one embedding table of `num_fields * num_bins` rows holds a separate
    table per categorical field, as in DLRM.
    """

    def __init__(self, num_bins, **kwargs):
        super().__init__(**kwargs)
        self.num_bins = num_bins

    def call(self, ids):
        ids = tf.cast(ids, tf.int64)
        offsets = tf.range(tf.shape(ids)[-1], dtype=tf.int64) * self.num_bins
        return ids + offsets

    def compute_output_spec(self, ids):
        return keras.KerasTensor(ids.shape, dtype="int64")

    def get_config(self):
        return {**super().get_config(), "num_bins": self.num_bins}


@keras.saving.register_keras_serializable(package=PACKAGE)
class DecodePng(keras.layers.Layer):
    """Decodes a batch of PNG bytes to float32 images (values 0..255).

    Takes strings of shape `(batch,)`; every image must be
    `height x width` with `channels` channels.
    """

    def __init__(self, height, width, channels=3, **kwargs):
        super().__init__(**kwargs)
        self.height = height
        self.width = width
        self.channels = channels

    def call(self, images):
        shape = (self.height, self.width, self.channels)

        def decode(png):
            image = tf.io.decode_png(png, channels=self.channels)
            return tf.ensure_shape(image, shape)

        decoded = tf.map_fn(
            decode,
            images,
            fn_output_signature=tf.TensorSpec(shape, tf.uint8),
        )
        return tf.cast(decoded, tf.float32)

    def compute_output_spec(self, images):
        return keras.KerasTensor(
            (images.shape[0], self.height, self.width, self.channels),
            dtype="float32",
        )

    def get_config(self):
        return {
            **super().get_config(),
            "height": self.height,
            "width": self.width,
            "channels": self.channels,
        }


# -- 1. DeepRec example: CSV lines ------------------------------------------

CSV_CATEGORIES = [f"cat_{i}" for i in range(12)]
CSV_BINS = 16


def make_csv_data(num_rows=200, seed=0):
    """Lines `label,f1,f2,cat` and the labels (also given as `y`)."""
    rng = np.random.default_rng(seed)
    f1 = rng.normal(size=num_rows).round(3)
    f2 = rng.normal(size=num_rows).round(3)
    cat = rng.integers(len(CSV_CATEGORIES), size=num_rows)
    label = ((f1 + 0.5 * f2 + (cat % 3 == 0)) > 0.3).astype("int64")
    lines = _text_array(
        f"{label[i]},{f1[i]},{f2[i]},{CSV_CATEGORIES[cat[i]]}"
        for i in range(num_rows)
    )
    return lines, label.astype("float32").reshape(-1, 1)


def build_csv_model():
    """line -> decode_csv -> hash -> emb -> emb_flat -> concat -> MLP."""
    line = keras.Input(shape=(), dtype="string", name="line")
    x = _staged_input(line)
    numeric, cats = DecodeCsv(
        numeric_columns=[1, 2], string_columns=[3], name="decode_csv"
    )(x)
    ids = keras.layers.Hashing(num_bins=CSV_BINS, name="hash")(cats)
    emb = keras.layers.Embedding(CSV_BINS, 4, name="emb")(ids)
    emb = keras.layers.Flatten(name="emb_flat")(emb)
    x = keras.layers.Concatenate(name="concat")([numeric, emb])
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    output = keras.layers.Dense(1, activation="sigmoid", name="out")(x)
    return keras_stage.Model(line, output, name="csv_model")


# -- 2. Structured data: dict inputs -----------------------------------------

CITIES = ["paris", "berlin", "rome", "madrid", "lisbon", "vienna"]
ZIPS = [75001, 10115, 118, 28001, 1100, 1010]


def make_structured_data(num_rows=200, seed=0):
    """Dict features: `age`, `income` float32 and `zip` int64 of shape
    `(num_rows, 1)`, `city` strings of shape `(num_rows,)`."""
    rng = np.random.default_rng(seed)
    age = rng.uniform(18, 80, size=(num_rows, 1)).astype("float32")
    income = rng.lognormal(10, 0.5, size=(num_rows, 1)).astype("float32")
    # A few cities and zips outside the vocabularies (the OOV bucket).
    city_id = rng.integers(len(CITIES) + 2, size=num_rows)
    city = _text_array(
        CITIES[i] if i < len(CITIES) else f"unknown_{i}" for i in city_id
    )
    zip_id = rng.integers(len(ZIPS) + 1, size=num_rows)
    zip_code = np.array(
        [ZIPS[i] if i < len(ZIPS) else 99999 for i in zip_id], dtype="int64"
    ).reshape(-1, 1)
    score = (
        (age[:, 0] - 45) / 20
        + (np.log(income[:, 0]) - 10) * 2
        + (city_id % 2)
        - (zip_id == 0)
    )
    y = (score > 0.5).astype("float32").reshape(-1, 1)
    x = {"age": age, "income": income, "city": city, "zip": zip_code}
    return x, y


def build_structured_model(adapt_data):
    """Normalization/StringLookup/IntegerLookup/CategoryEncoding -> MLP.

    `adapt_data` is the feature dict the Normalization layers adapt on.
    """
    inputs = {
        "age": keras.Input(shape=(1,), dtype="float32", name="age"),
        "income": keras.Input(shape=(1,), dtype="float32", name="income"),
        "city": keras.Input(shape=(), dtype="string", name="city"),
        "zip": keras.Input(shape=(1,), dtype="int64", name="zip"),
    }
    x = _staged_input(inputs)
    age_norm = keras.layers.Normalization(name="age_norm")
    age_norm.adapt(adapt_data["age"])
    income_norm = keras.layers.Normalization(name="income_norm")
    income_norm.adapt(adapt_data["income"])
    numeric = keras.layers.Concatenate(name="numeric")(
        [age_norm(x["age"]), income_norm(x["income"])]
    )
    city = keras.layers.StringLookup(vocabulary=CITIES, name="city_lookup")(
        x["city"]
    )
    city = keras.layers.Embedding(len(CITIES) + 1, 3, name="city_emb")(city)
    zip_code = keras.layers.IntegerLookup(vocabulary=ZIPS, name="zip_lookup")(
        x["zip"]
    )
    zip_code = keras.layers.CategoryEncoding(
        num_tokens=len(ZIPS) + 1, output_mode="one_hot", name="zip_onehot"
    )(zip_code)
    x = keras.layers.Concatenate(name="concat")([numeric, city, zip_code])
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    output = keras.layers.Dense(1, activation="sigmoid", name="out")(x)
    return keras_stage.Model(inputs, output, name="structured_model")


# -- 3. Criteo / DLRM-like: TSV lines ----------------------------------------

CRITEO_DENSE = 13
CRITEO_CATS = 26
CRITEO_BINS = 32
CRITEO_EMB_DIM = 4


def make_criteo_data(num_rows=200, seed=0):
    """Synthetic Criteo lines: label, 13 counts, 26 hex categories."""
    rng = np.random.default_rng(seed)
    counts = rng.poisson(3.0, size=(num_rows, CRITEO_DENSE))
    counts[rng.random(size=counts.shape) < 0.1] = -1  # missing
    cats = rng.integers(50, size=(num_rows, CRITEO_CATS))
    missing_cat = rng.random(size=cats.shape) < 0.05
    score = np.log1p(counts.clip(0)).sum(-1) / 8 + (cats[:, 0] % 2) - 2.5
    label = (score > 0).astype("int64")
    lines = []
    for i in range(num_rows):
        dense = ["" if c < 0 else str(c) for c in counts[i]]
        categorical = [
            "" if missing_cat[i, j] else f"{(j * 7919 + c * 104729):08x}"
            for j, c in enumerate(cats[i])
        ]
        lines.append("\t".join([str(label[i])] + dense + categorical))
    return _text_array(lines), label.astype("float32").reshape(-1, 1)


def build_criteo_model():
    """parse -> log1p / hash -> bottom MLP / embeddings -> top MLP."""
    line = keras.Input(shape=(), dtype="string", name="line")
    x = _staged_input(line)
    dense, cats = CriteoParse(
        num_dense=CRITEO_DENSE, num_cats=CRITEO_CATS, name="criteo_parse"
    )(x)
    dense = Log1p(name="dense_log1p")(dense)
    ids = keras.layers.Hashing(num_bins=CRITEO_BINS, name="cat_hash")(cats)
    ids = FieldOffset(num_bins=CRITEO_BINS, name="cat_offset")(ids)
    bottom = keras.layers.Dense(16, activation="relu", name="bottom_1")(dense)
    bottom = keras.layers.Dense(
        CRITEO_EMB_DIM, activation="relu", name="bottom_2"
    )(bottom)
    emb = keras.layers.Embedding(
        CRITEO_CATS * CRITEO_BINS, CRITEO_EMB_DIM, name="cat_emb"
    )(ids)
    emb = keras.layers.Flatten(name="cat_flat")(emb)
    x = keras.layers.Concatenate(name="concat")([bottom, emb])
    x = keras.layers.Dense(16, activation="relu", name="top_1")(x)
    output = keras.layers.Dense(1, activation="sigmoid", name="top_out")(x)
    return keras_stage.Model(line, output, name="criteo_model")


# -- 4. Images: encoded PNG bytes --------------------------------------------

PNG_SIZE = 12
IMAGE_SIZE = 8
IMAGE_CLASSES = 3


def make_image_data(num_images=48, seed=0):
    """PNG bytes of `PNG_SIZE`-square RGB images; the class is the
    brightest channel."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(IMAGE_CLASSES, size=num_images)
    images = rng.integers(0, 128, size=(num_images, PNG_SIZE, PNG_SIZE, 3))
    images[np.arange(num_images), :, :, labels] += 100
    images = images.astype("uint8")
    # A string tensor: Keras's array adapter takes numpy text only as
    # Python `str`, and PNG bytes are not text.
    pngs = tf.constant([tf.io.encode_png(image).numpy() for image in images])
    return pngs, labels.astype("int64")


def build_image_model():
    """decode_png -> resize -> rescale -> conv -> gap -> out."""
    png = keras.Input(shape=(), dtype="string", name="png")
    x = _staged_input(png)
    x = DecodePng(PNG_SIZE, PNG_SIZE, channels=3, name="decode_png")(x)
    x = keras.layers.Resizing(IMAGE_SIZE, IMAGE_SIZE, name="resize")(x)
    x = keras.layers.Rescaling(1.0 / 255, name="rescale")(x)
    x = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    output = keras.layers.Dense(
        IMAGE_CLASSES, activation="softmax", name="out"
    )(x)
    return keras_stage.Model(png, output, name="image_model")
