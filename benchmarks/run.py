"""Command line of the benchmarks: `python -m benchmarks.run [options]`.

This module owns the command line only: it parses the options, runs
`benchmarks.harness.run_benchmark`, and writes
`<out>/<name>.json` and `<out>/<name>.png` and prints the table
(`benchmarks.report`). `make bench` runs it with no options, `make
bench-quick` with `--quick`.

Exit status: 0, or 1 when a mode failed (its error is in the JSON file).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results"
)


def parse_args(argv=None):
    """Parses the command line (see `--help`)."""
    # Imported here so that `--help` is quick and TensorFlow-free.
    from benchmarks.workloads.base import TRUNK_SCALES, trunk_scale
    from benchmarks.workloads.remote import READ_KINDS

    names = ("seed", "criteo", "remote", "images", "none")
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=(
            "Train each workload in every mode (plain, expert, staged, "
            "staged-tuned, compute-bound, input-bound), interleaved, and "
            "report each mode's time as ratios to plain, to expert and to "
            "the limit: of whole fit calls (set-up included), and of the "
            "steps alone beside them."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced sizes (fewer steps, 3 reps): `make bench-quick`",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(names),
        help=f"comma-separated, from {','.join(names)} (default: all)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions per mode (default 7, 3 with --quick; "
        "three times that for none)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="batches per repetition for every workload (default: each "
        "workload's own, smaller with --quick)",
    )
    parser.add_argument(
        "--trunk",
        default="light",
        help=f"trunk width: {' or '.join(TRUNK_SCALES)} "
        f"({', '.join(f'{k}={v:g}x' for k, v in TRUNK_SCALES.items())}) or "
        "a multiplier such as 2.5 (default: light)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="batch size for every workload (default: each workload's own)",
    )
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument(
        "--staged-options",
        default=None,
        help="StagedInput options of the staged modes as JSON, e.g. "
        '\'{"device": "cpu"}\' (default: none, the defaults)',
    )
    parser.add_argument(
        "--remote-read",
        choices=READ_KINDS,
        default="tf",
        help="how the remote workload emulates its read: tf, a sleep "
        "in TensorFlow's C++ runtime (no GIL, as TensorFlow's file systems), "
        "or python, tf.py_function + time.sleep (default: tf)",
    )
    parser.add_argument(
        "--remote-latency-ms",
        type=float,
        default=None,
        help="milliseconds the remote workload's read of one batch takes "
        "(default: 20)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="results file name (default: bench, or bench-quick with --quick)",
    )
    parser.add_argument(
        "--out",
        default=RESULTS_DIR,
        help="output folder (default: benchmarks/results)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="where the images workload writes its JPEGs (default: a "
        "temporary folder, removed afterwards)",
    )
    args = parser.parse_args(argv)
    if args.staged_options is not None:
        try:
            args.staged_options = json.loads(args.staged_options)
        except json.JSONDecodeError as e:
            parser.error(f"--staged-options: not JSON ({e})")
        if not isinstance(args.staged_options, dict):
            parser.error("--staged-options: expected a JSON object")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in names]
    if unknown or not args.workloads:
        parser.error(f"--workloads: unknown {unknown}; choose from {names}")
    try:
        trunk_scale(args.trunk)
    except ValueError as e:
        parser.error(f"--trunk: {e}")
    for option in ("reps", "steps", "batch_size"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if args.remote_latency_ms is not None and not args.remote_latency_ms > 0:
        parser.error("--remote-latency-ms must be a positive number")
    if args.name is None:
        args.name = "bench-quick" if args.quick else "bench"
    return args


def main(argv=None):
    """Runs the benchmarks; returns the exit status."""
    args = parse_args(argv)
    from benchmarks import report
    from benchmarks.harness import run_benchmark

    results = run_benchmark(
        args.workloads,
        reps=args.reps,
        steps=args.steps,
        quick=args.quick,
        trunk=args.trunk,
        batch_size=args.batch_size,
        seed=args.seed,
        data_dir=args.data_dir,
        name=args.name,
        argv=sys.argv if argv is None else ["benchmarks.run", *argv],
        staged_options=args.staged_options,
        remote_read=args.remote_read,
        remote_latency=(
            None
            if args.remote_latency_ms is None
            else args.remote_latency_ms / 1e3
        ),
        log=lambda line: print(line, flush=True),
    )
    json_path = report.write_json(
        results, os.path.join(args.out, f"{args.name}.json")
    )
    png_path = report.plot_chart(
        results, os.path.join(args.out, f"{args.name}.png")
    )
    print()
    print(report.format_table(results))
    print(f"\nWrote {json_path}\n  and {png_path}")
    failed = [
        f"{workload}/{mode}"
        for workload, section in results["workloads"].items()
        for mode, result in section["modes"].items()
        if "error" in result
    ]
    if failed:
        print(f"Failed modes (see the JSON file): {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
