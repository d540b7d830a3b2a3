"""The demo's second part: benchmark workloads, plain Keras vs keras_stage.

Trains the `seed` and `criteo` workloads of `benchmarks/` (small sizes) as a
plain `keras.Model` and with keras_stage's three lines (`StagedInput()`
first, `compile(smart_stage=True)`, a `PrefetchCallback`), interleaved, and
prints what SmartStage staged (`model.stage_summary()`), the callback's
verdict and the two speeds side by side. `make bench` measures the same
modes and four more, at full size, with many repetitions.

Example:

    python -m examples.workload_comparison --quick

`--tiny` is a smoke run of 2 batches of the `seed` workload (the demo's
`--tiny`).
"""

import argparse
import gc
import statistics
import textwrap
import time

from benchmarks.modes import MODES, TEARDOWN
from benchmarks.runner import decisions_logged
from benchmarks.workloads import workload

# The demo's workloads and their sizes: (batches per epoch, timed epochs,
# whether each mode first traces its step in an untimed epoch). A smoke run
# (tiny) times nothing: no warm-up, and no collection between the runs.
NAMES = ("seed", "criteo")
SIZES = {"full": (None, 5, True), "quick": (6, 1, True), "tiny": (2, 1, False)}


def names(size):
    """The workloads a run of `size` compares.

    A smoke run compares `seed` only: its fits of 2 batches run unstaged
    (a first call too short to repay a stage), so a second workload would
    add its traces and no code the first did not run.
    """
    return NAMES[:1] if size == "tiny" else NAMES


def _wrapped(text, indent="    "):
    return textwrap.fill(
        text,
        width=79,
        initial_indent=indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
    )


def compare(name, quick=False, log=print, size=None):
    """Trains workload `name` plain and staged; returns the two modes' runs.

    Each mode traces its step in one untimed epoch (but in a "tiny" smoke
    run), then the timed epochs alternate between the modes so that drift
    hits both alike. `size` is a key of `SIZES` ("quick" with `quick`, else
    "full", by default).
    """
    steps, reps, warm = SIZES[size or ("quick" if quick else "full")]
    work = workload(name)
    steps = steps or work.quick_steps
    x, y = work.data(steps * work.batch_size)
    data = work.dataset(x, y)
    modes = {mode: MODES[mode].build(work, x) for mode in ("plain", "staged")}
    if warm:
        for built in modes.values():
            built.call("fit", data, epochs=1)  # warm-up: traces the step
    runs = {mode: [] for mode in modes}
    for _ in range(reps):
        for mode, built in modes.items():
            with decisions_logged() as decisions:
                started = time.perf_counter()
                built.call("fit", data, epochs=1)
                seconds = time.perf_counter() - started
            ran_staged = any(decision[1] for decision in decisions)
            # Timed to the fit's last callback, as `make bench` times
            # calls: after it, Keras's tear-down of a plain fit's iterator
            # waits, in some calls, for tf.data's autotuning thread to
            # wake (up to ~0.6 s here), on plain and staged models alike.
            runs[mode].append(
                {
                    "steps": steps,
                    "seconds": seconds - TEARDOWN[-1],
                    "teardown": TEARDOWN[-1],
                    "unstaged": bool(decisions) and not ran_staged,
                }
            )
            if warm:
                gc.collect()
    return {
        "workload": work,
        "steps": steps,
        "runs": runs,
        "summary": _summary(modes["staged"].model),
        "verdict": modes["staged"].prefetch.verdict,
    }


def _summary(model):
    lines = []
    model.stage_summary(
        print_fn=lambda line, **_: lines.append(line), line_length=75
    )
    return "\n".join(lines)


def report(result, log=print):
    """Prints one workload's plan, speeds and verdict."""
    workload = result["workload"]
    log(
        f"\n{workload.name}: {result['steps']} batches of {workload.batch_size}"
    )
    log(_wrapped(workload.description, indent="  "))
    log("  What smart_stage=True staged, from model.stage_summary():")
    log(textwrap.indent(result["summary"], "    "))
    speeds = {
        mode: [r["steps"] / r["seconds"] for r in reps]
        for mode, reps in result["runs"].items()
    }
    plain = statistics.median(speeds["plain"])
    log(
        "  Steps per second of fit(epochs=1) calls, each timed to its last "
        "callback\n  (median, min-max; the tear-down after it: its longest):"
    )
    log(
        f"    {'mode':8s} {'steps/s':>8s} {'min-max':>15s} {'vs plain':>9s}"
        f" {'tear-down':>10s}"
    )
    for mode, values in speeds.items():
        median = statistics.median(values)
        spread = f"{min(values):.1f}-{max(values):.1f}"
        teardown = max(r["teardown"] for r in result["runs"][mode])
        log(
            f"    {mode:8s} {median:8.1f} {spread:>15s} {median / plain:8.2f}x"
            f" {teardown:8.2f} s"
        )
    verdict = result["verdict"] or {}
    log("  PrefetchCallback verdict of the last staged epoch:")
    unstaged = sum(
        1 for r in result["runs"].get("staged", []) if r.get("unstaged")
    )
    none = "(none)"
    if unstaged:
        # Decided from measured costs (models/decision/calls.py): a fit
        # that times the whole model's steps once, or one whose stage
        # cannot repay its set-up, runs at plain's cost.
        none = (
            f"(none: {unstaged} of the staged model's timed fits ran "
            "unstaged, the whole model in Keras's step, as decided from "
            "measured costs)"
        )
    log(_wrapped(verdict.get("message", none), indent="    "))


def main(argv=None, log=print):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument(
        "--tiny", action="store_true", help="a smoke run (2 batches)"
    )
    args = parser.parse_args(argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    started = time.perf_counter()
    for name in names(size):
        report(compare(name, size=size), log=log)
    log(f"\n({time.perf_counter() - started:.0f} s; full figures: make bench)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
