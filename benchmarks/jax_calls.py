"""Repeated calls on one dataset object, on Keras's JAX backend.

`KERAS_BACKEND=jax python -m benchmarks.jax_calls [--calls N]
[--batches B] [--methods fit,evaluate,predict] [--name NAME]` (in the
`.venv-jax` environment) calls each method N times on the same
`tf.data.Dataset` object of B batches (a user's loop of
`fit(epochs=1)`, a notebook's repeated `evaluate` or `predict`), for the
two workloads of `benchmarks.jax_backend`, in its two modes side by side in
one process, alternating call by call:

- `staged`: keras_stage's three lines, fed a dataset of the raw columns
  (`Dataset.from_tensor_slices((x, y)).batch(B)`), built once;
- `expert`: the hand split (`jax_backend.ExpertMode`), fed its
  `map(preprocess).prefetch(AUTOTUNE)` dataset, built once too (as a user
  passing the same dataset object would).

Plain Keras cannot run these models on JAX (string inputs), so the hand
split is the reference. One measurement is a whole call
(`time.perf_counter`). Medians leave the first two calls of each mode out
(tracing and jit compilation; the stage's build); the paired ratio is the
median over the calls of staged/expert within a call. Results:
`benchmarks/results/jax_calls/<name>.json`.
"""

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import jax_backend  # noqa: E402
from benchmarks.across_calls import call_summary  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "jax_calls"
METHODS = ("fit", "evaluate", "predict")
# Calls left out of the medians: the traces and jit compilations, the
# stage's build and the call that reads on from it first.
WARM_UP = 2


def _call(model, method, dataset):
    if method == "fit":
        # shuffle=False: Keras would warn that a dataset ignores it.
        model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    else:
        getattr(model, method)(dataset, verbose=0)


def run(workload_name, method, calls, batches, log=print):
    """`{"staged": [s...], "expert": [s...], "summary": {...}}`."""
    workload = jax_backend.WORKLOADS[workload_name]
    data = workload.make_data(batches * workload.batch_size, jax_backend.SEED)
    staged = jax_backend.StagedMode(workload, data)
    expert = jax_backend.ExpertMode(workload, data)
    staged.build()
    expert.build()
    feeds = {
        "staged": (
            staged.model,
            tf.data.Dataset.from_tensor_slices(data).batch(workload.batch_size),
        ),
        "expert": (expert.model, expert.dataset()),
    }
    seconds = {name: [] for name in feeds}
    for _ in range(calls):
        for name, (model, dataset) in feeds.items():
            started = time.perf_counter()
            _call(model, method, dataset)
            seconds[name].append(time.perf_counter() - started)
    summary = call_summary(seconds, reference="expert")
    log(
        f"{workload_name}: {method} x{calls} on one dataset of {batches} "
        f"batches: staged {summary['staged_ms']:.1f} ms, expert "
        f"{summary['expert_ms']:.1f} ms a call; paired staged/expert "
        f"{summary['paired_staged/expert']:.3f}"
    )
    return {**seconds, "summary": summary}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="KERAS_BACKEND=jax python -m benchmarks.jax_calls",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--workloads", default="tabular,criteo")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--calls", type=int, default=14)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--name", default="latest")
    args = parser.parse_args(argv)
    if args.calls <= WARM_UP:
        parser.error(f"--calls must be over {WARM_UP}: got {args.calls}")
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown --methods {unknown}: choose from {METHODS}")
    if keras.backend.backend() != "jax":
        parser.error(
            f"Keras runs on the {keras.backend.backend()!r} backend: run "
            "with KERAS_BACKEND=jax (in .venv-jax: make venv-jax)"
        )
    results = {
        f"{name}-{method}": run(name, method, args.calls, args.batches)
        for name in args.workloads.split(",")
        for method in methods
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"Wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
