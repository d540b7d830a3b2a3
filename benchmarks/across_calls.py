"""Calls on one dataset object, or on a new one each: a kept stage's cost.

`python -m benchmarks.across_calls [--models tabular,criteo] [--calls N]
[--method evaluate|predict|fit] [--new-datasets] [--name NAME]` calls
`evaluate` (or `predict`, or `fit(epochs=1)` on the shuffled training
data) N times on the same `tf.data.Dataset` object (a notebook's
evaluate, a validation set passed to every fit, a repeated predict), or
with `--new-datasets` on a new dataset object of the same data each call
(a loop that builds its dataset per call: from the second call on, the
stage reads a fed source, see `data/epochs.py`: `FedSource`),
with the model's `StagedInput(adaptive=False)`, so that every call is
staged (not decided away by `decision/calls.py`), beside a plain model in
the same process, alternating. It measures what a staged call costs once
its stage is kept: since the iterator runs on across calls (see
`keras_stage/models/iterators/kept_iterators.py`), a call
after the second makes no iterator of the staged computation. Medians
leave the first two calls of each mode out (the stage's build and the
call that builds it again over its repeating source). Results:
`benchmarks/results/across_calls/<name>.json`, keyed by model (by
`<model>-predict` for predict).
"""

import argparse
import json
import pathlib
import statistics
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "across_calls"
# Calls left out of the medians: the first staged call builds the stage;
# the second reads on from it.
WARM_UP = 2


def run(model_name, calls, log=print, method="evaluate", new_datasets=False):
    """`{"plain": [s...], "staged": [s...], "summary": {...}}` of `method`
    ("evaluate", "predict" or "fit"), on a new dataset each call if
    `new_datasets`."""
    import tensorflow as tf

    import keras_stage
    from benchmarks import regimes

    spec = regimes.MODELS[model_name]
    part = "train" if method == "fit" else "eval"
    data = regimes.make_data(spec, regimes.Sizes(), {part})
    modes = [
        regimes.MODE_CLASSES[name](spec, data, "dataset")
        for name in ("plain", "staged")
    ]
    for mode in modes:
        mode.build()
    for layer in modes[1].model.layers:
        if isinstance(layer, keras_stage.layers.StagedInput):
            # Every call staged: the cost measured is the stage's.
            layer.adaptive = False
    clock = regimes.StepClock()
    tf.random.set_seed(None)
    training = method == "fit"
    kwargs = {"epochs": 1} if training else {}
    feeds = {mode.name: mode.feed(part, training) for mode in modes}
    seconds = {mode.name: [] for mode in modes}
    for _ in range(calls):
        for mode in modes:
            if new_datasets:
                # Built outside the timed call, as `feeds` are.
                feeds[mode.name] = mode.feed(part, training)
            started = time.perf_counter()
            mode.call(method, clock, feeds[mode.name], **kwargs)
            seconds[mode.name].append(time.perf_counter() - started)
    summary = call_summary(seconds)
    where = "a new dataset each" if new_datasets else "one dataset"
    log(
        f"{model_name}: {method} x{calls} on {where}, every call staged: "
        f"plain {summary['plain_ms']:.1f} ms, staged "
        f"{summary['staged_ms']:.1f} ms a call; paired staged/plain "
        f"{summary['paired_staged/plain']:.3f}"
    )
    return {**seconds, "summary": summary}


def call_summary(seconds, reference="plain", other="staged", warm_up=WARM_UP):
    """Medians (ms) of two modes' calls after `warm_up`, and their paired
    ratio: `{"<reference>_ms", "<other>_ms", "paired_<other>/<reference>"}`.

    `seconds`: `{mode: [s of each call]}`, the modes alternating call by
    call.
    """
    warm = {name: values[warm_up:] for name, values in seconds.items()}
    paired = [o / r for r, o in zip(warm[reference], warm[other], strict=True)]
    return {
        f"{reference}_ms": 1000 * statistics.median(warm[reference]),
        f"{other}_ms": 1000 * statistics.median(warm[other]),
        f"paired_{other}/{reference}": statistics.median(paired),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tabular,criteo")
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument(
        "--method", choices=("evaluate", "predict", "fit"), default="evaluate"
    )
    parser.add_argument(
        "--new-datasets",
        action="store_true",
        help="a new dataset object of the same data each call",
    )
    parser.add_argument("--name", default="latest")
    args = parser.parse_args(argv)
    if args.calls <= WARM_UP:
        parser.error(f"--calls must be over {WARM_UP}: got {args.calls}")
    suffix = "" if args.method == "evaluate" else f"-{args.method}"
    if args.new_datasets:
        suffix += "-new-datasets"
    results = {
        name + suffix: run(
            name,
            args.calls,
            method=args.method,
            new_datasets=args.new_datasets,
        )
        for name in args.models.split(",")
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"Wrote {path}")


if __name__ == "__main__":
    main()
