"""The `remote` stage against hand-built pipelines of the same work.

`python -m benchmarks.remote_pipelines [REPS] [STEPS]` trains the `remote`
workload in one process, interleaved: staged with `"auto"` (what `make
bench` measures), four tf.data pipelines built by hand with the same
reads, the same parsing and the same 16-thread private pool, and the
trunk alone on cached batches (`compute-bound`, the limit when the stage
keeps up):

- `fused, AUTOTUNE`: read + parse in one autotuned map, what `"auto"`
  builds at its largest pool;
- `fused, 16`: the same map with 16 elements at once;
- `fused, AUTOTUNE, cpu_budget 2`: the autotuner told the machine has 2
  cores, not the pool's 16;
- `split, 16 + 1`: the reads in one map, 16 at once, the parsing in a
  second with one at a time, so at most one parse competes with the
  training step for the 2 cores.

Each pipeline ends in `prefetch(AUTOTUNE)` and trains the trunk model. It
prints the median ms/step, CPU ms/step, and the medians of the
per-repetition ratios to staged and to compute-bound. If the best
pipeline tf.data offers for this work is no nearer the trunk alone than
the stage, the stage's distance to the limit is the machine's (both halves
on the same cores), not the engine's. The figures in docs/benchmarks.md
("`remote` against hand-built pipelines") come from it.
"""

import statistics
import sys

import tensorflow as tf

from benchmarks.modes import ComputeBoundMode, FitMode, StagedMode
from benchmarks.paired import paired_ratio, timed_rounds
from benchmarks.workloads.remote import RemoteWorkload

STEPS = 300
POOL = 16


class PipelineMode(FitMode):
    """The trunk trained on a hand-built pipeline of `remote`'s work.

    Args:
        workload: The `remote` workload.
        name: The mode's name in the printed table.
        read_parallel: Parallelism of the map that reads (and, unless
            `parse_parallel` is set, parses): an int or `AUTOTUNE`.
        parse_parallel: Parallelism of a second map that parses; `None`
            parses in the reading map.
        cpu_budget: `tf.data.Options().autotune.cpu_budget`; `None` keeps
            tf.data's default.
    """

    def __init__(
        self,
        workload,
        name,
        read_parallel,
        parse_parallel=None,
        cpu_budget=None,
    ):
        super().__init__(workload)
        self.name = name
        self.read_parallel = read_parallel
        self.parse_parallel = parse_parallel
        self.cpu_budget = cpu_budget

    def build(self):
        read, parse = self.workload.preprocessing()
        dataset = self.workload.raw_dataset()
        if self.parse_parallel is None:
            dataset = dataset.map(
                lambda x, y: (parse(read(x, training=True)), y),
                num_parallel_calls=self.read_parallel,
            )
        else:
            dataset = dataset.map(
                lambda x, y: (read(x, training=True), y),
                num_parallel_calls=self.read_parallel,
            ).map(
                lambda x, y: (parse(x, training=True), y),
                num_parallel_calls=self.parse_parallel,
            )
        options = tf.data.Options()
        options.threading.private_threadpool_size = POOL
        # As in the stage: no prefetch injected besides the one below.
        options.experimental_optimization.inject_prefetch = False
        if self.cpu_budget is not None:
            options.autotune.cpu_budget = self.cpu_budget
        dataset = dataset.prefetch(tf.data.AUTOTUNE).with_options(options)
        model = self.workload.trunk_model()
        model.compile(**self.workload.compile_kwargs())
        return model, dataset


def main(argv=None):
    """Runs the comparison; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    reps = int(argv[0]) if argv else 15
    steps = int(argv[1]) if len(argv) > 1 else STEPS
    auto = tf.data.AUTOTUNE
    workload = RemoteWorkload(steps=steps)
    modes = {
        "staged, auto": StagedMode(workload),
        "fused, AUTOTUNE": PipelineMode(workload, "fused-auto", auto),
        "fused, 16": PipelineMode(workload, "fused-16", POOL),
        "fused, AUTOTUNE, cpu_budget 2": PipelineMode(
            workload, "fused-budget2", auto, cpu_budget=2
        ),
        "split, 16 + 1": PipelineMode(workload, "split-16-1", POOL, 1),
        "compute-bound": ComputeBoundMode(workload),
    }
    _, seconds, cpu = timed_rounds(modes, reps)
    workload.close()
    print(
        f"{'pipeline':30} ms/step  CPU ms/step  time / staged  "
        "time / compute-bound (paired)"
    )
    for name in modes:
        print(
            f"{name:30} {statistics.median(seconds[name]) * 1e3:7.2f}  "
            f"{statistics.median(cpu[name]) * 1e3:11.2f}  "
            f"{paired_ratio(seconds[name], seconds['staged, auto']):13.3f}  "
            f"{paired_ratio(seconds[name], seconds['compute-bound']):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
