"""A script's first calls: each mode in a fresh process, nothing warm.

`python -m benchmarks.first_calls [--processes N] [--model criteo]
[--name NAME]` runs, in a new Python process per mode and repetition (plain,
staged, plain_again, in turn), what a user's script does first: build the
model, `fit` 3 epochs with validation every epoch, `evaluate` three times,
then `fit` one more epoch, all from `tf.data.Dataset`s
(`benchmarks.regimes`' models and data). `benchmarks.regimes` times calls
after an untimed one per mode; here every call is timed from a cold
process, so a staged model's one-time costs (planning SmartStage, building
its stages, tracing its prefix, the call that times the whole model's
steps once) are in the figures. Paired ratios pair the processes of one
repetition; `plain_again` is the control. Results:
`benchmarks/results/first_calls/<name>.json`.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

CALLS = ("fit", "evaluate_1", "evaluate_2", "evaluate_3", "fit_again")
MODES = ("plain", "staged", "plain_again")
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "first_calls"


def one_process(mode_name, model_name):
    """The calls' seconds in this process (run as `--child`)."""
    from benchmarks import regimes

    spec = regimes.MODELS[model_name]
    sizes = regimes.Sizes(val_train_batches=40, val_epochs=3)
    data = regimes.make_data(spec, sizes, {"val_train", "val", "eval"})
    mode = regimes.MODE_CLASSES[mode_name](spec, data, "dataset")
    mode.build()
    clock = regimes.StepClock()
    train = mode.feed("val_train", True)
    val, test = mode.feed("val"), mode.feed("eval")
    seconds = {}

    def timed(name, method, feed, **kwargs):
        started = time.perf_counter()
        mode.call(method, clock, feed, **kwargs)
        seconds[name] = time.perf_counter() - started

    timed("fit", "fit", train, validation=val, epochs=3)
    for index in range(1, 4):
        timed(f"evaluate_{index}", "evaluate", test)
    timed("fit_again", "fit", train, validation=val, epochs=1)
    return seconds


def run(processes, model_name, log=print):
    runs = {mode: [] for mode in MODES}
    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), TF_CPP_MIN_LOG_LEVEL="2")
    for repetition in range(processes):
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.first_calls", "--child"]
                + [mode, "--model", model_name],
                check=True,
                capture_output=True,
                text=True,
                cwd=root,
                env=env,
            ).stdout
            seconds = json.loads(out.strip().splitlines()[-1])
            seconds["total"] = sum(seconds[name] for name in CALLS)
            runs[mode].append(seconds)
            log(
                f"{repetition + 1}/{processes} {mode}: "
                + " ".join(f"{k} {v:.3f}s" for k, v in seconds.items())
            )
    summary = {}
    for name in (*CALLS, "total"):
        summary[name] = {
            "median_seconds": {
                mode: statistics.median(r[name] for r in runs[mode])
                for mode in MODES
            },
            "paired": {
                f"{mode}/plain": statistics.median(
                    r[name] / p[name]
                    for r, p in zip(runs[mode], runs["plain"], strict=True)
                )
                for mode in MODES[1:]
            },
        }
    return {"model": model_name, "runs": runs, "summary": summary}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--model", default="criteo")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--name", default="first_calls")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.child, args.model)))
        return 0
    results = run(args.processes, args.model)
    print("call          plain  staged  staged/plain  plain_again/plain")
    for name, figures in results["summary"].items():
        medians, paired = figures["median_seconds"], figures["paired"]
        print(
            f"{name:11} {medians['plain']:7.3f} {medians['staged']:7.3f}"
            f" {paired['staged/plain']:13.2f}"
            f" {paired['plain_again/plain']:18.2f}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"Wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
