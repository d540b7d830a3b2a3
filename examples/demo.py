"""The same Keras model trained with and without a keras_stage stage.

The workload is DeepRec's `tf.staged` example ported to Keras: batches of
text lines such as "user_123,item_45,0.7" are read from a slow "remote"
store (a `tf.py_function` that sleeps 15 ms per batch; sleeping releases the
GIL, like real IO), parsed with `tf.io.decode_csv` and hashed into ids with
`tf.strings.to_hash_bucket_fast`, then fed to an Embedding + Dense model.

Modes, timed over interleaved epochs after a warm-up epoch:

- plain: `keras.Model`, `dataset.map(parse_and_read)`, tf.data's automatic
  prefetch injection turned off, so reading and training alternate;
- tf.data defaults: the same, with tf.data's default options (TF injects a
  prefetch after the last synchronous map);
- StagedInput(8, 8) and StagedInput("auto"): `keras_stage.Model` with a
  `StagedInput` first and a `PrefetchCallback` in `fit`, fed the same
  dataset as plain;
- stage(fn=parse_and_read): the engine, `keras_stage.data.stage`, with the
  read and the parse as the staged computation, run on 8 threads at once;
- smart_stage: the read and the parse are layers of the model itself
  (`ReadAndParse`), fed raw text lines, and `compile(smart_stage=True)`
  moves them into the stage; the saved model keeps them.

Then it trains the `seed` and `criteo` workloads of `benchmarks/` plain and
staged (see `examples/workload_comparison.py`): what SmartStage staged, the
PrefetchCallback verdict and the two speeds side by side.

Run with `python -m examples.demo` (`make demo`); `--quick` for a short run,
`--tiny` for a smoke run (`make test`: the same steps on a few batches, and
the `seed` workload only).
"""

import argparse
import contextlib
import io
import os
import platform
import statistics
import textwrap
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402
from examples import workload_comparison  # noqa: E402

BATCH_SIZE = 256
NUM_USERS = 5000
NUM_ITEMS = 2000
HASH_BUCKETS = 10_000
EMBEDDING_DIM = 32
WIDTH = 256
READ_SECONDS = 0.015
SEED = 0


def make_lines(num_batches):
    """Deterministic "user_<id>,item_<id>,<score>" lines."""
    rng = np.random.default_rng(SEED)
    users = rng.integers(0, NUM_USERS, num_batches * BATCH_SIZE)
    items = rng.integers(0, NUM_ITEMS, num_batches * BATCH_SIZE)
    scores = ((users % 7) + (items % 5)) / 10.0
    return [
        f"user_{u},item_{i},{s:.1f}"
        for u, i, s in zip(users, items, scores, strict=True)
    ]


def remote_read(batch):
    # Stands for a read from a remote store. time.sleep releases the GIL,
    # as a socket or file read does, so other threads keep running.
    time.sleep(READ_SECONDS)
    return batch


def parse_and_read(batch):
    """Reads a batch of raw lines and parses it into model features."""
    batch = tf.py_function(remote_read, [batch], tf.string)
    batch.set_shape([None])
    user, item, score = tf.io.decode_csv(
        batch, record_defaults=[[""], [""], [0.0]]
    )
    features = {
        "user": tf.strings.to_hash_bucket_fast(user, HASH_BUCKETS),
        "item": tf.strings.to_hash_bucket_fast(item, HASH_BUCKETS),
    }
    return features, score[:, tf.newaxis]


@keras.saving.register_keras_serializable(package="keras_stage_demo")
class ReadAndParse(keras.layers.Layer):
    """`parse_and_read`'s features as a model layer: raw lines -> hashed ids.

    With `compile(smart_stage=True)` the planner finds that this layer
    touches no model state and runs it inside the stage.
    """

    def call(self, lines):
        features, _ = parse_and_read(lines)
        return features

    def compute_output_spec(self, lines):
        ids = keras.KerasTensor(lines.shape, "int64")
        return {"user": ids, "item": keras.KerasTensor(lines.shape, "int64")}


def scores(lines):
    return np.array([float(line.rsplit(",", 1)[1]) for line in lines])


def raw_batches(lines):
    return tf.data.Dataset.from_tensor_slices(lines).batch(BATCH_SIZE)


def source_dataset(lines, tf_data_defaults=False):
    """`raw_batches(lines).map(parse_and_read)`: no parallelism, no prefetch.

    With `tf_data_defaults=False`, tf.data's automatic prefetch injection
    is turned off, so nothing reads ahead unless a stage does.
    """
    dataset = raw_batches(lines).map(parse_and_read)
    if not tf_data_defaults:
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        dataset = dataset.with_options(options)
    return dataset


def labelled_lines(lines):
    """Batches of (raw line, score): the input of the smart_stage model."""
    return tf.data.Dataset.from_tensor_slices(
        (lines, scores(lines)[:, None].astype("float32"))
    ).batch(BATCH_SIZE)


def build_smart_model(staged_input, smart_stage=True):
    """The whole pipeline as one model: lines -> ReadAndParse -> trunk."""
    lines = keras.Input(shape=(), dtype="string", name="line")
    features = ReadAndParse(name="read_and_parse")(staged_input(lines))
    return build_model(features=features, inputs=lines, smart=smart_stage)


def build_model(staged_input=None, features=None, inputs=None, smart=None):
    """Embedding + Dense trunk; staged when `staged_input` is given."""
    if features is None:
        inputs = {
            "user": keras.Input(shape=(), dtype="int64", name="user"),
            "item": keras.Input(shape=(), dtype="int64", name="item"),
        }
        features = inputs if staged_input is None else staged_input(inputs)
    x = features
    user = keras.layers.Embedding(HASH_BUCKETS, EMBEDDING_DIM)(x["user"])
    item = keras.layers.Embedding(HASH_BUCKETS, EMBEDDING_DIM)(x["item"])
    h = keras.layers.Concatenate()([user, item])
    h = keras.layers.Dense(WIDTH, activation="relu")(h)
    h = keras.layers.Dense(WIDTH, activation="relu")(h)
    outputs = keras.layers.Dense(1)(h)
    if smart is None:
        model_class = keras.Model if staged_input is None else keras_stage.Model
        model = model_class(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    else:
        model = keras_stage.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="mse",
            smart_stage=smart,
        )
    return model


class EpochTimer(keras.callbacks.Callback):
    """Seconds per training step of each epoch (first-batch wait included)."""

    def __init__(self):
        super().__init__()
        self.step_seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        self.step_seconds.append(seconds / max(self._steps, 1))


class Mode:
    """One way of training: a model, its data, its callbacks."""

    def __init__(self, label, model, data, staged_input=None, staged=None):
        self.label = label
        self.model = model
        self.data = data
        self.staged_input = staged_input
        self.staged = staged
        self.timer = EpochTimer()
        self.prefetch = None
        if staged_input is not None:
            self.prefetch = keras_stage.callbacks.PrefetchCallback(verbose=1)
        self.verdict_line = None
        self.history = None

    def fit_epoch(self, timed):
        callbacks = [self.timer] if timed else []
        if self.prefetch is not None:
            callbacks.append(self.prefetch)
        printed = io.StringIO()
        # The PrefetchCallback prints its verdict each epoch; keep the last
        # one for the report instead of interleaving it with the timings.
        with contextlib.redirect_stdout(printed):
            history = self.model.fit(
                self.data,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        lines = printed.getvalue().strip().splitlines()
        if lines:
            self.verdict_line = lines[-1]
        self.history = history.history

    def milliseconds(self):
        ms = [s * 1e3 for s in self.timer.step_seconds]
        return statistics.median(ms), min(ms), max(ms)


def make_modes(lines):
    keras.utils.set_random_seed(SEED)
    plain = Mode("plain keras.Model", build_model(), source_dataset(lines))
    defaults = Mode(
        "keras.Model, tf.data defaults",
        build_model(),
        source_dataset(lines, tf_data_defaults=True),
    )
    fixed = keras_stage.layers.StagedInput(
        num_threads=8, capacity=8, name="staged_input_8x8"
    )
    staged = Mode(
        "StagedInput(8, 8)",
        build_model(fixed),
        source_dataset(lines),
        staged_input=fixed,
    )
    auto = keras_stage.layers.StagedInput(name="staged_input_auto")
    staged_auto = Mode(
        'StagedInput("auto")',
        build_model(auto),
        source_dataset(lines),
        staged_input=auto,
    )
    # The engine: the read and the parse are the staged computation, so
    # num_threads batches are read at once. The model's StagedInput marks
    # the boundary; the dataset arrives already staged.
    engine_data = keras_stage.data.stage(
        raw_batches(lines),
        parse_and_read,
        num_threads=8,
        capacity=8,
        name="parse_and_read",
    )
    boundary = keras_stage.layers.StagedInput(name="engine_input")
    engine = Mode(
        "stage(fn=parse_and_read, 8, 8)",
        build_model(boundary),
        engine_data,
        staged_input=boundary,
        staged=engine_data,
    )
    smart_input = keras_stage.layers.StagedInput(
        num_threads=8, capacity=8, name="smart_input"
    )
    smart = Mode(
        "smart_stage, StagedInput(8, 8)",
        build_smart_model(smart_input),
        labelled_lines(lines),
        staged_input=smart_input,
    )
    return [plain, defaults, staged, staged_auto, engine, smart]


def check_same_weights(lines, epochs):
    """Trains plain and staged from the same weights; compares the results."""
    keras.utils.set_random_seed(SEED)
    plain = build_model()
    staged = build_model(
        keras_stage.layers.StagedInput(
            num_threads=8, capacity=8, deterministic=True
        )
    )
    initial = plain.get_weights()
    staged.set_weights(initial)
    data = source_dataset(lines)
    plain.fit(data, epochs=epochs, shuffle=False, verbose=0)
    staged.fit(data, epochs=epochs, shuffle=False, verbose=0)
    after_plain, after_staged = plain.get_weights(), staged.get_weights()
    same = all(
        np.allclose(a, b)
        for a, b in zip(after_plain, after_staged, strict=True)
    )
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(after_plain, after_staged, strict=True)
    )
    moved = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(after_plain, initial, strict=True)
    )
    return same, diff, moved


def check_smart_same_weights(lines, epochs):
    """smart_stage=True vs False on the whole model, same initial weights."""
    keras.utils.set_random_seed(SEED)
    options = {"num_threads": 8, "capacity": 8}
    plain = build_smart_model(
        keras_stage.layers.StagedInput(**options), smart_stage=False
    )
    smart = build_smart_model(keras_stage.layers.StagedInput(**options))
    smart.set_weights(plain.get_weights())
    data = labelled_lines(lines)
    plain.fit(data, epochs=epochs, shuffle=False, verbose=0)
    smart.fit(data, epochs=epochs, shuffle=False, verbose=0)
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(plain.get_weights(), smart.get_weights(), strict=True)
    )
    return diff == 0.0, diff


def print_environment():
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    gpus = len(tf.config.list_physical_devices("GPU"))
    print(
        f"Python {platform.python_version()}, TensorFlow {tf.__version__}, "
        f"Keras {keras.__version__}, keras_stage {keras_stage.__version__}; "
        f"{os.cpu_count()} CPUs ({usable} usable), {gpus} GPUs"
    )


def wrapped(text, indent="    "):
    return textwrap.fill(
        text, width=79, initial_indent=indent, subsequent_indent=indent
    )


def describe_options(options):
    def names(types):
        return "(" + "".join(f"{t.__name__}," for t in types) + ")"

    return (
        f"capacity={options.capacity!r}, num_threads={options.num_threads!r}, "
        f"closed_exception_types={names(options.closed_exception_types)}, "
        f"ignored_exception_types={names(options.ignored_exception_types)}, "
        f"timeout={options.timeout}, deterministic={options.deterministic}, "
        f"thread_pool_size={options.thread_pool_size} (private pool: "
        f"{options.resolved_pool_size()} threads)"
    )


def print_staged(modes):
    print("\nWhat is staged:")
    for mode in modes:
        if mode.staged is not None:
            text = (
                f"{mode.label}: the read and the parse (parse_and_read) are "
                "the stage's computation, run on up to 8 batches at once."
            )
            options = mode.staged.stage_options
        elif (
            mode.model.smart_stage
            if hasattr(mode.model, "smart_stage")
            else False
        ):
            plan = mode.model.get_stage_plan()
            text = (
                f"{mode.label}: the model's layers "
                f"{', '.join(plan.staged_layers)} run in the stage (the "
                "read and the parse, up to 8 batches at once); "
                f"{', '.join(plan.trunk_layers)} run in the train step. "
                "The plan, from model.stage_summary():"
            )
            print(wrapped(text, indent="  "))
            mode.model.stage_summary(
                print_fn=lambda line: print("    " + line), line_length=75
            )
            options = mode.staged_input.stage_options
            print(wrapped(f"options: {describe_options(options)}"))
            continue
        elif mode.staged_input is not None:
            text = (
                f"{mode.label}: fit's dataset (batch -> map(parse_and_read)) "
                "runs ahead of the training step on the stage's private "
                "thread pool; its map is sequential, so batches are read one "
                "at a time, while the model trains."
            )
            options = mode.staged_input.stage_options
        else:
            continue
        print(wrapped(text, indent="  "))
        print(wrapped(f"options: {describe_options(options)}"))


def plural(count, noun):
    return f"{count} {noun}" + ("s" if count != 1 else "")


def print_timings(modes, reps, seconds, warmed=True):
    after = (
        "after one warm-up epoch each"
        if warmed
        else "no warm-up: the smoke run's steps include their tracing"
    )
    print(
        f"\nSpeed in ms per training step: median and range of "
        f"{plural(reps, 'timed epoch')} per mode\n  (interleaved, {after}; "
        f"{seconds:.0f} s in all):"
    )
    base = modes[0].milliseconds()[0]
    print(f"  {'mode':<32}{'median':>8}{'min-max':>15}{'vs plain':>10}")
    for mode in modes:
        median, low, high = mode.milliseconds()
        print(
            f"  {mode.label:<32}{median:>8.1f}"
            f"{f'{low:.1f}-{high:.1f}':>15}{base / median:>9.2f}x"
        )
    print(
        wrapped(
            "plain turns off tf.data's automatic prefetch injection, so "
            "reading and training alternate; with tf.data's defaults a "
            "prefetch is injected after the last synchronous map.",
            indent="  ",
        )
    )


def print_callback_report(modes):
    print("\nPrefetchCallback, last timed epoch:")
    for mode in modes:
        if mode.prefetch is None:
            continue
        if "stage_wait_ratio" not in mode.history:
            # Decided from measured costs (see docs/smart-stage.md, "Calls
            # that skip their stage"): the fit ran the whole model.
            print(f"  {mode.label}:")
            print(
                wrapped(
                    "its last timed fit ran unstaged, the whole model in "
                    "Keras's step (a call that times the whole model's "
                    "steps once, or one the stage cannot repay), so it has "
                    "no stage figures; StagedInput(adaptive=False) stages "
                    "every fit."
                )
            )
            continue
        ratio = mode.history["stage_wait_ratio"][-1]
        fill = mode.history["stage_buffer_fill"][-1]
        skipped = mode.history["stage_skipped"][-1]
        print(f"  {mode.label}:")
        print(
            f"    stage_wait_ratio={ratio:.2f} "
            f"stage_buffer_fill={fill:.2f} stage_skipped={skipped}"
        )
        print(wrapped(f"verdict: {mode.verdict_line}"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a smoke run: every step of the demo on a few batches",
    )
    args = parser.parse_args(argv)
    # (batches, timed epochs per mode, epochs and batches of the checks)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    num_batches, reps, check_epochs, check_batches = {
        "full": (60, 3, 2, 8),
        "quick": (12, 1, 1, 4),
        "tiny": (3, 1, 1, 2),
    }[size]

    print("keras_stage demo: one model, trained with and without a stage")
    print_environment()
    print(
        f"Workload: {num_batches} batches of {BATCH_SIZE} lines like "
        "'user_123,item_45,0.7'; each batch\n"
        f"  waits {READ_SECONDS * 1e3:.0f} ms in an emulated remote read, "
        "then decode_csv + to_hash_bucket_fast;\n"
        f"  model: 2 x Embedding({HASH_BUCKETS}, {EMBEDDING_DIM}) -> "
        f"Dense({WIDTH}) x 2 -> Dense(1), Adam, MSE."
    )
    lines = make_lines(num_batches)
    modes = make_modes(lines)
    print_staged(modes)

    start = time.perf_counter()
    # A smoke run (--tiny) times nothing worth a warm-up epoch.
    warm = size != "tiny"
    if warm:
        for mode in modes:
            mode.fit_epoch(timed=False)  # traces the train step
    for _ in range(reps):
        for mode in modes:
            mode.fit_epoch(timed=True)
    print_timings(modes, reps, time.perf_counter() - start, warmed=warm)
    print_callback_report(modes)

    same, diff, moved = check_same_weights(
        lines[: check_batches * BATCH_SIZE], check_epochs
    )
    print("\nSame weights (deterministic=True):")
    print(
        wrapped(
            "a plain and a StagedInput(8, 8) model, same initial weights, "
            f"{plural(check_epochs, 'epoch')} of the same "
            f"{check_batches} batches: np.allclose = {same} (max "
            f"|difference| {diff:.2g}; the weights moved up to {moved:.2g})",
            indent="  ",
        )
    )
    smart_same, smart_diff = check_smart_same_weights(
        lines[: check_batches * BATCH_SIZE], check_epochs
    )
    print(
        wrapped(
            "the ReadAndParse model compiled with smart_stage=True and with "
            "smart_stage=False, same initial weights and batches: identical "
            f"= {smart_same} (max |difference| {smart_diff:.2g})",
            indent="  ",
        )
    )
    workloads = workload_comparison.names(size)
    what = (
        f"workloads {' and '.join(workloads)}"
        if len(workloads) > 1
        else f"workload {workloads[0]}"
    )
    print(
        f"\nThe benchmark {what} (benchmarks/), each "
        "model as a plain\nkeras.Model and with keras_stage's three lines, "
        "defaults only:"
    )
    workload_comparison.main([] if size == "full" else [f"--{size}"])
    return 0 if same and smart_same else 1


if __name__ == "__main__":
    raise SystemExit(main())
