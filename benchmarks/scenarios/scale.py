"""`scale`: whole fits on JAX over one device, two devices, two processes.

`fits`' trial (`fit(epochs=2)`, weights checked after the first) per case
(`dcn@1x2`: a workload in a configuration), in fresh processes since JAX
fixes its devices at start: `1x1` one process, one CPU device; `1x2` one
process, two host devices (XLA's `DEVICES` flag); `2x1` two processes joined
by `keras.distribution.initialize` (a coordinator on loopback, gloo
collectives), one device each, Keras sharding the dataset per process. Two
devices: `DataParallel` over both. Modes: `expert` (the reference),
`staged`, `expert_again`; every process fits them in the same rotated order
(their steps meet in collectives) and process 0's rows are kept. On 2 cores
more devices add no compute: the table says what staging costs or saves
when Keras distributes, not a speed-up.
"""

import os
import socket

import keras
import tensorflow as tf

from benchmarks.scenarios.fits import Fits
from benchmarks.workloads import workload

# A configuration: (processes, devices per process).
CONFIGS = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1)}
DEVICES = "--xla_force_host_platform_device_count"
# A smoke run compiles at XLA's lowest optimization level: most of its CPU
# time is compiling steps that then run a few batches.
QUICK_XLA = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)


def distribute(processes, devices):
    """Joins this case's processes and lays batches over all devices."""
    import jax

    if keras.distribution.distribution() is not None:
        return  # done by the case's first mode
    if processes > 1:
        keras.distribution.initialize()  # from KERAS_DISTRIBUTION_*
    if jax.process_count() != processes or jax.device_count() != (
        processes * devices
    ):
        raise RuntimeError(
            f"Expected {processes} process(es) of {devices} device(s); JAX "
            f"has {jax.process_count()} and {jax.device_count()} device(s)."
        )
    if processes * devices > 1:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices())
        )


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scale(Fits):
    name = "scale"
    process = "case"
    epochs = 2
    rounds, quick_rounds = 5, 1
    timeout = 1200  # seconds: a stuck collective must not hang the run

    def arguments(self, parser):
        super().arguments(parser)
        parser.set_defaults(workloads="criteo_columns,dcn")
        parser.add_argument("--configs", default=",".join(CONFIGS))

    def cases(self, args):
        if keras.backend.backend() != "jax":
            raise SystemExit("scale runs on JAX: KERAS_BACKEND=jax, .venv-jax")
        configs = args.configs.split(",")
        unknown = sorted(set(configs) - set(CONFIGS))
        if unknown:
            raise SystemExit(f"--configs: unknown {unknown}, not in {CONFIGS}")
        return [
            f"{name}@{config}"
            for config in configs
            for name in args.workloads.split(",")
        ]

    def case_processes(self, case, args):
        processes, devices = CONFIGS[case.split("@")[1]]
        flags = os.environ.get("XLA_FLAGS", "").split()
        flags = [flag for flag in flags if not flag.startswith(DEVICES)]
        flags += [f"{DEVICES}={devices}", *(QUICK_XLA if args.quick else ())]
        env = {"KERAS_BACKEND": "jax", "XLA_FLAGS": " ".join(flags)}
        if processes == 1:
            return [env]
        joined = {
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{_free_port()}",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(processes),
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        }
        return [
            {**env, **joined, "KERAS_DISTRIBUTION_PROCESS_ID": str(index)}
            for index in range(processes)
        ]

    def setup(self, case, mode, args):
        name, config = case.split("@")
        distribute(*CONFIGS[config])
        return self.fitted(case, workload(name), mode, args)

    def dataset(self, work, x, y):
        # Whole batches: Keras shards a dataset across processes by its
        # global batch size, which a map after a batch of unknown size hides.
        data = tf.data.Dataset.from_tensor_slices((x, y))
        return data.batch(work.batch_size, drop_remainder=True)


SCENARIO = Scale()
