"""SmartStage on subclassed models: keras-rs's recommenders, warm fits.

Times whole `fit(epochs=3)` calls with validation of
`benchmarks.workloads.recommenders`' subclasses (their lookups in their
calls), each mode's model warmed by two untimed fits first, in one process,
the order of the modes rotated per round:

- "staged": the subclass on `keras_stage.Model`, `smart_stage=True`;
- "reference": on TensorFlow the same subclass on `keras.Model` (its
  lookups in the step); on JAX and torch, where Keras cannot take the
  strings, the hand split keras-rs's examples use (the lookups in
  `dataset.map(num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)`, the
  subclass on the ids);
- "reference_again": the reference once more, the control.

Ratios are the medians of the rounds' paired ratios to "reference".

Run: `python -m benchmarks.subclass_models [--rounds N] [--quick]`, with
KERAS_BACKEND set to the backend measured.
"""

import argparse
import json
import pathlib
import statistics
import time

import keras

import keras_stage
from benchmarks.paired import paired_ratio
from benchmarks.workloads import recommenders

MODES = ("staged", "reference", "reference_again")
RESULTS = pathlib.Path(__file__).parent / "results" / "subclass_models"
# Rows of each model's training data, batch size, and epochs per fit.
ROWS, BATCH, EPOCHS = 65536, 512, 3


class Mode:
    """One mode's model of `name`, fitted on its own dataset per call."""

    def __init__(self, name, mode, rows):
        self.name = name
        staged = mode == "staged"
        native = keras.backend.backend() == "tensorflow"
        hand = not staged and not native
        base = keras_stage.Model if staged else keras.Model
        self.model = recommenders.build(name, base, preprocessed=hand)
        self.preprocess = (
            recommenders.preprocessor(name).preprocess if hand else None
        )
        make = recommenders.MODELS[name][1]
        self.train = make(rows, seed=4)
        self.val = make(rows // 8, seed=1)

    def fit(self, epochs):
        """One whole `fit` call; returns its seconds."""
        data = recommenders.dataset(self.train, BATCH, 7, self.preprocess)
        val = recommenders.dataset(self.val, BATCH, None, self.preprocess)
        started = time.perf_counter()
        self.model.fit(
            data, epochs=epochs, validation_data=val, shuffle=False, verbose=0
        )
        return time.perf_counter() - started


def run_model(name, rounds, rows, log=print):
    """The rounds of `name`'s modes: `{mode: [seconds of each round]}`."""
    modes = {mode: Mode(name, mode, rows) for mode in MODES}
    for _ in range(2):  # warm-up: traces, the staging policy's first calls
        for mode in modes.values():
            mode.fit(EPOCHS)
    seconds = {mode: [] for mode in MODES}
    for k in range(rounds):
        order = MODES[k % len(MODES) :] + MODES[: k % len(MODES)]
        for mode in order:
            seconds[mode].append(modes[mode].fit(EPOCHS))
        log(
            f"{name} round {k + 1}/{rounds}: "
            + ", ".join(f"{m} {seconds[m][-1]:.3f}s" for m in MODES)
        )
    return seconds


def summarize(seconds):
    return {
        "median_seconds": {m: statistics.median(v) for m, v in seconds.items()},
        "staged/reference": paired_ratio(
            seconds["staged"], seconds["reference"]
        ),
        "reference_again/reference": paired_ratio(
            seconds["reference_again"], seconds["reference"]
        ),
        "seconds": seconds,
    }


def format_table(results):
    backend = results["backend"]
    reference = "plain subclass" if backend == "tensorflow" else "hand split"
    lines = [
        f"{'model':<16}{reference + ' s':>18}{'staged s':>10}"
        f"{'staged/ref':>12}{'control':>9}"
    ]
    for name, summary in results["models"].items():
        seconds = summary["median_seconds"]
        lines.append(
            f"{name:<16}{seconds['reference']:>18.3f}"
            f"{seconds['staged']:>10.3f}"
            f"{summary['staged/reference']:>12.2f}"
            f"{summary['reference_again/reference']:>9.2f}"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.subclass_models",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--models",
        default=",".join(recommenders.MODELS),
        help="comma-separated, from " + ",".join(recommenders.MODELS),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 rounds on 1/8 of the rows (a smoke run, not a measurement)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 2
    args.rows = ROWS // 8 if args.quick else ROWS
    args.models = args.models.split(",")
    unknown = set(args.models) - set(recommenders.MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    backend = keras.backend.backend()
    results = {
        "backend": backend,
        "rounds": args.rounds,
        "rows": args.rows,
        "models": {
            name: summarize(run_model(name, args.rounds, args.rows))
            for name in args.models
        },
    }
    print(format_table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{backend}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"Wrote {path}")
    return results


if __name__ == "__main__":
    main()
