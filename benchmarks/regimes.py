"""Short regimes: whole Keras calls, set-up included, staged against plain.

`python -m benchmarks.regimes [--rounds N] [--quick] [--name NAME]
[--models tabular,dense,criteo,featurespace] [--regimes ...] [--modes ...]
[--feed arrays|dataset] [--control] [--determinism]` times sequences of
`fit`, `evaluate` and `predict` calls (and a keras-tuner search) as a user
makes them, in three modes (four with `--control`; `--modes` picks fewer)
side by side in one process:

- `plain`: the model as a `keras.Model`;
- `staged`: keras_stage's three lines (`StagedInput()` on the inputs,
  `keras_stage.Model`, `compile(..., smart_stage=True)`) and a
  `PrefetchCallback()` in every `fit`;
- `expert`: the model split by hand: its preprocessing layers in
  `dataset.map(num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)` and a
  `keras.Model` of the numeric trunk (for the model with no preprocessing,
  the prefetch alone);
- `plain_again` (with `--control`): a second plain model. Two equal modes
  differ by this machine's noise alone, so its paired ratio to plain says
  how far from 1 a ratio may be before it means anything.

`--feed` is what plain, staged and the control are given: numpy arrays
(the default, as in earlier results) or a `tf.data.Dataset`
(`from_tensor_slices((x, y))`, `shuffle(len)` for training, `batch`), as
keras.io's examples pass. Every mode builds its datasets inside the
measurement, once for its sequence of calls, and passes the same dataset
object to each of them, as a user's script does; the expert's are the
same datasets mapped. `--determinism` turns on Keras's op-determinism
recipe for the whole process (TensorFlow cannot turn it off again).

The suite of `benchmarks.run` times epochs from their first batch on, so a
stage's start-up (pipelines built, functions traced, iterators made) per
call and per epoch is outside its window. Here one measurement is the
whole sequence of calls of a regime (`REGIMES`), timed end to end; a
callback also sums the steps alone (`on_*_batch_begin` to
`on_*_batch_end` of every batch, validation and predict batches
included), so the difference is what the calls cost around their steps.

Each mode keeps one model (built with the same seed, so weights start
equal) for the regimes but `fresh_model` and `tuner_search`, which build,
compile and fit new models in each measurement, so they are always cold
(their point). The other regimes run once per mode untimed first
(tracing). Then the rounds run the modes in a rotating order (plain staged
expert, staged expert plain, ...), with an untimed `gc.collect()` after
each measurement; a paired ratio is the median over the rounds of the
ratio within a round. Each target is checked strictly and within the
control's distance from 1 (`met_within_noise`). Results: a table, and
`benchmarks/results/regimes/<name>.json`.
"""

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402
from benchmarks import environment  # noqa: E402
from benchmarks.decisions import (  # noqa: E402
    agree,
    compact,
    decisions_logged,
)
from benchmarks.paired import paired_ratio  # noqa: E402
from benchmarks.workloads import heart  # noqa: E402
from benchmarks.workloads.criteo import (  # noqa: E402
    CriteoWorkload,
    make_criteo_lines,
)

# 2: batch sizes and sizes per model (`models.<name>.batch_size`,
# `.sizes`), `config.feed` and `config.determinism`, `skipped` regimes,
# `control_distance` and `met_within_noise` in each target, and
# `expert_target` where a regime sets a bound on staged/expert.
SCHEMA_VERSION = 2
SEED = 0
DEFAULT_ROUNDS = 5
QUICK_ROUNDS = 2
RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "regimes"
)
MODES = ("plain", "staged", "expert")
# `--control`: a second plain model, built and fed as plain is. Its paired
# ratio to plain is what this run's noise alone makes of two equal modes.
CONTROL = "plain_again"
FEEDS = ("arrays", "dataset")
KERAS_TUNER_INSTALL = (
    "pip install --no-deps -r requirements/bench-extra.txt "
    "(keras-tuner, a benchmark extra)"
)

TIMED = (
    "One measurement is the whole sequence of calls of a regime (model "
    "building included for fresh_model and tuner_search), timed with "
    "time.perf_counter (cpu_seconds: the process's time.process_time over "
    "the same window); steps_seconds is the sum over every batch of those "
    "calls (train, validation, evaluate and predict batches) of "
    "on_*_batch_begin to on_*_batch_end. One untimed pass of each regime "
    "per mode first (none for fresh_model and tuner_search). Modes in a "
    "rotating order within each round; gc.collect() untimed after each "
    "measurement. Medians over the rounds; paired ratios are medians over "
    "the rounds of the ratio within a round (above 1: slower than plain)."
)


# -- the regimes' sizes ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How many batches (or rows), epochs and calls the regimes make."""

    train_batches: int = 30
    epochs: int = 8
    # The training batches of `validation`: the criteo-like row
    # fits 40 batches, the earlier regimes 30 (`train_batches`).
    val_train_batches: int = 30
    val_batches: int = 10
    val_epochs: int = 4
    eval_batches: int = 20
    eval_calls: int = 3
    fit_calls: int = 4
    predict_examples: int = 8
    predict_calls: int = 10
    fresh_trials: int = 3
    fresh_epochs: int = 2
    long_batches: int = 60
    long_epochs: int = 2
    # keras.io's FeatureSpace example: 303 rows, a fifth to validate.
    example_train_rows: int = heart.TRAIN_ROWS
    example_val_rows: int = heart.VAL_ROWS
    example_epochs: int = 20
    tuner_trials: int = 4
    tuner_epochs: int = 2
    tuner_batches: int = 20


# For smoke tests: every regime's calls, as small as they go.
TINY = Sizes(
    train_batches=2,
    epochs=2,
    val_train_batches=2,
    val_batches=1,
    val_epochs=2,
    eval_batches=2,
    eval_calls=2,
    fit_calls=2,
    predict_calls=2,
    fresh_trials=1,
    fresh_epochs=1,
    long_batches=2,
    long_epochs=1,
    example_train_rows=40,
    example_val_rows=10,
    example_epochs=2,
    tuner_trials=2,
    tuner_epochs=1,
    tuner_batches=2,
)


# -- the models ------------------------------------------------------------


def _inputs_like(features):
    """Fresh `keras.Input`s shaped like `features` (a tensor or a dict)."""
    if isinstance(features, dict):
        # Named after their keys: Keras warns about dict inputs whose
        # tensor names differ from the keys.
        return {
            key: keras.Input(t.shape[1:], dtype=t.dtype, name=key)
            for key, t in features.items()
        }
    return keras.Input(features.shape[1:], name="features")


class ModelSpec:
    """A model of the regimes: its data, preprocessing, trunk and sizes.

    Subclasses set `name`, `description` and implement `make_data`,
    `inputs`, `features` and `trunk`; the rest has defaults. A mode builds
    the whole model from `inputs_and_features` and `trunk`, the expert the
    split one from `expert_parts` and `trunk`.
    """

    name = ""
    description = ""
    batch_size = 32
    sizes = Sizes()
    # The regimes a run times when `--regimes` is not given.
    regimes = (
        "short_epochs",
        "validation",
        "evaluate_x3",
        "fit_epochs1_x4",
        "predict8_x10",
        "fresh_model",
    )
    # The data part preprocessing layers adapt to.
    adapt_part = "train"

    def make_data(self, count, seed):
        """`count` examples `(x, y)` from `seed`."""
        raise NotImplementedError

    def inputs(self):
        """Fresh `keras.Input`(s) of one raw example."""
        raise NotImplementedError

    def features(self, x, adapt_data):
        """The preprocessing layers on `x`: the features the trunk takes."""
        raise NotImplementedError

    def trunk(self, features):
        """Fresh trunk layers on `features`; returns the outputs."""
        raise NotImplementedError

    def compile_kwargs(self, learning_rate=1e-3):
        """What `compile` gets (fresh objects each call)."""
        return {
            "optimizer": keras.optimizers.Adam(learning_rate),
            "loss": "binary_crossentropy",
            "metrics": ["accuracy"],
        }

    def inputs_and_features(self, adapt_data, staged_input=None):
        """`(inputs, features)` of the whole model.

        `staged_input`: a `StagedInput` to put on the inputs, or None.
        """
        inputs = self.inputs()
        x = inputs if staged_input is None else staged_input(inputs)
        return inputs, self.features(x, adapt_data)

    def expert_parts(self, adapt_data):
        """`(preprocess, features)`: what the expert maps, and its output.

        `preprocess` is None when there is nothing to preprocess.
        """
        inputs = self.inputs()
        features = self.features(inputs, adapt_data)
        if features is inputs:
            return None, features
        return keras.Model(inputs, features), features


_THAL = ("fixed", "normal", "reversible")
_CITIES = tuple(f"city{i}" for i in range(40))


class TabularModel(ModelSpec):
    """keras.io's structured-data model: columns preprocessed, then an MLP.

    Four numeric columns through adapted `Normalization`, a string column
    through `StringLookup` and one through `Hashing` (one-hot both), an
    integer column through `IntegerLookup` (one-hot), concatenated into
    Dense(32) -> Dense(1, sigmoid).
    """

    name = "tabular"
    description = (
        "keras.io structured data: 4 numeric columns -> adapted "
        "Normalization, 'thal' -> StringLookup(one_hot), 'city' -> "
        "Hashing(64) -> one-hot, 'cp' -> IntegerLookup(one_hot); concatenated "
        "-> Dense(32, relu) -> Dense(1, sigmoid); Adam, binary crossentropy, "
        "accuracy"
    )
    numeric = ("age", "trestbps", "chol", "thalach")

    def make_data(self, count, seed):
        rng = np.random.default_rng(seed)
        x = {
            name: rng.normal(50 + 30 * i, 10, (count, 1)).astype("float32")
            for i, name in enumerate(self.numeric)
        }
        thal = rng.integers(len(_THAL), size=count)
        x["thal"] = np.array([_THAL[i] for i in thal], dtype=object)
        city = rng.integers(len(_CITIES), size=count)
        x["city"] = np.array([_CITIES[i] for i in city], dtype=object)
        x["cp"] = rng.integers(5, size=(count, 1)).astype("int64")
        score = (x["age"][:, 0] - 50) / 10 + thal - 1 + (x["cp"][:, 0] > 2)
        return x, (score > 0).astype("float32")[:, None]

    def inputs(self):
        inputs = {
            name: keras.Input(shape=(1,), name=name) for name in self.numeric
        }
        for name in ("thal", "city"):
            # Rank 1: Keras's array adapter rejects 2-D object arrays.
            inputs[name] = keras.Input(shape=(), dtype="string", name=name)
        inputs["cp"] = keras.Input(shape=(1,), dtype="int64", name="cp")
        return inputs

    def features(self, x, adapt_data):
        columns = []
        for name in self.numeric:
            normalize = keras.layers.Normalization(name=f"{name}_norm")
            normalize.adapt(adapt_data[name])
            columns.append(normalize(x[name]))
        columns.append(
            keras.layers.StringLookup(
                vocabulary=list(_THAL), output_mode="one_hot", name="thal_ids"
            )(x["thal"])
        )
        city = keras.layers.Hashing(64, name="city_hash")(x["city"])
        columns.append(
            keras.layers.CategoryEncoding(64, "one_hot", name="city_bins")(city)
        )
        columns.append(
            keras.layers.IntegerLookup(
                vocabulary=list(range(5)), output_mode="one_hot", name="cp_ids"
            )(x["cp"])
        )
        return keras.layers.Concatenate(name="features")(columns)

    def trunk(self, features):
        hidden = keras.layers.Dense(32, activation="relu", name="hidden")
        out = keras.layers.Dense(1, activation="sigmoid", name="out")
        return out(hidden(features))


class DenseModel(ModelSpec):
    """Dense float features straight into an MLP: nothing to preprocess."""

    name = "dense"
    description = (
        "no preprocessing: 32 dense float32 features -> Dense(64, relu) x 2 "
        "-> Dense(1); Adam, MSE"
    )

    def make_data(self, count, seed):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(count, 32)).astype("float32")
        return x, x[:, :8].sum(axis=1, keepdims=True)

    def inputs(self):
        return keras.Input(shape=(32,), name="features")

    def features(self, x, adapt_data):
        return x

    def trunk(self, features):
        x = features
        for i in range(2):
            x = keras.layers.Dense(64, activation="relu", name=f"hidden{i}")(x)
        return keras.layers.Dense(1, name="out")(x)

    def compile_kwargs(self, learning_rate=1e-3):
        return {
            "optimizer": keras.optimizers.Adam(learning_rate),
            "loss": "mse",
        }


class CriteoModel(ModelSpec):
    """The `criteo` workload's model on TSV lines, at the issue's sizes.

    `benchmarks.workloads.criteo`'s parsing and hashing layers and its
    DLRM-like trunk (`--trunk light`), batch 128.
    """

    name = "criteo"
    description = (
        "criteo-like: Criteo-format TSV lines -> decode_csv, log1p, per-field "
        "to_hash_bucket_fast in the model; DLRM-like trunk: bottom MLP (32, "
        "16), Embedding(26 x 1000, 16), dot interaction, top MLP (128, 64, "
        "1); Adam, binary cross-entropy"
    )
    batch_size = 128
    # The table: validation 40 + 10 batches for 3 epochs.
    sizes = Sizes(val_train_batches=40, val_epochs=3)
    regimes = (
        "validation",
        "evaluate_x3",
        "fit_epochs1_x4",
        "fresh_model",
        "fit_2_epochs",
    )

    def __init__(self):
        # Its layers and trunk; `steps` sizes only its own data, unused.
        self._workload = CriteoWorkload(steps=1)

    def make_data(self, count, seed):
        lines, labels = make_criteo_lines(count, seed)
        return np.array(lines, dtype=object), labels

    def inputs(self):
        return self._workload.raw_inputs()

    def features(self, x, adapt_data):
        for layer in self._workload.preprocessing():
            x = layer(x)
        return x

    def trunk(self, features):
        return self._workload.trunk(features)

    def compile_kwargs(self, learning_rate=1e-3):
        return {
            "optimizer": keras.optimizers.Adam(learning_rate),
            "loss": "binary_crossentropy",
        }


class FeatureSpaceModel(ModelSpec):
    """keras.io's "Structured data classification with FeatureSpace".

    The example's `FeatureSpace` (`benchmarks.workloads.heart`), adapted
    to the training rows, then Dense(32, relu) -> Dropout(0.5) -> Dense(1,
    sigmoid). Plain: one model from the raw dict inputs (the example's
    inference model, trained); staged: the same with a `StagedInput` first,
    the encoding as a nested model; expert: the example itself, the
    `FeatureSpace` in `dataset.map`, a training model of the encoded
    features.
    """

    name = "featurespace"
    description = (
        "keras.io FeatureSpace example: 13 heart-disease columns (6 integer "
        "categorical, 'thal' string categorical, 'age' discretized in 30 "
        "bins, 5 normalized), crosses sex x age (64) and thal x ca (16), "
        "concatenated -> Dense(32, relu) -> Dropout(0.5) -> Dense(1, "
        "sigmoid); Adam, binary crossentropy, accuracy"
    )
    regimes = ("featurespace_fit",)
    adapt_part = "example_train"

    def make_data(self, count, seed):
        return heart.make_heart_data(count, seed)

    def inputs(self):
        raise NotImplementedError("the FeatureSpace makes its inputs")

    def features(self, x, adapt_data):
        raise NotImplementedError("the FeatureSpace makes its features")

    def feature_space(self, adapt_data):
        """The example's `FeatureSpace`, adapted as the example adapts it."""
        feature_space = heart.feature_space()
        dataset = tf.data.Dataset.from_tensor_slices(adapt_data)
        feature_space.adapt(dataset.batch(self.batch_size))
        return feature_space

    def inputs_and_features(self, adapt_data, staged_input=None):
        feature_space = self.feature_space(adapt_data)
        # A plain dict: the FeatureSpace tracks its inputs in a dict of its
        # own type, which a model's every call would warn does not match
        # the dict it is given.
        raw = dict(feature_space.get_inputs())
        encoded = feature_space.get_encoded_features()
        if staged_input is None:
            return raw, encoded
        # The encoded features hang off the FeatureSpace's own inputs: a
        # StagedInput goes before them by calling them as a nested model.
        encode = keras.Model(raw, encoded, name="feature_space")
        inputs = {
            name: keras.Input(shape=(1,), dtype=raw[name].dtype, name=name)
            for name in sorted(raw)
        }
        return inputs, encode(staged_input(inputs))

    def expert_parts(self, adapt_data):
        feature_space = self.feature_space(adapt_data)
        return feature_space, feature_space.get_encoded_features()

    def trunk(self, features):
        x = keras.layers.Dense(32, activation="relu")(features)
        x = keras.layers.Dropout(0.5)(x)
        return keras.layers.Dense(1, activation="sigmoid")(x)


MODELS = {
    model.name: model
    for model in (
        TabularModel(),
        DenseModel(),
        CriteoModel(),
        FeatureSpaceModel(),
    )
}
# Without `--models`: the models of the earlier results.
DEFAULT_MODELS = ("tabular", "dense")


# -- the modes -------------------------------------------------------------


class StepClock(keras.callbacks.Callback):
    """Sums the time of every batch of the calls it is passed to.

    From `on_*_batch_begin` to `on_*_batch_end` of train, test (validation
    included) and predict batches: the steps and their waits for data,
    none of the calls' set-up, epoch boundaries or tear-down.
    """

    def __init__(self):
        super().__init__()
        self.seconds = 0.0
        self.steps = 0
        self._begin = None

    def __deepcopy__(self, memo):
        # keras-tuner deep-copies the callbacks of every trial: the copies
        # must add to this clock.
        return self

    def _batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def _batch_end(self, batch, logs=None):
        self.seconds += time.perf_counter() - self._begin
        self.steps += 1

    on_train_batch_begin = on_test_batch_begin = _batch_begin
    on_predict_batch_begin = _batch_begin
    on_train_batch_end = on_test_batch_end = on_predict_batch_end = _batch_end


class PlainMode:
    """The whole model as a `keras.Model`, fed arrays or a dataset.

    `feed` returns what `fit`/`evaluate`/`predict` are given for a part of
    the data; `call` makes one such call with the step clock among its
    callbacks. The other modes change how the model is built and fed.

    Args:
        spec: The `ModelSpec`.
        data: `{part: (x, y)}` (see `make_data`).
        feed: "arrays" or "dataset" (see `FEEDS`).
    """

    name = "plain"
    model_class = keras.Model

    def __init__(self, spec, data, feed="arrays"):
        self.spec = spec
        self.data = data
        self.feed_kind = feed
        self.model = None

    def staged_input(self):
        """A `StagedInput` to put on the inputs, or None."""
        return None

    def compile_kwargs(self, learning_rate=1e-3):
        return self.spec.compile_kwargs(learning_rate)

    def fit_callbacks(self):
        return []

    def new_model(self, learning_rate=1e-3):
        """A new compiled model from the seed, in this mode's style."""
        keras.utils.set_random_seed(SEED)
        inputs, features = self.spec.inputs_and_features(
            self.data[self.spec.adapt_part][0], self.staged_input()
        )
        model = self.model_class(inputs, self.spec.trunk(features))
        model.compile(**self.compile_kwargs(learning_rate))
        return model

    def build(self):
        """Builds the mode's model (set-up, or each fresh_model trial)."""
        self.model = self.new_model()

    def fresh(self):
        """A new mode of this kind on the same data, built."""
        mode = type(self)(self.spec, self.data, self.feed_kind)
        mode.build()
        return mode

    def raw_dataset(self, part, training=False):
        """A user's dataset of `self.data[part]`, batched.

        `training`: shuffled, every iteration (as `fit` shuffles arrays
        every epoch).
        """
        x, y = self.data[part]
        labelled = part != "predict"
        dataset = tf.data.Dataset.from_tensor_slices((x, y) if labelled else x)
        if training:
            dataset = dataset.shuffle(len(y))
        return dataset.batch(self.spec.batch_size)

    def feed(self, part, training=False):
        """What a call on `self.data[part]` is given (no labels to predict).

        `training`: the data `fit` trains on (shuffled).
        """
        if self.feed_kind == "dataset":
            return {"x": self.raw_dataset(part, training)}
        x, y = self.data[part]
        if part == "predict":
            return {"x": x, "batch_size": self.spec.batch_size}
        return {"x": x, "y": y, "batch_size": self.spec.batch_size}

    def call_kwargs(self, method, clock, feed, validation=None, **kwargs):
        """What `model.<method>` is given: `feed`, `kwargs`, the callbacks.

        `validation`: a `feed` of `fit`'s validation data, or None.
        """
        callbacks = [clock]
        if method == "fit":
            callbacks += self.fit_callbacks()
            if isinstance(feed["x"], tf.data.Dataset):
                # The dataset shuffles; fit's default would warn that it
                # cannot.
                kwargs["shuffle"] = False
        if validation is not None:
            kwargs["validation_data"] = (
                (validation["x"], validation["y"])
                if "y" in validation
                else validation["x"]
            )
        return {**feed, **kwargs, "callbacks": callbacks, "verbose": 0}

    def call(self, method, clock, feed, validation=None, **kwargs):
        """`model.<method>(**feed, **kwargs)` with `clock` as a callback.

        `validation`: a `feed` of `fit`'s validation data, or None.
        """
        return getattr(self.model, method)(
            **self.call_kwargs(method, clock, feed, validation, **kwargs)
        )


class StagedMode(PlainMode):
    """keras_stage's three lines with defaults; fed as plain is."""

    name = "staged"
    model_class = keras_stage.Model

    def staged_input(self):
        return keras_stage.layers.StagedInput()

    def compile_kwargs(self, learning_rate=1e-3):
        return {**self.spec.compile_kwargs(learning_rate), "smart_stage": True}

    def fit_callbacks(self):
        return [keras_stage.callbacks.PrefetchCallback()]


class ExpertMode(PlainMode):
    """The preprocessing in a tf.data map, a `keras.Model` of the trunk.

    Whatever the feed, a dataset: the user's, mapped and prefetched.
    """

    name = "expert"

    def build(self):
        keras.utils.set_random_seed(SEED)
        self.preprocess, self._features = self.spec.expert_parts(
            self.data[self.spec.adapt_part][0]
        )
        self.model = self.new_model()

    def new_model(self, learning_rate=1e-3):
        """A new compiled trunk; the preprocessing of `build` is kept."""
        keras.utils.set_random_seed(SEED)
        inputs = _inputs_like(self._features)
        model = keras.Model(inputs, self.spec.trunk(inputs))
        model.compile(**self.compile_kwargs(learning_rate))
        return model

    def feed(self, part, training=False):
        dataset = self.raw_dataset(part, training)
        # None: nothing to preprocess, the pipeline is the prefetch alone.
        if self.preprocess is not None:
            preprocess = self.preprocess
            dataset = dataset.map(
                (lambda x, y: (preprocess(x), y))
                if part != "predict"
                else preprocess,
                num_parallel_calls=tf.data.AUTOTUNE,
            )
        return {"x": dataset.prefetch(tf.data.AUTOTUNE)}


class ControlMode(PlainMode):
    """Plain again (`--control`): the noise floor of the paired ratios."""

    name = CONTROL


MODE_CLASSES = {
    mode.name: mode for mode in (PlainMode, StagedMode, ExpertMode, ControlMode)
}


# -- the regimes -----------------------------------------------------------


def short_epochs(mode, clock, sizes):
    mode.call("fit", clock, mode.feed("train", True), epochs=sizes.epochs)


def validation(mode, clock, sizes):
    mode.call(
        "fit",
        clock,
        mode.feed("val_train", True),
        validation=mode.feed("val"),
        epochs=sizes.val_epochs,
    )


def evaluate_x3(mode, clock, sizes):
    feed = mode.feed("eval")
    for _ in range(sizes.eval_calls):
        mode.call("evaluate", clock, feed)


def fit_epochs1_x4(mode, clock, sizes):
    feed = mode.feed("train", True)
    for _ in range(sizes.fit_calls):
        mode.call("fit", clock, feed, epochs=1)


def predict8_x10(mode, clock, sizes):
    feed = mode.feed("predict")
    for _ in range(sizes.predict_calls):
        mode.call("predict", clock, feed)


def fresh_model(mode, clock, sizes):
    # Each trial from the top of a script: model, datasets and fit.
    for _ in range(sizes.fresh_trials):
        fresh = mode.fresh()
        fresh.call(
            "fit", clock, fresh.feed("train", True), epochs=sizes.fresh_epochs
        )


def fit_2_epochs(mode, clock, sizes):
    mode.call("fit", clock, mode.feed("long", True), epochs=sizes.long_epochs)


def featurespace_fit(mode, clock, sizes):
    mode.call(
        "fit",
        clock,
        mode.feed("example_train", True),
        validation=mode.feed("example_val"),
        epochs=sizes.example_epochs,
    )


def tuner_search(mode, clock, sizes):
    """A keras-tuner `RandomSearch` on one pair of datasets (or arrays).

    Each trial is a new model of the mode's style (`mode.new_model`) with
    a learning rate the tuner draws; the same draws in every mode (seed).
    """
    import keras_tuner

    train = mode.feed("tune", True)
    val = mode.feed("val")
    with tempfile.TemporaryDirectory() as directory:
        tuner = keras_tuner.RandomSearch(
            lambda hp: mode.new_model(
                hp.Float("learning_rate", 1e-4, 1e-2, sampling="log")
            ),
            objective="val_loss",
            max_trials=sizes.tuner_trials,
            seed=SEED,
            directory=directory,
            project_name=mode.name,
            overwrite=True,
        )
        tuner.search(
            **mode.call_kwargs(
                "fit", clock, train, val, epochs=sizes.tuner_epochs
            )
        )
    # keras-tuner logs a failed trial and goes on: a measurement of failed
    # trials would time nothing.
    failed = [
        trial
        for trial in tuner.oracle.trials.values()
        if trial.status == "FAILED"
    ]
    if failed:
        raise RuntimeError(
            f"tuner_search in mode {mode.name}: {len(failed)} of "
            f"{sizes.tuner_trials} trials failed; the first: "
            f"{failed[0].message}"
        )


def keras_tuner_missing():
    """Why `tuner_search` cannot run here, or None when it can."""
    try:
        import keras_tuner  # noqa: F401
    except ImportError as error:
        return f"keras_tuner is not importable ({error}): {KERAS_TUNER_INSTALL}"
    return None


@dataclasses.dataclass(frozen=True)
class Regime:
    """A sequence of calls.

    `describe(sizes, batch_size)` says which; `parts` are the data parts
    its calls use; `bound` is the target on staged/plain and
    `expert_bound`, when set, the one on staged/expert; `warm_up` whether
    each mode runs it once untimed first; `missing()`, when set, says why
    the regime cannot run here (None when it can).
    """

    run: object
    describe: object
    parts: tuple
    bound: float = 1.05
    expert_bound: float = None
    warm_up: bool = True
    missing: object = None


REGIMES = {
    "short_epochs": Regime(
        short_epochs,
        lambda s, b: f"fit, {s.train_batches} batches x {s.epochs} epochs",
        ("train",),
    ),
    "validation": Regime(
        validation,
        lambda s, b: (
            f"fit, {s.val_train_batches} batches x {s.val_epochs} epochs, "
            f"validation_data of {s.val_batches} batches every epoch"
        ),
        ("val_train", "val"),
    ),
    "evaluate_x3": Regime(
        evaluate_x3,
        lambda s, b: (
            f"evaluate on {s.eval_batches} batches, {s.eval_calls} calls"
        ),
        ("eval",),
    ),
    "fit_epochs1_x4": Regime(
        fit_epochs1_x4,
        lambda s, b: (
            f"fit(epochs=1) on {s.train_batches} batches, {s.fit_calls} calls"
        ),
        ("train",),
    ),
    "predict8_x10": Regime(
        predict8_x10,
        lambda s, b: (
            f"predict on {s.predict_examples} examples, {s.predict_calls} calls"
        ),
        ("predict",),
        bound=1.5,
    ),
    "fresh_model": Regime(
        fresh_model,
        lambda s, b: (
            f"{s.fresh_trials} x (new model: build, compile, fit "
            f"{s.train_batches} batches x {s.fresh_epochs} epochs), cold"
        ),
        ("train",),
        bound=1.10,
        warm_up=False,
    ),
    "fit_2_epochs": Regime(
        fit_2_epochs,
        lambda s, b: (
            f"fit, {s.long_batches} batches x {s.long_epochs} epochs "
            "(the determinism rows' fit)"
        ),
        ("long",),
        expert_bound=1.10,
    ),
    "featurespace_fit": Regime(
        featurespace_fit,
        lambda s, b: (
            f"keras.io FeatureSpace example's fit: {s.example_train_rows} "
            f"rows (batch {b}) x {s.example_epochs} epochs, validation_data "
            f"of {s.example_val_rows} rows every epoch"
        ),
        ("example_train", "example_val"),
    ),
    "tuner_search": Regime(
        tuner_search,
        lambda s, b: (
            f"keras-tuner RandomSearch, {s.tuner_trials} trials (new model "
            f"each, learning rate drawn) x {s.tuner_epochs} epochs of "
            f"{s.tuner_batches} batches, validation_data of {s.val_batches} "
            "batches every epoch, cold"
        ),
        ("tune", "val"),
        bound=1.10,
        warm_up=False,
        missing=keras_tuner_missing,
    ),
}


def target(model_name, regime_name, feed="arrays"):
    """The bound on staged/plain (whole calls) the issues set.

    1.05 (fresh_model and tuner_search 1.10, predict8_x10 1.5); on arrays,
    1.0 for a model with preprocessing to overlap in the regimes that step
    over several batches with a warm model.
    """
    regime = REGIMES[regime_name]
    if feed == "arrays" and model_name == "tabular" and regime.bound == 1.05:
        return 1.0
    return regime.bound


def enable_determinism():
    """Keras's recipe for op determinism, for the rest of the process."""
    keras.utils.set_random_seed(SEED)
    tf.config.experimental.enable_op_determinism()


# -- the run ---------------------------------------------------------------

# Each part's data seed; the first four as in the earlier results.
_PART_SEEDS = {
    "train": 0,
    "val": 1,
    "eval": 2,
    "predict": 3,
    "val_train": 4,
    "long": 5,
    "tune": 6,
    "example_train": 7,
    "example_val": 8,
}


def make_data(spec, sizes, parts=None):
    """`{part: (x, y)}` of `parts` (default: every part), from fixed seeds.

    The adapt part of `spec` is always made.
    """
    parts = set(_PART_SEEDS if parts is None else parts) | {spec.adapt_part}
    batch = spec.batch_size
    counts = {
        "train": sizes.train_batches * batch,
        "val_train": sizes.val_train_batches * batch,
        "val": sizes.val_batches * batch,
        "eval": sizes.eval_batches * batch,
        "predict": sizes.predict_examples,
        "long": sizes.long_batches * batch,
        "tune": sizes.tuner_batches * batch,
        # Two draws of one distribution, as keras.io's random split of its
        # one table is; each holds every categorical value (see heart).
        "example_train": sizes.example_train_rows,
        "example_val": sizes.example_val_rows,
    }
    # As long as train, the validation regime trains on train's examples,
    # as it did before it had a part of its own.
    same = sizes.val_train_batches == sizes.train_batches
    data = {
        part: spec.make_data(count, _PART_SEEDS[part])
        for part, count in counts.items()
        if part in parts and not (part == "val_train" and same)
    }
    if "val_train" in parts and same:
        data["val_train"] = data.get("train") or spec.make_data(
            counts["train"], _PART_SEEDS["train"]
        )
    return data


def measure(regime, mode, sizes):
    """One timed pass of `regime` in `mode`, then an untimed collection."""
    clock = StepClock()
    with decisions_logged() as decisions:
        cpu_started = time.process_time()
        started = time.perf_counter()
        regime.run(mode, clock, sizes)
        seconds = time.perf_counter() - started
        cpu_seconds = time.process_time() - cpu_started
    started = time.perf_counter()
    gc.collect()
    return {
        "seconds": seconds,
        # The process's CPU time (every thread: the steps, tf.data's
        # threads, the stage's): less bent by other jobs than wall time.
        "cpu_seconds": cpu_seconds,
        "steps_seconds": clock.seconds,
        "steps": clock.steps,
        "gc_seconds": time.perf_counter() - started,
        # What keras_stage decided for each call, in order ("" for a
        # plain model): the same work should get the same decision.
        "decisions": compact(decisions),
    }


def _median(records, key):
    return statistics.median(record[key] for record in records)


def _paired(records, name, key, reference="plain"):
    return paired_ratio(
        [r[key] for r in records[name]], [r[key] for r in records[reference]]
    )


def check(ratio, bound, value, control):
    """A target's record: strictly met, and met within the control's noise.

    A ratio counts as met within noise when it is at most the bound plus
    the control's distance from 1 (two equal modes differ by that much).
    """
    distance = None if control is None else abs(control - 1)
    return {
        "ratio": ratio,
        "bound": bound,
        "value": value,
        "met": None if value is None else value <= bound,
        "control": control,
        "control_distance": distance,
        "met_within_noise": (
            None
            if value is None or distance is None
            else value <= bound + distance
        ),
    }


def decisions_summary(rounds):
    """How the staged rounds of a regime decided its calls.

    `rounds`: each round's `measure(...)["decisions"]`. `agree`'s summary
    of them, and whether the rounds after the first decided alike (the
    first timed round may still learn the stage's costs).
    """
    return {**agree(rounds), "same_after_first": agree(rounds[1:])["same"]}


def summarize_regime(
    model_name,
    regime_name,
    records,
    sizes,
    batch_size=32,
    feed="arrays",
    determinism=False,
):
    """Medians per mode, paired ratios to plain and the target checks."""
    regime = REGIMES[regime_name]
    description = regime.describe(sizes, batch_size)
    # In the description, which `benchmarks.history` copies into its rows:
    # there a dataset run's rows must not read as an arrays run's.
    if feed == "dataset":
        description += "; fed a tf.data.Dataset"
    if determinism:
        description += "; op determinism on"
    modes = {
        name: {
            "seconds_median": _median(mode_records, "seconds"),
            "steps_seconds_median": _median(mode_records, "steps_seconds"),
            "cpu_seconds_median": _median(mode_records, "cpu_seconds"),
            "steps": mode_records[0]["steps"],
            "rounds": mode_records,
        }
        for name, mode_records in records.items()
    }
    ratios = {
        f"{name}/plain": {
            "seconds": _paired(records, name, "seconds"),
            "steps_seconds": _paired(records, name, "steps_seconds"),
            "cpu_seconds": _paired(records, name, "cpu_seconds"),
        }
        for name in records
        if name != "plain"
    }
    versus_expert = regime.expert_bound is not None and {
        "staged",
        "expert",
    } <= set(records)
    if versus_expert:
        ratios["staged/expert"] = {
            key: _paired(records, "staged", key, "expert")
            for key in ("seconds", "steps_seconds", "cpu_seconds")
        }
    control = ratios.get(f"{CONTROL}/plain", {}).get("seconds")
    out = {
        "description": description,
        "modes": modes,
        "paired_ratios": ratios,
        "target": check(
            "staged/plain, whole calls (paired)",
            target(model_name, regime_name, feed),
            ratios["staged/plain"]["seconds"] if "staged" in records else None,
            control,
        ),
    }
    if "staged" in records:
        out["decisions"] = decisions_summary(
            [r.get("decisions", "") for r in records["staged"]]
        )
    if versus_expert:
        out["expert_target"] = check(
            "staged/expert, whole calls (paired)",
            regime.expert_bound,
            ratios["staged/expert"]["seconds"],
            control,
        )
    return out


def run_model(
    spec,
    regime_names,
    mode_names,
    rounds,
    sizes,
    log=print,
    feed="arrays",
    determinism=False,
):
    """Every regime of `spec`'s model in every mode; the model's results."""
    out = {
        "description": spec.description,
        "batch_size": spec.batch_size,
        "sizes": dataclasses.asdict(sizes),
        "regimes": {},
    }
    skipped = {}
    for name in regime_names:
        missing = REGIMES[name].missing
        reason = missing() if missing is not None else None
        if reason is not None:
            log(f"{spec.name} {name}: skipped, {reason}")
            skipped[name] = reason
    regime_names = [name for name in regime_names if name not in skipped]
    if skipped:
        out["skipped"] = skipped
    parts = {part for name in regime_names for part in REGIMES[name].parts}
    data = make_data(spec, sizes, parts)
    modes = {name: MODE_CLASSES[name](spec, data, feed) for name in mode_names}
    for mode in modes.values():
        mode.build()
    for regime_name in regime_names:
        regime = REGIMES[regime_name]
        # After every model is built: a traced model's first step is slow
        # again once another model has been traced (TF 2.21).
        if regime.warm_up:
            for mode in modes.values():
                measure(regime, mode, sizes)
        records = {name: [] for name in modes}
        names = list(modes)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                records[name].append(measure(regime, modes[name], sizes))
            log(
                f"{spec.name} {regime_name}: round {round_index + 1}/{rounds}"
                + "".join(
                    f"  {name} {records[name][-1]['seconds']:.3f}s"
                    for name in names
                )
            )
        out["regimes"][regime_name] = summarize_regime(
            spec.name,
            regime_name,
            records,
            sizes,
            spec.batch_size,
            feed,
            determinism,
        )
    if "staged" in modes:
        plan = modes["staged"].model.get_stage_plan()
        out["staged_plan"] = {
            "staged_layers": list(plan.staged_layers),
            "trunk_layers": list(plan.trunk_layers),
        }
    return out


def run(
    model_names,
    regime_names,
    rounds,
    sizes=None,
    log=print,
    argv=None,
    control=False,
    modes=MODES,
    feed="arrays",
    determinism=False,
):
    """Runs the regimes of every model; returns the results as a dict.

    `regime_names`: the regimes of every model, or None for each model's
    own (`ModelSpec.regimes`); `sizes`: the sizes of every model, or None
    for each model's own (`ModelSpec.sizes`); `modes`: the modes to time,
    plain first (paired ratios are to plain); `control`: adds the
    `CONTROL` mode (see `ControlMode`); `feed`: one of `FEEDS`;
    `determinism`: turns op determinism on for the rest of the process
    (see `enable_determinism`).
    """
    started = time.perf_counter()
    mode_names = tuple(modes) + ((CONTROL,) if control else ())
    if mode_names[0] != "plain" or len(set(mode_names)) != len(mode_names):
        raise ValueError(
            f"modes={mode_names!r}: plain must come first, each mode once"
        )
    if feed not in FEEDS:
        raise ValueError(f"feed={feed!r}: expected one of {FEEDS}")
    if determinism:
        enable_determinism()
    before = environment.snapshot()
    results = {
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": argv,
        "config": {
            "models": list(model_names),
            "regimes": None if regime_names is None else list(regime_names),
            "modes": list(mode_names),
            "rounds": rounds,
            "feed": feed,
            "determinism": determinism,
            "seed": SEED,
        },
        "timed": TIMED,
        "environment": environment.describe(),
        "models": {},
    }
    for name in model_names:
        spec = MODELS[name]
        results["models"][name] = run_model(
            spec,
            spec.regimes if regime_names is None else regime_names,
            mode_names,
            rounds,
            spec.sizes if sizes is None else sizes,
            log,
            feed,
            determinism,
        )
    results["load"] = environment.load_between(before, environment.snapshot())
    results["wall_seconds"] = time.perf_counter() - started
    results["targets"] = [
        {"model": model, "regime": regime, **section[key]}
        for model, model_section in results["models"].items()
        for regime, section in model_section["regimes"].items()
        for key in ("target", "expert_target")
        if key in section
    ]
    return results


def _cell(value, fmt):
    if value is None:  # a mode not run: a dash as wide as the column
        return format("-", f">{fmt.split('.')[0]}")
    return format(value, fmt)


_STATUS = {True: "met", False: "NOT met", None: "n/a"}


def _verdict(check):
    """`<= 1.05 NOT met (noise 0.031: met)`: strict, then within noise."""
    text = f"<= {check['bound']:.2f} {_STATUS[check['met']]}"
    if check["control_distance"] is not None:
        text += (
            f" (noise {check['control_distance']:.3f}:"
            f" {_STATUS[check['met_within_noise']]})"
        )
    return text


def _decisions_line(decisions):
    """`summarize_regime`'s decisions of the staged rounds, in words."""
    sequences, counts = decisions["sequences"], decisions["counts"]
    rounds = sum(counts)
    if decisions["same"]:
        return f"the same in all {rounds} rounds ({sequences[0] or 'none'})"
    if decisions["same_after_first"]:
        return (
            f"round 1: {sequences[0] or 'none'}; rounds 2-{rounds}: "
            f"{sequences[1] or 'none'}"
        )
    return "DIFFER: " + "; ".join(
        f"{count} rounds: {sequence or 'none'}"
        for sequence, count in zip(sequences, counts, strict=True)
    )


def format_table(results):
    """The results as text: per model, a row per regime."""
    lines = []
    header = (
        f"{'regime':16} {'whole s: plain':>14} {'staged':>7} {'expert':>7}"
        f" {'steps s: plain':>15} {'staged':>7} {'expert':>7}"
        f" {'staged/plain':>12} {'steps':>6} {'expert/plain':>12}"
        f" {'steps':>6}"
    )
    control = CONTROL in results["config"]["modes"]
    if control:
        header += f" {CONTROL + '/plain':>17} {'steps':>6}"
    header += "  target on staged/plain"
    config = results["config"]
    lines.append(
        f"feed: {config.get('feed', 'arrays')}"
        + (", op determinism on" if config.get("determinism") else "")
    )
    for model, section in results["models"].items():
        lines += [
            "",
            f"{model} (batch {section.get('batch_size', '?')}): "
            f"{section['description']}",
            header,
        ]
        for regime, result in section["regimes"].items():
            modes = result["modes"]
            ratios = result["paired_ratios"]

            def median(name, key, modes=modes):
                mode = modes.get(name)
                return None if mode is None else mode[key]

            def ratio(name, key, ratios=ratios):
                pair = ratios.get(f"{name}/plain")
                return None if pair is None else pair.get(key)

            lines.append(
                f"{regime:16}"
                f" {_cell(median('plain', 'seconds_median'), '14.3f')}"
                f" {_cell(median('staged', 'seconds_median'), '7.3f')}"
                f" {_cell(median('expert', 'seconds_median'), '7.3f')}"
                f" {_cell(median('plain', 'steps_seconds_median'), '15.3f')}"
                f" {_cell(median('staged', 'steps_seconds_median'), '7.3f')}"
                f" {_cell(median('expert', 'steps_seconds_median'), '7.3f')}"
                f" {_cell(ratio('staged', 'seconds'), '12.3f')}"
                f" {_cell(ratio('staged', 'steps_seconds'), '6.3f')}"
                f" {_cell(ratio('expert', 'seconds'), '12.3f')}"
                f" {_cell(ratio('expert', 'steps_seconds'), '6.3f')}"
                + (
                    f" {_cell(ratio(CONTROL, 'seconds'), '17.3f')}"
                    f" {_cell(ratio(CONTROL, 'steps_seconds'), '6.3f')}"
                    if control
                    else ""
                )
                + f"  {_verdict(result['target'])}"
            )
            cpu = ratio("staged", "cpu_seconds") if "staged" in modes else None
            if cpu is not None:
                lines.append(
                    f"{'':16} CPU time: staged/plain {cpu:.3f}"
                    + (
                        f", {CONTROL}/plain {ratio(CONTROL, 'cpu_seconds'):.3f}"
                        if control
                        else ""
                    )
                )
            if "decisions" in result:
                lines.append(
                    f"{'':16} decisions: {_decisions_line(result['decisions'])}"
                )
            if "expert_target" in result:
                pair = ratios["staged/expert"]
                lines.append(
                    f"{'':16} staged/expert {pair['seconds']:.3f} (steps "
                    f"{pair['steps_seconds']:.3f})  target on staged/expert "
                    f"{_verdict(result['expert_target'])}"
                )
        for regime, result in section["regimes"].items():
            lines.append(f"  {regime}: {result['description']}")
        for regime, reason in section.get("skipped", {}).items():
            lines.append(f"  {regime}: skipped, {reason}")
    return "\n".join(lines)


def _names(parser, option, value, known):
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(
            f"--{option}: unknown {unknown}; choose from {list(known)}"
        )
    return names


def parse_args(argv=None):
    """Parses the command line (see `--help`)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.regimes",
        description=(
            "Time whole fit/evaluate/predict calls (set-up included) and "
            "their steps alone in short regimes: plain, staged and expert, "
            "interleaved, with paired ratios to plain."
        ),
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"timed rounds (default {DEFAULT_ROUNDS}, {QUICK_ROUNDS} with "
        "--quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="every regime at its smallest (2 batches, 2 calls...): a smoke "
        "run, not a measurement",
    )
    parser.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated, from {','.join(MODELS)} (default: "
        f"{','.join(DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--regimes",
        default=None,
        help=f"comma-separated, from {','.join(REGIMES)} (default: each "
        "model's own: "
        + "; ".join(
            f"{name}: {','.join(spec.regimes)}" for name, spec in MODELS.items()
        )
        + ")",
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated, plain first, from "
        f"{','.join(m for m in MODE_CLASSES if m != CONTROL)} (default: all); "
        "fewer modes fit more rounds in the same time",
    )
    parser.add_argument(
        "--feed",
        choices=FEEDS,
        default="arrays",
        help="what plain, staged and the control are given: numpy arrays "
        "(default) or a tf.data.Dataset, built once per sequence of calls",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help=f"add a second plain model ({CONTROL}): its paired ratio to "
        "plain is the run's noise floor",
    )
    parser.add_argument(
        "--determinism",
        action="store_true",
        help="keras.utils.set_random_seed + tf.config.experimental."
        "enable_op_determinism() for the whole run (it cannot be turned off: "
        "a separate run)",
    )
    parser.add_argument(
        "--name", default="regimes", help="results file name (default regimes)"
    )
    parser.add_argument(
        "--out",
        default=RESULTS_DIR,
        help="output folder (default: benchmarks/results/regimes)",
    )
    args = parser.parse_args(argv)
    args.models = _names(parser, "models", args.models, MODELS)
    if args.regimes is not None:
        args.regimes = _names(parser, "regimes", args.regimes, REGIMES)
    args.modes = _names(
        parser, "modes", args.modes, {name: None for name in MODES}
    )
    if args.modes[0] != "plain":
        parser.error(
            f"--modes: plain comes first (ratios are to it): {args.modes}"
        )
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv=None):
    """Runs the regimes, prints the table, writes the JSON; returns 0."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = run(
        args.models,
        args.regimes,
        args.rounds,
        TINY if args.tiny else None,
        log=lambda line: print(line, flush=True),
        argv=["benchmarks.regimes", *argv],
        control=args.control,
        modes=args.modes,
        feed=args.feed,
        determinism=args.determinism,
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print()
    print(format_table(results))
    print(f"\nWrote {path} ({results['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
