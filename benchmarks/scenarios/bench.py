"""`bench`: the speed table (`make bench`, `make bench-quick`).

Per workload, one round of a mode is one warm `fit(epochs=1)` over the
workload's `steps` batches of raw data, the whole call timed (set-up and
tear-down included); `--epochs 6 --steps 50` times multi-epoch fits.
Modes: plain Keras, keras_stage's three lines, the hand-tuned tf.data
pipeline (`expert`), plain again (the control) and the trunk alone on
batches kept in memory (`compute_bound`: the floor when input is free).
"""

import dataclasses
import json

from benchmarks.runner import Scenario
from benchmarks.workloads import workload

WORKLOADS = ("seed", "criteo", "remote", "images", "none")


class Bench(Scenario):
    name = "bench"
    modes = ("plain", "staged", "expert", "plain_again", "compute_bound")

    def arguments(self, parser):
        parser.add_argument("--workloads", default=",".join(WORKLOADS))
        parser.add_argument("--steps", type=int, help="batches per epoch")
        parser.add_argument("--epochs", type=int, default=1)
        parser.add_argument("--read-ms", type=float, help="remote's read")
        parser.add_argument(
            "--staged-options", type=json.loads, default={}, help="JSON"
        )

    def cases(self, args):
        return args.workloads.split(",")

    def setup(self, case, mode, args):
        more = {"read_seconds": args.read_ms / 1e3} if args.read_ms else {}
        work = workload(case, **(more if case == "remote" else {}))
        if mode.staged:  # StagedInput options, e.g. '{"device": "cpu"}'
            mode = dataclasses.replace(
                mode, options={**mode.options, **args.staged_options}
            )
        steps = args.steps or (work.quick_steps if args.quick else work.steps)
        x, y = work.data(steps * work.batch_size)
        built = mode.build(work, x)
        data = work.dataset(x, y)
        built.feed(data)  # the trunk's batches preprocessed once, untimed
        return built, data, args.epochs

    def trial(self, state):
        built, data, epochs = state
        built.call("fit", data, epochs=epochs)


SCENARIO = Bench()
