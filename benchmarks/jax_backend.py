"""keras_stage on Keras's JAX or PyTorch backend, against the hand split.

`KERAS_BACKEND=jax python -m benchmarks.jax_backend [--rounds N] [--quick]
[--out PATH]` (in the `.venv-jax` environment; with `KERAS_BACKEND=torch`
in `.venv-torch`, or `python -m benchmarks.torch_backend`, the same on
torch) times whole `fit(epochs=3)` calls of two models with string inputs,
in three modes side by side in one process:

- `staged`: keras_stage's three lines (`StagedInput()` on the inputs,
  `keras_stage.Model`, `compile(..., smart_stage=True)`) and a
  `PrefetchCallback()` in `fit`, fed the numpy arrays. SmartStage runs the
  leading Keras preprocessing layers in a tf.data stage and the rest of the
  model (from the first other layer: `Concatenate`, `Embedding`, `Dense`)
  as Keras's JAX (jitted) or torch step;
- `expert`: the same split by hand: the preprocessing layers called on the
  raw columns in `Dataset.from_tensor_slices((x, y)).batch(B).map(
  preprocess, num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)` (the
  dataset built inside the timed call, as a script builds it), and a
  numeric `keras.Model` of the rest (the trunk), whose inputs take the
  shapes and dtypes of `preprocess`'s outputs;
- `expert_again`: a second `expert`, the control: how far two runs of the
  same mode drift apart on this machine.

Plain Keras cannot fit these models on JAX nor torch (its array adapter
rejects the string columns): the script tries once per workload, a
`keras.Model` of the whole model fitting one batch, and records the error.

The workloads: `tabular`, `benchmarks.regimes.TabularModel` (keras.io's
structured-data model; on JAX and torch its `Concatenate` runs in the
trunk, so the expert's `preprocess` returns the columns and its trunk
starts with the `Concatenate`); and `criteo`, a small Criteo-like model:
the lines of `benchmarks.workloads.criteo.make_criteo_lines` split into 13
numeric columns (`log1p`, through one adapted `Normalization`) and 26
string columns (`Hashing(1000)` each), then in the trunk an
`Embedding(1000, 8)` per string column, `Concatenate` with the numerics,
`Dense(64, relu)`, `Dense(1, sigmoid)`. (The suite's `criteo` workload
parses TSV lines in custom layers of TensorFlow ops, not Keras
preprocessing layers.)

The modes build their models from the same seed (equal initial weights)
and keep them for every round. Each fits once untimed first (tracing and
jit compilation): 3 epochs without shuffling, after which the largest
difference between the staged and expert trunk weights is printed and
recorded, a check that both trained the same model on the same batches.
Every timed `fit` is unshuffled too. One measurement is a whole `fit`
call, set-up and tear-down included (`time.perf_counter`); a callback
also sums its steps alone (`on_train_batch_begin` to
`on_train_batch_end` of every batch). The rounds run the modes in a
rotating order, with an untimed `gc.collect()` after each measurement;
the paired ratio staged/expert is the median over the rounds of the
ratio within a round (so is expert_again/expert). Results: a table, and
`benchmarks/results/<backend>_backend.json` (the backend's versions in
its `environment`).
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402
from benchmarks import environment  # noqa: E402
from benchmarks.paired import paired_ratio  # noqa: E402
from benchmarks.regimes import SEED, StepClock, TabularModel  # noqa: E402
from benchmarks.workloads.criteo import (  # noqa: E402
    NUM_CATEGORICAL,
    NUM_INTEGER,
    make_criteo_lines,
)

SCHEMA_VERSION = 1
EPOCHS = 3
DEFAULT_ROUNDS = 7
QUICK_ROUNDS = 1
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BACKENDS = ("jax", "torch")
MODES = ("staged", "expert", "expert_again")

TIMED = (
    f"One measurement is a whole model.fit(..., epochs={EPOCHS}, "
    "shuffle=False) call, timed with time.perf_counter: set-up (for expert, "
    "building its tf.data pipeline too), steps and tear-down; model "
    "building and compile are outside. steps_seconds is the sum over its "
    "batches of on_train_batch_begin to on_train_batch_end. One untimed "
    "fit per mode first. Modes in a rotating order within each round; "
    "gc.collect() untimed after each measurement. Medians over the rounds; "
    "the paired ratio is the median over the rounds of staged/expert "
    "within a round (above 1: staged slower); expert_again/expert, the "
    "control, likewise."
)


# -- the workloads ---------------------------------------------------------


class TabularWorkload:
    """`benchmarks.regimes.TabularModel`, cut where JAX and torch cut it.

    `columns` builds the model's preprocessing layers on `x` and returns
    their outputs, the inputs of its `Concatenate`; `trunk` is that
    `Concatenate` and the model's MLP. Together: the regimes' model.
    """

    name = "tabular"
    batch_size = 32
    rows = 100 * 32
    quick_rows = 8 * 32

    def __init__(self):
        self.spec = TabularModel()
        self.description = self.spec.description

    def make_data(self, count, seed):
        return self.spec.make_data(count, seed)

    def inputs(self):
        return self.spec.inputs()

    def columns(self, x, adapt_data):
        features = self.spec.features(x, adapt_data)
        layer, node_index, _ = features._keras_history
        return list(layer._inbound_nodes[node_index].input_tensors)

    def trunk(self, columns):
        return self.spec.trunk(
            keras.layers.Concatenate(name="features")(columns)
        )

    def compile_kwargs(self):
        return self.spec.compile_kwargs()


class CriteoLikeWorkload:
    """Criteo's 13 numeric and 26 string fields, Keras layers only.

    The data: `make_criteo_lines`'s fields as columns, the counts
    `log1p`-ed (empty: 0), the categorical fields as strings (empty: "").
    """

    name = "criteo"
    batch_size = 256
    rows = 20_000
    quick_rows = 4 * 256
    buckets = 1000
    embedding_dim = 8
    categorical = tuple(f"C{i + 1}" for i in range(NUM_CATEGORICAL))
    description = (
        "Criteo-like: 13 numeric columns (log1p counts, 'dense') -> adapted "
        "Normalization; 26 string columns -> Hashing(1000) each; trunk: "
        "Embedding(1000, 8) per string column, Concatenate with the "
        "numerics -> Dense(64, relu) -> Dense(1, sigmoid); Adam, binary "
        "crossentropy"
    )

    def make_data(self, count, seed):
        lines, labels = make_criteo_lines(count, seed)
        fields = np.array([line.split("\t") for line in lines], dtype=object)
        counts = fields[:, 1 : 1 + NUM_INTEGER]
        counts = np.where(counts == "", "0", counts).astype(np.float64)
        x = {"dense": np.log1p(counts).astype("float32")}
        for i, name in enumerate(self.categorical):
            x[name] = fields[:, 1 + NUM_INTEGER + i].copy()
        return x, labels

    def inputs(self):
        inputs = {"dense": keras.Input(shape=(NUM_INTEGER,), name="dense")}
        for name in self.categorical:
            inputs[name] = keras.Input(shape=(), dtype="string", name=name)
        return inputs

    def columns(self, x, adapt_data):
        normalize = keras.layers.Normalization(name="dense_norm")
        normalize.adapt(adapt_data["dense"])
        return [normalize(x["dense"])] + [
            keras.layers.Hashing(self.buckets, name=f"{name}_hash")(x[name])
            for name in self.categorical
        ]

    def trunk(self, columns):
        numeric, *ids = columns
        embedded = [
            keras.layers.Embedding(
                self.buckets, self.embedding_dim, name=f"{name}_emb"
            )(column)
            for name, column in zip(self.categorical, ids, strict=True)
        ]
        x = keras.layers.Concatenate(name="features")([numeric, *embedded])
        x = keras.layers.Dense(64, activation="relu", name="hidden")(x)
        return keras.layers.Dense(1, activation="sigmoid", name="out")(x)

    def compile_kwargs(self):
        return {
            "optimizer": keras.optimizers.Adam(1e-3),
            "loss": "binary_crossentropy",
        }


WORKLOADS = {w.name: w for w in (TabularWorkload(), CriteoLikeWorkload())}


def layer_chain(tensor):
    """`(input name, [layers])`: the layers from a model input to `tensor`.

    Each layer on the way takes one tensor (a preprocessing column).
    """
    layers = []
    while True:
        layer, node_index, _ = tensor._keras_history
        node = layer._inbound_nodes[node_index]
        if node.is_input:
            return layer.name, layers[::-1]
        (tensor,) = node.input_tensors
        layers.append(layer)


# -- the modes -------------------------------------------------------------


class StagedMode:
    """keras_stage's three lines with defaults, fed the numpy arrays."""

    name = "staged"

    def __init__(self, workload, data):
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

    def fit(self, clock):
        x, y = self.data
        return self.model.fit(
            x,
            y,
            batch_size=self.workload.batch_size,
            epochs=EPOCHS,
            shuffle=False,
            callbacks=[clock, keras_stage.callbacks.PrefetchCallback()],
            verbose=0,
        )

    def trunk_weights(self):
        """`{path: array}` of the trainable weights (the trunk's)."""
        return {w.path: np.asarray(w) for w in self.model.trainable_weights}


def hand_preprocess(workload, data):
    """The hand split's `preprocess`: the workload's preprocessing layers.

    Built (and adapted on `data`'s columns) as the staged model builds
    them, for a `dataset.map` over the raw batches.
    """
    columns = workload.columns(workload.inputs(), data[0])
    chains = [layer_chain(column) for column in columns]

    def preprocess(x):
        outputs = []
        for name, layers in chains:
            column = x[name]
            for layer in layers:
                column = layer(column)
            # JAX has no int64 without x64 (the stage casts too); torch has.
            if column.dtype == tf.int64 and keras.backend.backend() == "jax":
                column = tf.cast(column, tf.int32)
            outputs.append(column)
        return tuple(outputs)  # tf.data maps return no lists

    return preprocess


def hand_trunk(workload, dataset):
    """The hand split's numeric trunk, compiled, taking `dataset`'s inputs."""
    specs = dataset.element_spec[0]
    trunk_inputs = [
        keras.Input(shape=spec.shape[1:], dtype=spec.dtype.name)
        for spec in specs
    ]
    model = keras.Model(trunk_inputs, workload.trunk(trunk_inputs))
    model.compile(**workload.compile_kwargs())
    return model


class ExpertMode(StagedMode):
    """The preprocessing layers in a tf.data map, a `keras.Model` trunk."""

    name = "expert"

    def build(self):
        keras.utils.set_random_seed(SEED)
        self.preprocess = hand_preprocess(self.workload, self.data)
        self.model = hand_trunk(self.workload, self.dataset())

    def dataset(self):
        preprocess = self.preprocess
        return (
            tf.data.Dataset.from_tensor_slices(self.data)
            .batch(self.workload.batch_size)
            .map(
                lambda x, y: (preprocess(x), y),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
            .prefetch(tf.data.AUTOTUNE)
        )

    def fit(self, clock):
        # shuffle=False: Keras would warn that a dataset ignores it.
        return self.model.fit(
            self.dataset(),
            epochs=EPOCHS,
            shuffle=False,
            callbacks=[clock],
            verbose=0,
        )


class ExpertAgainMode(ExpertMode):
    """A second hand split, the control of the paired ratios."""

    name = "expert_again"


MODE_CLASSES = {
    mode.name: mode for mode in (StagedMode, ExpertMode, ExpertAgainMode)
}


def try_plain(workload, data):
    """Plain Keras fitting one batch: what it raises (or that it ran)."""
    keras.utils.set_random_seed(SEED)
    inputs = workload.inputs()
    model = keras.Model(
        inputs, workload.trunk(workload.columns(inputs, data[0]))
    )
    model.compile(**workload.compile_kwargs())
    x, y = data
    batch = workload.batch_size
    try:
        model.fit(
            {name: column[:batch] for name, column in x.items()},
            y[:batch],
            batch_size=batch,
            epochs=1,
            verbose=0,
        )
    except Exception as error:  # recorded: the point of the attempt
        message = str(error).strip().splitlines()
        return {
            "possible": False,
            "error_type": type(error).__name__,
            "error": message[0] if message else "",
        }
    return {"possible": True, "error_type": None, "error": None}


# -- the run ---------------------------------------------------------------


def measure(mode):
    """One timed `fit` of `mode`, then an untimed collection."""
    clock = StepClock()
    started = time.perf_counter()
    history = mode.fit(clock)
    seconds = time.perf_counter() - started
    started = time.perf_counter()
    gc.collect()
    record = {
        "seconds": seconds,
        "steps_seconds": clock.seconds,
        "steps": clock.steps,
        "gc_seconds": time.perf_counter() - started,
        "loss": float(history.history["loss"][-1]),
    }
    for key in ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped"):
        if key in history.history:
            record[key] = float(history.history[key][-1])
    return record


def weight_difference(staged, expert):
    """The largest |staged - expert| over the trunk's trainable weights."""
    a, b = staged.trunk_weights(), expert.trunk_weights()
    if set(a) != set(b):
        raise RuntimeError(
            f"The modes' trunks differ: {sorted(set(a) ^ set(b))}"
        )
    return max(float(np.max(np.abs(a[path] - b[path]))) for path in a)


def run_workload(workload, rows, rounds, log=print):
    """Both modes of `workload`, interleaved; the workload's results."""
    data = workload.make_data(rows, SEED)
    plain = try_plain(workload, data)
    log(
        f"{workload.name}: plain Keras: "
        + (
            "ran"
            if plain["possible"]
            else f"{plain['error_type']}: {plain['error']}"
        )
    )
    modes = {name: MODE_CLASSES[name](workload, data) for name in MODES}
    for mode in modes.values():
        mode.build()
    warm_up = {name: measure(mode) for name, mode in modes.items()}
    difference = weight_difference(modes["staged"], modes["expert"])
    log(
        f"{workload.name}: weight check: max |staged - expert| over the "
        f"trunk's weights after the same {EPOCHS} epochs: {difference:.2e}"
    )
    records = {name: [] for name in modes}
    names = list(modes)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            records[name].append(measure(modes[name]))
        log(
            f"{workload.name}: round {round_index + 1}/{rounds}"
            + "".join(
                f"  {name} {records[name][-1]['seconds']:.3f}s"
                for name in names
            )
        )
    plan = modes["staged"].model.get_stage_plan()

    def paired(mode, key):
        return paired_ratio(
            [r[key] for r in records[mode]],
            [r[key] for r in records["expert"]],
        )

    return {
        "description": workload.description,
        "rows": rows,
        "batch_size": workload.batch_size,
        "epochs": EPOCHS,
        "steps_per_fit": records["staged"][0]["steps"],
        "plain": plain,
        "staged_plan": {
            "staged_layers": list(plan.staged_layers),
            "trunk_layers": list(plan.trunk_layers),
        },
        "weight_check": {
            "max_abs_difference": difference,
            "what": (
                f"max |staged - expert| over the trunk's trainable weights "
                f"after the untimed fit ({EPOCHS} epochs, no shuffle) from "
                "equal initial weights"
            ),
        },
        "modes": {
            name: {
                "seconds_median": statistics.median(
                    r["seconds"] for r in records[name]
                ),
                "steps_seconds_median": statistics.median(
                    r["steps_seconds"] for r in records[name]
                ),
                "warm_up": warm_up[name],
                "rounds": records[name],
            }
            for name in modes
        },
        "paired_ratios": {
            f"{mode}/expert": {
                "seconds": paired(mode, "seconds"),
                "steps_seconds": paired(mode, "steps_seconds"),
            }
            for mode in ("staged", "expert_again")
        },
    }


def run(rounds, quick, log=print, argv=None):
    """Runs every workload; returns the results as a dict."""
    backend = keras.backend.backend()
    started = time.perf_counter()
    before = environment.snapshot()
    rows = {
        name: workload.quick_rows if quick else workload.rows
        for name, workload in WORKLOADS.items()
    }
    results = {
        "schema_version": SCHEMA_VERSION,
        # For benchmarks.history: "workloads" alone means benchmarks.run.
        "family": f"{backend}_backend",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": argv,
        "config": {
            "workloads": list(WORKLOADS),
            "modes": list(MODES),
            "rounds": rounds,
            "quick": quick,
            "epochs": EPOCHS,
            "seed": SEED,
            "rows": rows,
        },
        "timed": TIMED,
        "environment": {
            **environment.describe(),
            "keras_backend": backend,
            **backend_versions(backend),
        },
        "workloads": {},
    }
    for name, workload in WORKLOADS.items():
        results["workloads"][name] = run_workload(
            workload, rows[name], rounds, log
        )
    results["load"] = environment.load_between(before, environment.snapshot())
    results["wall_seconds"] = time.perf_counter() - started
    return results


def backend_versions(backend):
    """The backend's version and devices (torch: its threads, and the
    OpenMP settings that change how they wait on a busy machine)."""
    if backend == "jax":
        import jax

        devices = [str(device) for device in jax.devices()]
        return {"jax": jax.__version__, "jax_devices": devices}
    import torch

    return {
        "torch": torch.__version__,
        "torch_cuda": torch.cuda.is_available(),
        "torch_threads": torch.get_num_threads(),
        **{k: v for k, v in os.environ.items() if k.startswith("OMP_")},
    }


def format_table(results):
    """The results as text: a row per workload, then its notes."""
    lines = [
        f"{'workload':9} {'rows':>6} {'batch':>5}"
        f" {'whole s: staged':>15} {'expert':>7} {'staged/expert':>13}"
        f" {'steps s: staged':>15} {'expert':>7} {'staged/expert':>13}"
        f" {'control':>7} {'max |dw|':>9}"
    ]
    notes = []
    for name, section in results["workloads"].items():
        modes = section["modes"]
        ratios = section["paired_ratios"]["staged/expert"]
        control = section["paired_ratios"]["expert_again/expert"]
        lines.append(
            f"{name:9} {section['rows']:6d} {section['batch_size']:5d}"
            f" {modes['staged']['seconds_median']:15.3f}"
            f" {modes['expert']['seconds_median']:7.3f}"
            f" {ratios['seconds']:13.3f}"
            f" {modes['staged']['steps_seconds_median']:15.3f}"
            f" {modes['expert']['steps_seconds_median']:7.3f}"
            f" {ratios['steps_seconds']:13.3f}"
            f" {control['seconds']:7.3f}"
            f" {section['weight_check']['max_abs_difference']:9.1e}"
        )
        plain = section["plain"]
        backend = results["environment"]["keras_backend"]
        notes += [
            f"{name}: {section['description']}",
            "  plain: "
            + (
                f"ran on {backend} (unexpected)"
                if plain["possible"]
                else f"impossible on {backend}: "
                f"{plain['error_type']}: {plain['error']}"
            ),
            "  staged layers: "
            + ", ".join(section["staged_plan"]["staged_layers"]),
        ]
    config = results["config"]
    return "\n".join(
        lines
        + [
            f"(whole fit(epochs={config['epochs']}) calls and their steps "
            f"alone, medians of {config['rounds']} rounds; staged/expert "
            "paired; control: expert_again/expert, paired, whole calls; "
            "max |dw|: the weight check)"
        ]
        + notes
    )


def parse_args(argv=None):
    """Parses the command line (see `--help`)."""
    parser = argparse.ArgumentParser(
        prog="KERAS_BACKEND=jax|torch python -m benchmarks.jax_backend",
        description=(
            "Time whole fit calls (set-up included) and their steps alone on "
            "Keras's JAX or torch backend: keras_stage's SmartStage against "
            "the hand "
            "split (preprocessing in tf.data, a numeric trunk), interleaved, "
            "with paired ratios; and record why plain Keras cannot fit."
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
        "--quick",
        action="store_true",
        help=(
            "tiny sizes ("
            + ", ".join(
                f"{w.name}: {w.quick_rows} rows" for w in WORKLOADS.values()
            )
            + f") and {QUICK_ROUNDS} round: a smoke run, not a measurement"
        ),
    )
    parser.add_argument(
        "--out",
        help="results file (default: benchmarks/results/"
        "<backend>_backend.json)",
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    backend = keras.backend.backend()
    if backend not in BACKENDS:
        parser.error(
            f"Keras runs on the {backend!r} backend: run with KERAS_BACKEND="
            "jax (in .venv-jax: make venv-jax) or torch (make venv-torch)"
        )
    if args.out is None:
        args.out = os.path.join(RESULTS, f"{backend}_backend.json")
    return args


def main(argv=None):
    """Runs the workloads, prints the table, writes the JSON; returns 0."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = run(
        args.rounds,
        args.quick,
        log=lambda line: print(line, flush=True),
        argv=[f"benchmarks.{keras.backend.backend()}_backend", *argv],
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print()
    print(format_table(results))
    print(f"\nWrote {args.out} ({results['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
