"""Repeated calls on one dataset object under a strategy of two replicas.

`python -m benchmarks.strategy_calls [--method evaluate|fit] [--calls N]
[--name NAME]` splits the CPU into two logical devices, and under
`MirroredStrategy` over them calls `evaluate` (or `fit(epochs=1)`, or
with `--method fit-validation` `fit(epochs=3)` with 5 batches of validation
data every epoch) N times on the same `tf.data.Dataset` object of 20
batches, for a plain
`keras.Model` and a `keras_stage.Model` with `StagedInput(adaptive=False)`
(every call staged) and `smart_stage=True`, and a second plain model (the
control, `plain_again`), alternating call by call. The
model: 26 integer columns hashed (`Hashing(64)`), embedded and flattened,
13 numeric columns, two `Dense` layers (the one of
tests/models/device_test.py: plain Keras cannot run a string-input model
under `MirroredStrategy` here). Whole calls (`time.perf_counter`); medians
leave the first two calls of each mode out; the paired ratio is the median
of staged/plain within a call. Results:
`benchmarks/results/strategy_calls/<name>.json`.
"""

import argparse
import json
import os
import pathlib
import sys
import time

from benchmarks.across_calls import call_summary

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "strategy_calls"
WARM_UP = 2
BATCH, BATCHES = 16, 20


def _data(count):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=(count, 26)).astype("int64")
    dense = rng.normal(size=(count, 13)).astype("float32")
    y = dense[:, :1] + (ids[:, :1] % 7).astype("float32")
    x = {f"c{i}": ids[:, i] for i in range(26)}
    x.update({f"d{i}": dense[:, i] for i in range(13)})
    return x, y


def _build(staged, service=None):
    import keras

    import keras_stage

    keras.utils.set_random_seed(1)
    inputs = {
        f"c{i}": keras.Input((), dtype="int64", name=f"c{i}") for i in range(26)
    }
    inputs.update({f"d{i}": keras.Input((), name=f"d{i}") for i in range(13)})
    x = inputs
    if staged:
        x = keras_stage.layers.StagedInput(adaptive=False, service=service)(
            inputs
        )
    cats = keras.ops.stack([x[f"c{i}"] for i in range(26)], axis=1)
    dense = keras.ops.stack([x[f"d{i}"] for i in range(13)], axis=1)
    hashed = keras.layers.Hashing(64)(cats)
    emb = keras.layers.Flatten()(keras.layers.Embedding(64, 4)(hashed))
    h = keras.layers.Concatenate()([emb, dense])
    out = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(h))
    if not staged:
        model = keras.Model(inputs, out)
        model.compile(optimizer="sgd", loss="mse")
        return model
    model = keras_stage.Model(inputs, out)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    return model


def run(method, calls, log=print):
    """`{"plain": [s...], "staged": [s...], "summary": {...}}`."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])
    with strategy.scope():
        models = {
            "plain": _build(False),
            "staged": _build(True),
            "plain_again": _build(False),
        }
    return time_calls(
        models, method, calls, "under MirroredStrategy (2 replicas)", log
    )


def time_calls(models, method, calls, where, log):
    """Times `method` `calls` times per model on one dataset, alternating.

    `models`: `{"plain": ..., "staged": ...}`, and a control
    `"plain_again"` if given; `where`: how the staged model runs, for the
    log line.
    """
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(_data(BATCH * BATCHES))
    dataset = dataset.batch(BATCH)
    validation = dataset.take(5)
    seconds = {name: [] for name in models}
    for _ in range(calls):
        for name, model in models.items():
            started = time.perf_counter()
            if method == "fit":
                model.fit(dataset, epochs=1, verbose=0)
            elif method == "fit-validation":
                model.fit(
                    dataset, epochs=3, validation_data=validation, verbose=0
                )
            else:
                model.evaluate(dataset, verbose=0)
            seconds[name].append(time.perf_counter() - started)
    summary = call_summary(seconds)
    control = ""
    if "plain_again" in seconds:
        summary.update(call_summary(seconds, other="plain_again"))
        control = (
            f" (control plain_again/plain "
            f"{summary['paired_plain_again/plain']:.3f})"
        )
    log(
        f"{method} x{calls} on one dataset {where}: plain "
        f"{summary['plain_ms']:.1f} ms, staged {summary['staged_ms']:.1f} ms "
        f"a call; paired staged/plain {summary['paired_staged/plain']:.3f}"
        + control
    )
    return {**seconds, "summary": summary}


def main_of(doc, run_calls, results, argv=None):
    """The command line of a module whose `run_calls(method, calls)` times."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument(
        "--method",
        choices=("evaluate", "fit", "fit-validation"),
        default="evaluate",
    )
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--name", default="latest")
    args = parser.parse_args(argv)
    if args.calls <= WARM_UP:
        parser.error(f"--calls must be over {WARM_UP}: got {args.calls}")
    timed = {args.method: run_calls(args.method, args.calls)}
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{args.name}.json"
    path.write_text(json.dumps(timed, indent=2) + "\n")
    print(f"Wrote {path}")
    return 0


def main(argv=None):
    return main_of(__doc__, run, RESULTS, argv)


if __name__ == "__main__":
    sys.exit(main())
