"""What one process of `benchmarks.jax_scale` runs: its workloads and fits.

`benchmarks.jax_scale` starts JAX in a child process (its devices, and
`jax.distributed` across two processes) and then imports this module,
which imports Keras. Here: the two workloads (`criteo`, reused from
`benchmarks.jax_backend`, and `dcn`), the three modes (`staged`, `hand`
and `hand2`, the control), and one workload's rounds in one process
(`run_workload`), under whatever `keras.distribution` is set.
"""

import gc
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

import keras_stage
from benchmarks import jax_backend
from benchmarks.paired import paired_ratio
from benchmarks.scripts.dcn import INT_FEATURES, STR_FEATURES, make_ratings

SEED = jax_backend.SEED
EPOCHS = 2
MODES = ("staged", "hand", "hand2")


class CriteoWorkload(jax_backend.CriteoLikeWorkload):
    """`benchmarks.jax_backend`'s Criteo-like model, sized for this run."""

    batch_size = 256
    rows = 32 * 256
    quick_rows = 4 * 256


class DCNWorkload:
    """keras.io's "Ranking with Deep and Cross Networks", in plain Keras.

    The MovieLens-shaped ratings of `benchmarks.scripts.dcn`; four integer
    ids through `IntegerLookup` and two strings through `StringLookup`, in
    the model; in the trunk an `Embedding(vocabulary + 1, 8)` per feature,
    concatenated, one cross layer written as keras-rs's `FeatureCross`
    computes it (`x0 * Dense(d)(x0) + x0`), `Dense(192, relu)` x 2,
    `Dense(1)`; AdamW(1e-2), mean squared error.
    """

    name = "dcn"
    batch_size = 1024
    rows = 16 * 1024
    quick_rows = 2 * 1024
    embedding_dim = 8
    description = (
        "DCN-shaped (keras.io's Deep and Cross Networks): 4 int64 ids -> "
        "IntegerLookup, 2 string features -> StringLookup; trunk: "
        "Embedding(vocabulary + 1, 8) per feature, Concatenate, cross "
        "x0 * Dense(48)(x0) + x0, Dense(192, relu) x 2, Dense(1); AdamW(1e-2), "
        "mean squared error"
    )
    features = INT_FEATURES + STR_FEATURES

    def make_data(self, count, seed):
        x, rating = make_ratings(count, seed)
        # Every run makes the same vocabularies from its own data.
        self.vocabularies = {name: np.unique(x[name]) for name in self.features}
        return x, rating.reshape(-1, 1)

    def inputs(self):
        return {
            name: keras.Input(
                shape=(),
                dtype="int64" if name in INT_FEATURES else "string",
                name=name,
            )
            for name in self.features
        }

    def columns(self, x, adapt_data):
        columns = []
        for name in self.features:
            lookup = (
                keras.layers.IntegerLookup
                if name in INT_FEATURES
                else keras.layers.StringLookup
            )
            vocabulary = self.vocabularies[name]
            columns.append(
                lookup(vocabulary=vocabulary, name=f"{name}_lookup")(x[name])
            )
        return columns

    def trunk(self, columns):
        embedded = [
            keras.layers.Embedding(
                len(self.vocabularies[name]) + 1,
                self.embedding_dim,
                name=f"{name}_emb",
            )(column)
            for name, column in zip(self.features, columns, strict=True)
        ]
        x0 = keras.layers.Concatenate(name="features")(embedded)
        crossed = keras.layers.Multiply(name="cross_mul")(
            [x0, keras.layers.Dense(x0.shape[-1], name="cross")(x0)]
        )
        x = keras.layers.Add(name="cross_add")([crossed, x0])
        for i in range(2):
            x = keras.layers.Dense(192, activation="relu", name=f"deep{i}")(x)
        return keras.layers.Dense(1, name="out")(x)

    def compile_kwargs(self):
        return {
            "optimizer": keras.optimizers.AdamW(learning_rate=1e-2),
            "loss": "mean_squared_error",
        }


WORKLOADS = {w.name: w for w in (CriteoWorkload(), DCNWorkload())}


def trunk_weights(model):
    """`{path: array}` of a model's trainable weights (the trunk's)."""
    return {
        w.path: keras.ops.convert_to_numpy(w.value)
        for w in model.trainable_weights
    }


class StagedMode:
    """keras_stage's three lines, fed the raw batches as a dataset."""

    def __init__(self, name, workload, data):
        self.name = name
        self.workload = workload
        self.data = data
        self.model = None

    def build(self):
        keras.utils.set_random_seed(SEED)
        workload = self.workload
        inputs = workload.inputs()
        x = keras_stage.layers.StagedInput()(inputs)
        outputs = workload.trunk(workload.columns(x, self.data[0]))
        self.model = keras_stage.Model(inputs, outputs)
        self.model.compile(**workload.compile_kwargs(), smart_stage=True)

    def dataset(self):
        return tf.data.Dataset.from_tensor_slices(self.data).batch(
            self.workload.batch_size
        )

    def fit(self, epochs=EPOCHS, callbacks=None):
        return self.model.fit(
            self.dataset(), epochs=epochs, verbose=0, callbacks=callbacks
        )


class HandMode(StagedMode):
    """The preprocessing layers in `dataset.map`, a `keras.Model` trunk."""

    def build(self):
        keras.utils.set_random_seed(SEED)
        self.preprocess = jax_backend.hand_preprocess(self.workload, self.data)
        self.model = jax_backend.hand_trunk(self.workload, self.dataset())

    def dataset(self):
        # drop_remainder: Keras reads the global batch size of a dataset it
        # shards across processes from its graph, and a map after a batch
        # of unknown size hides it (the rows are whole batches: none drop).
        preprocess = self.preprocess
        return (
            tf.data.Dataset.from_tensor_slices(self.data)
            .batch(self.workload.batch_size, drop_remainder=True)
            .map(
                lambda x, y: (preprocess(x), y),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
            .prefetch(tf.data.AUTOTUNE)
        )


class Phases(keras.callbacks.Callback):
    """When a fit's first step began, and when each of its epochs ended.

    `split(started, ended)` turns them into the call's phases: its set-up
    (from the call to the first step: the dataset, or the stage, built),
    its first epoch (the first iterator made and read), the later epochs
    and the end (after the last epoch).
    """

    def __init__(self):
        super().__init__()
        self.first_step = None
        self.epoch_ends = []

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_step is None:
            self.first_step = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_ends.append(time.perf_counter())

    def split(self, started, ended):
        """`{phase: seconds}` of a call from `started` to `ended`."""
        first, ends = self.first_step, self.epoch_ends
        return {
            "setup_seconds": first - started,
            "first_epoch_seconds": ends[0] - first,
            "later_epochs_seconds": ends[-1] - ends[0],
            "end_seconds": ended - ends[-1],
        }


def measure(mode, examples, epochs=EPOCHS, collect=True):
    """One timed `fit(epochs=epochs)` of `mode`, then an untimed collection.

    Besides the whole call's seconds, its phases (`Phases`), timed by a
    callback whose two clock reads per step are the same in every mode.
    `collect=False` leaves the collection out (a smoke run's: each takes
    a few tenths of a second of CPU with TensorFlow, JAX and Keras loaded).
    """
    phases = Phases()
    started = time.perf_counter()
    history = mode.fit(epochs, callbacks=[phases])
    ended = time.perf_counter()
    seconds = ended - started
    if collect:
        gc.collect()
    return {
        "seconds": seconds,
        "examples_per_second": examples / seconds,
        "loss": float(history.history["loss"][-1]),
        **phases.split(started, ended),
    }


def weight_difference(model, reference):
    """The largest |model - reference| over the trunks' trainable weights."""
    a, b = trunk_weights(model), trunk_weights(reference)
    if set(a) != set(b):
        raise RuntimeError(
            f"The modes' trunks differ: {sorted(set(a) ^ set(b))}"
        )
    return max(float(np.max(np.abs(a[path] - b[path]))) for path in a)


def _figures(records):
    """A mode's medians over its rounds, and the rounds."""
    return {
        "seconds_median": statistics.median(r["seconds"] for r in records),
        "examples_per_second_median": statistics.median(
            r["examples_per_second"] for r in records
        ),
        "rounds": records,
    }


def _paired(records, key="seconds"):
    """staged/hand and the control hand2/hand of `key`, paired per round."""

    def paired(name):
        return paired_ratio(
            [r[key] for r in records[name]],
            [r[key] for r in records["hand"]],
        )

    return {"staged/hand": paired("staged"), "hand2/hand": paired("hand2")}


def _phases(records):
    """What a call's phases say: its epochs after the first, paired as the
    whole calls are, and the medians of its set-up and first epoch.

    The epochs after the first are the steady state inside a call (one
    iterator each in the hand split, the stage's one iterator read on);
    the set-up and first epoch hold what a call builds once (a dataset's
    map traced, or the stage built, and the first iterator made).
    """
    return {
        "after_first_epoch": _paired(records, "later_epochs_seconds"),
        "setup_and_first_epoch_ms": {
            name: 1000
            * statistics.median(
                r["setup_seconds"] + r["first_epoch_seconds"] for r in rounds
            )
            for name, rounds in records.items()
        },
    }


def run_workload(
    workload, rows, rounds, log=print, steady_epochs=None, collect=True
):
    """The three modes of `workload`, rotated per round; its results.

    Each round times one whole `fit(epochs=EPOCHS)` per mode and, with
    `steady_epochs`, then one whole `fit(epochs=steady_epochs)` per mode
    (the steady state: the call's set-up spread over more epochs), each
    set in the round's rotated order. `collect`: `gc.collect()` after each
    fit, untimed (`measure`).
    """
    data = workload.make_data(rows, SEED)
    examples = rows * EPOCHS
    classes = {"staged": StagedMode, "hand": HandMode, "hand2": HandMode}
    modes = {name: classes[name](name, workload, data) for name in MODES}
    for mode in modes.values():
        mode.build()
    warm_up = {
        name: measure(mode, examples, collect=collect)
        for name, mode in modes.items()
    }
    hand = modes["hand"].model
    check = {
        "staged": weight_difference(modes["staged"].model, hand),
        "hand2": weight_difference(modes["hand2"].model, hand),
    }
    log(
        f"{workload.name}: weight check after the untimed fit: max |staged - "
        f"hand| {check['staged']:.2e}, max |hand2 - hand| {check['hand2']:.2e}"
    )
    records = {name: [] for name in MODES}
    steady = {name: [] for name in MODES}
    for index in range(rounds):
        # The same order in every process: their fits meet in collectives.
        shift = index % len(MODES)
        order = MODES[shift:] + MODES[:shift]
        for name in order:
            records[name].append(
                measure(modes[name], examples, collect=collect)
            )
        line = "".join(
            f"  {name} {records[name][-1]['seconds']:.3f}s" for name in MODES
        )
        if steady_epochs:
            for name in order:
                steady[name].append(
                    measure(
                        modes[name],
                        rows * steady_epochs,
                        steady_epochs,
                        collect=collect,
                    )
                )
            line += f"; {steady_epochs} epochs:" + "".join(
                f"  {name} {steady[name][-1]['seconds']:.3f}s" for name in MODES
            )
        log(f"{workload.name}: round {index + 1}/{rounds}{line}")

    plan = modes["staged"].model.get_stage_plan()
    result = {
        "description": workload.description,
        "rows": rows,
        "batch_size": workload.batch_size,
        "epochs": EPOCHS,
        "examples_per_fit": examples,
        "staged_layers": list(plan.staged_layers),
        "weight_check": {
            "staged_vs_hand": check["staged"],
            "hand2_vs_hand": check["hand2"],
            "what": (
                "max |a - b| over the trunk's trainable weights after the "
                f"untimed fit ({EPOCHS} epochs, no shuffle) from equal "
                "initial weights"
            ),
        },
        "modes": {
            name: {**_figures(records[name]), "warm_up": warm_up[name]}
            for name in MODES
        },
        "paired_ratios": _paired(records),
        "phases": _phases(records),
    }
    if steady_epochs:
        result["steady"] = {
            "epochs": steady_epochs,
            "examples_per_fit": rows * steady_epochs,
            "what": (
                f"whole fit(epochs={steady_epochs}) calls, after the "
                f"{EPOCHS}-epoch fits of the same round: the call's set-up "
                "spread over more epochs"
            ),
            "modes": {name: _figures(steady[name]) for name in MODES},
            "paired_ratios": _paired(steady),
            "phases": _phases(steady),
        }
    return result
