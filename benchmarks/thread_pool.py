"""The stage's private thread pool, side by side with expert's pipeline.

`python -m benchmarks.thread_pool [REPS]` trains the `images` workload five
ways in one process, interleaved: expert (tf.data's shared pool), expert
with a private pool of 16 threads, staged with `"auto"` (the adaptive pool:
16 threads for the first epoch, then what the verdict chose), staged with
`thread_pool_size=16` (the fixed pool `"auto"` had before) and staged with
`thread_pool_size=2`. It prints the median ms/step, CPU ms/step and the
median of the per-repetition ratios to expert, and the pool the `"auto"`
stage ran its timed repetitions on. The figures in docs/benchmarks.md
("`images` against expert") come from it.
"""

import statistics
import sys
import tempfile

import tensorflow as tf

from benchmarks.modes import ExpertMode, StagedMode
from benchmarks.paired import paired_ratio, timed_rounds
from benchmarks.workloads.images import ImagesWorkload

STEPS = 60


class _PrivatePoolExpert(ExpertMode):
    """Expert's pipeline on a private pool of 16 threads."""

    name = "expert-pool16"

    def build(self):
        model, dataset = super().build()
        options = tf.data.Options()
        options.threading.private_threadpool_size = 16
        return model, dataset.with_options(options)


def main(argv=None):
    """Runs the comparison; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    reps = int(argv[0]) if argv else 11
    with tempfile.TemporaryDirectory() as data_dir:
        workload = ImagesWorkload(steps=STEPS, data_dir=data_dir)
        modes = {
            "expert": ExpertMode(workload),
            "expert, private pool 16": _PrivatePoolExpert(workload),
            "staged, auto": StagedMode(workload),
            "staged, thread_pool_size=16": StagedMode(
                workload,
                name="staged-pool16",
                options={"thread_pool_size": 16},
            ),
            "staged, thread_pool_size=2": StagedMode(
                workload, name="staged-pool2", options={"thread_pool_size": 2}
            ),
        }
        records, seconds, cpu = timed_rounds(modes, reps)
        workload.close()
    auto_pools = [
        record["verdict"]["thread_pool_size"]
        for record in records["staged, auto"]
    ]
    print(f"{'mode':28} ms/step  CPU ms/step  time / expert (paired)")
    for name in modes:
        print(
            f"{name:28} {statistics.median(seconds[name]) * 1e3:7.2f}  "
            f"{statistics.median(cpu[name]) * 1e3:11.2f}  "
            f"{paired_ratio(seconds[name], seconds['expert']):.3f}"
        )
    print(f"staged, auto: thread pool sizes of the reps {auto_pools}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
