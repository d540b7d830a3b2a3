"""The stage's figures under op determinism against those of its clock.

`python -m benchmarks.determinism_verdict [--rounds N] [--name NAME]` fits
the same staged models with and without op determinism
(`tf.config.experimental.enable_op_determinism()`, which cannot be turned
off: each fit runs in a fresh process) and compares what
`PrefetchCallback` reports. Without determinism the stage times itself in
the graph (a clock in its pipeline and in the step); under it those
figures are read from tf.data's own model of the stage's iterator
(`keras_stage/data/pipeline_model.py`). Workloads:

- `slow_source`: the pipeline before the stage sleeps 20 ms a batch, the
  step is a Dense layer: input-bound.
- `slow_step`: the step sleeps 20 ms a batch (a `tf.py_function` in the
  trunk), the source is in memory: compute-bound.
- `criteo`: the criteo-like model of `benchmarks.regimes` (TSV parsing and
  hashing staged by SmartStage), 60 batches of 128 lines.

Each fit runs 3 epochs with `StagedInput(adaptive=False)` (every epoch
staged); the figures are the last epoch's, medians over the rounds.
Results: `benchmarks/results/determinism_verdict/<name>.json`.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

RESULTS = (
    pathlib.Path(__file__).resolve().parent / "results" / "determinism_verdict"
)
WORKLOADS = ("slow_source", "slow_step", "criteo")
SLEEP_SECONDS = 0.02
BATCHES = 40
EPOCHS = 3
# The verdict's figures compared, as `PrefetchCallback.verdict` names them.
FIGURES = (
    "wait_ratio",
    "buffer_fill",
    "prepare_seconds_per_batch",
    "train_seconds_per_batch",
    "delivery_seconds_per_batch",
)


def _sleepy(x):
    import time

    import tensorflow as tf

    def sleep(value):
        time.sleep(SLEEP_SECONDS)
        return value

    return tf.ensure_shape(tf.py_function(sleep, [x], x.dtype), x.shape)


def _small_model(slow_step):
    import keras

    import keras_stage

    class SlowStep(keras.layers.Layer):
        def call(self, x):
            return _sleepy(x)

    inputs = keras.Input(shape=(8,))
    x = keras_stage.layers.StagedInput(adaptive=False, num_threads=2)(inputs)
    if slow_step:
        x = SlowStep()(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _fit(workload):
    """One staged fit of `workload` in this process: the last verdict."""
    import numpy as np
    import tensorflow as tf

    import keras_stage

    callback = keras_stage.callbacks.PrefetchCallback()
    if workload == "criteo":
        from benchmarks import regimes

        spec = regimes.MODELS["criteo"]
        data = regimes.make_data(spec, regimes.Sizes(), {"long"})
        mode = regimes.MODE_CLASSES["staged"](spec, data, "dataset")
        mode.staged_input = lambda: keras_stage.layers.StagedInput(
            adaptive=False
        )
        mode.build()
        dataset = mode.raw_dataset("long", training=True)
        model = mode.model
    else:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(BATCHES * 4, 8)).astype("float32")
        y = rng.normal(size=(BATCHES * 4, 1)).astype("float32")
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
        if workload == "slow_source":
            dataset = dataset.map(lambda a, b: (_sleepy(a), b))
        model = _small_model(slow_step=workload == "slow_step")
    model.fit(
        dataset, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[callback]
    )
    verdict = callback.verdict
    return {
        "input_bound": verdict["input_bound"],
        **{name: verdict[name] for name in FIGURES},
    }


def _child(workload, determinism):
    import tensorflow as tf

    if determinism:
        tf.config.experimental.enable_op_determinism()
    print("RESULT " + json.dumps(_fit(workload)))


def _run_child(workload, determinism):
    command = [
        sys.executable,
        "-m",
        "benchmarks.determinism_verdict",
        "--child",
        workload,
    ] + (["--determinism"] if determinism else [])
    done = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=600
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"no result from {command}:\n{done.stderr[-2000:]}")


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cell(value, name):
    if value is None:
        return "-"
    if name.endswith("per_batch"):
        return f"{1000 * value:.2f} ms"
    return f"{value:.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--name", default="latest")
    parser.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--determinism", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.determinism)
        return
    results = {}
    for workload in args.workloads.split(","):
        runs = {"clock": [], "determinism": []}
        for _ in range(args.rounds):
            for key in runs:
                runs[key].append(_run_child(workload, key == "determinism"))
        results[workload] = runs
        print(f"{workload} (last epoch of {EPOCHS}, medians of {args.rounds})")
        for key, verdicts in runs.items():
            bound = [v["input_bound"] for v in verdicts]
            cells = [
                f"{name} {_cell(_median([v[name] for v in verdicts]), name)}"
                for name in FIGURES
            ]
            print(f"  {key:12} input_bound {bound}; " + ", ".join(cells))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"Wrote {path}")


if __name__ == "__main__":
    main()
