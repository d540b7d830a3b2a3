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
from benchmarks.workloads.images import ImagesWorkload

STEPS = 60


def _private_pool(dataset, threads):
    options = tf.data.Options()
    options.threading.private_threadpool_size = threads
    return dataset.with_options(options)


def main(argv=None):
    """Runs the comparison; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    reps = int(argv[0]) if argv else 11
    with tempfile.TemporaryDirectory() as data_dir:
        workload = ImagesWorkload(steps=STEPS, data_dir=data_dir)
        modes = {
            "expert": ExpertMode(workload),
            "expert, private pool 16": ExpertMode(workload),
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
        for name, mode in modes.items():
            mode.setup()
            if name == "expert, private pool 16":
                mode.dataset = _private_pool(mode.dataset, 16)
            mode.run()  # warm-up: tracing
        seconds = {name: [] for name in modes}
        cpu = {name: [] for name in modes}
        auto_pools = []
        for rep in range(reps):
            for name, mode in modes.items():
                record = mode.run()
                seconds[name].append(record["seconds"] / record["steps"])
                cpu[name].append(record["cpu_seconds"] / record["steps"])
                if name == "staged, auto":
                    auto_pools.append(record["verdict"]["thread_pool_size"])
            print(f"rep {rep + 1}/{reps} done", flush=True)
        for mode in modes.values():
            mode.close()
        workload.close()
    expert = seconds["expert"]
    print(f"{'mode':28} ms/step  CPU ms/step  time / expert (paired)")
    for name in modes:
        paired = statistics.median(
            a / b for a, b in zip(seconds[name], expert, strict=True)
        )
        print(
            f"{name:28} {statistics.median(seconds[name]) * 1e3:7.2f}  "
            f"{statistics.median(cpu[name]) * 1e3:11.2f}  {paired:.3f}"
        )
    print(f"staged, auto: thread pool sizes of the reps {auto_pools}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
