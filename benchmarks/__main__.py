"""`python -m benchmarks SCENARIO [options]`: run one benchmark family.

Prints the run's table and writes `benchmarks/results/SCENARIO[-NAME].json`
(the summary) and the raw rows under `benchmarks/results/raw/`.
`python -m benchmarks --list` names the scenarios.
"""

import argparse
import sys

from benchmarks import records, runner
from benchmarks.scenarios import SCENARIOS, scenario


def parse(argv):
    """`(scenario, args)` of a command line."""
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__)
        for name, (_, what) in SCENARIOS.items():
            print(f"  {name:14} {what}")
        sys.exit(0)
    chosen = scenario(argv[0])
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {chosen.name}",
        description=SCENARIOS[chosen.name][1],
    )
    parser.add_argument("--rounds", type=int, help="timed rounds per mode")
    parser.add_argument("--quick", action="store_true", help="reduced sizes")
    parser.add_argument(
        "--modes",
        default=",".join(chosen.modes),
        help="modes, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--name", default="", help="suffix of the result file")
    parser.add_argument(
        "--no-write", action="store_true", help="print only, write no file"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    chosen.arguments(parser)
    args = parser.parse_args(argv[1:])
    args.modes = args.modes.split(",")
    at = argv.index("--child") if args.child else len(argv)
    args.argv = [*argv[:at], *argv[at + 3 :]]  # a child's: without --child
    return chosen, args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    chosen, args = parse(argv)
    if args.child:
        runner.child(chosen, args, *args.child)
        return 0
    rows = runner.run(chosen, args, log=lambda line: print(line, flush=True))
    summaries = records.summarize(rows, chosen.reference, chosen.control)
    print(records.table(summaries, chosen.reference, chosen.control))
    if not args.no_write:
        command = "python -m benchmarks " + " ".join(argv)
        extra = dict(reference=chosen.reference, control=chosen.control)
        extra["modes"] = args.modes
        path = records.write(
            chosen.name, args.name, command, rows, summaries, extra
        )
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
