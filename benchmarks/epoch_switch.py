"""Multi-epoch fits on a dataset, whole calls, staged against plain.

`python -m benchmarks.epoch_switch [--rounds N] [--epochs E] [--steps S]
[--workload criteo]` times whole `fit(dataset, epochs=E)` calls (set-up
included) of one workload in four modes, side by side in one process:

- `plain`: the whole model as a `keras.Model`, raw batches;
- `staged`: keras_stage's three lines with `StagedInput()` defaults (the
  policy decides each call, `keras_stage.models.decision.calls`);
- `staged_always`: the same with `StagedInput(adaptive=False)`: every
  call staged;
- `expert`: the preprocessing in `dataset.map(num_parallel_calls=
  AUTOTUNE).prefetch(AUTOTUNE)` and a `keras.Model` of the trunk.

Each mode keeps its model across rounds (as a user's loop of fits does);
one untimed `fit(epochs=1)` per mode first (tracing). The rounds run the
modes in a rotating order, with an untimed `gc.collect()` after each
measurement; a paired ratio is the median over rounds of the ratio to
plain within the round. Also printed: which epochs of the `staged` fits ran
without the stage (`stage_unstaged`: a fit run unstaged). Results:
`benchmarks/results/epoch_switch/<name>.json`.
"""

import argparse
import gc
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402
from benchmarks import environment  # noqa: E402
from benchmarks.paired import paired_ratio  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402

RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "epoch_switch"
)
MODES = ("plain", "staged", "staged_always", "expert")


def _model_and_data(workload, mode):
    """`(compiled model, dataset, callbacks)` of `mode`."""
    dataset = workload.raw_dataset()
    if mode == "plain":
        model = workload.whole_model(keras.Model)
        model.compile(**workload.compile_kwargs())
        return model, dataset, []
    if mode == "expert":
        preprocess = workload.preprocess_fn()
        if preprocess is not None:

            def mapped(x, y):
                return preprocess(x), y

            dataset = dataset.map(mapped, num_parallel_calls=tf.data.AUTOTUNE)
        model = workload.trunk_model()
        model.compile(**workload.compile_kwargs())
        return model, dataset.prefetch(tf.data.AUTOTUNE), []
    options = {} if mode == "staged" else {"adaptive": False}
    model = workload.whole_model(
        keras_stage.Model,
        staged_input=keras_stage.layers.StagedInput(**options),
    )
    model.compile(**workload.compile_kwargs(), smart_stage=True)
    return model, dataset, [keras_stage.callbacks.PrefetchCallback()]


def _fit(model, dataset, callbacks, epochs):
    started = time.perf_counter()
    history = model.fit(
        dataset,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=list(callbacks),
    )
    return time.perf_counter() - started, history.history


def run(workload_name, rounds, epochs, steps, log=print):
    workload = WORKLOADS[workload_name](steps=steps)
    built = {}
    for mode in MODES:
        built[mode] = _model_and_data(workload, mode)
        model, dataset, callbacks = built[mode]
        _fit(model, dataset, callbacks, 1)  # tracing
    seconds = {mode: [] for mode in MODES}
    unstaged = []
    for round_ in range(rounds):
        order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]
        for mode in order:
            model, dataset, callbacks = built[mode]
            taken, history = _fit(model, dataset, callbacks, epochs)
            seconds[mode].append(taken)
            if mode == "staged":
                unstaged.append(history.get("stage_unstaged"))
            gc.collect()
        log(
            f"round {round_ + 1}/{rounds}: "
            + ", ".join(f"{m} {seconds[m][-1]:.2f} s" for m in MODES)
        )
    workload.close()
    return {
        "workload": workload_name,
        "epochs": epochs,
        "steps_per_epoch": steps,
        "rounds": rounds,
        "median_seconds": {m: statistics.median(v) for m, v in seconds.items()},
        "seconds": seconds,
        "ratio_to_plain": {
            m: paired_ratio(seconds[m], seconds["plain"]) for m in MODES
        },
        "staged_unstaged_epochs": unstaged,
        "environment": environment.describe(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="criteo")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    result = run(args.workload, args.rounds, args.epochs, args.steps)
    print(
        f"\n{args.workload}: fit(dataset, epochs={args.epochs}), "
        f"{args.steps} batches an epoch, {args.rounds} rounds"
    )
    print(f"{'mode':<15}{'median s':>10}{'x plain':>10}")
    for mode in MODES:
        print(
            f"{mode:<15}{result['median_seconds'][mode]:>10.3f}"
            f"{result['ratio_to_plain'][mode]:>10.3f}"
        )
    print(
        "staged: epochs without the stage per round:",
        result["staged_unstaged_epochs"],
    )
    os.makedirs(RESULTS_DIR, exist_ok=True)
    name = args.name or time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
