"""`calls`: many calls on one dataset object, what a kept stage costs.

A round of a mode is `--calls` calls of `--method` (`evaluate`, `predict`,
`fit`: `epochs=1`, shuffled; `fit-validation`: `epochs=3`, 5 batches of
validation data) on one `tf.data.Dataset` made in setup (a notebook's
repeated `evaluate`, a validation set given to every fit), or with
`--new-datasets` on a new one of the same data per call (from the second
call on, the stage reads a fed source). The staged mode is `staged_always`
(`adaptive=False`): every call staged, so a row measures the stage; the
untimed warm-up round builds it. `--strategy mirrored`: the model built in
a `MirroredStrategy` scope over two logical CPUs, called outside it (there
keras_stage's planner cannot yet read a mirrored variable), workload
`dense` unless named; `--service`: the stage on a local tf.data service.
Off TensorFlow the hand split (`expert`, its mapped dataset made once) is
the reference, `expert_again` the control. Cases are `<workload>-<method>`.
"""

import contextlib
import dataclasses
import functools

import keras
import tensorflow as tf

from benchmarks.modes import Built
from benchmarks.runner import Scenario
from benchmarks.workloads import workload
from keras_stage.data.service import LocalService

METHODS = ("evaluate", "predict", "fit", "fit-validation")
VALIDATION_BATCHES = 5
_TF = keras.backend.backend() == "tensorflow"
# criteo parses TSV lines with TensorFlow ops: TensorFlow only.
DEFAULT = "criteo" if _TF else "criteo_columns"


@functools.cache
def mirrored():
    """`MirroredStrategy` over two logical CPUs (once: before TF starts)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    return tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])


def feeds(work, x, y, method, feed=lambda data: data):
    """`(dataset, kwargs)` of a call of `method`, its datasets `feed`'s."""
    if method in ("evaluate", "predict"):
        return feed(work.dataset(x, y if method == "evaluate" else None)), {}
    data = feed(work.dataset(x, y, shuffle_seed=0))
    if method == "fit":
        return data, {"epochs": 1}
    validation = feed(work.dataset(x, y).take(VALIDATION_BATCHES))
    return data, {"epochs": 3, "validation_data": validation}


class Calls(Scenario):
    name = "calls"
    reference, control = (
        ("plain", "plain_again") if _TF else ("expert", "expert_again")
    )
    modes = (reference, "staged_always", control)

    def arguments(self, parser):
        parser.add_argument("--workloads", help="comma-separated")
        parser.add_argument("--method", default="evaluate", help=str(METHODS))
        parser.add_argument("--calls", type=int, default=5, help="per round")
        parser.add_argument("--batches", type=int, help="20, quick 6")
        parser.add_argument("--new-datasets", action="store_true")
        parser.add_argument("--strategy", choices=("mirrored",))
        parser.add_argument("--service", action="store_true")

    def cases(self, args):
        methods = args.method.split(",")
        if not set(methods) <= set(METHODS):
            raise SystemExit(f"--method {methods}: expected of {METHODS}.")
        if args.strategy and not _TF:
            raise SystemExit("--strategy needs the TensorFlow backend.")
        names = args.workloads or (
            "dense" if args.strategy else "tabular," + DEFAULT
        )
        return [f"{w}-{m}" for w in names.split(",") for m in methods]

    def setup(self, case, mode, args):
        name, method = case.split("-", 1)
        # First: logical devices are set before TF's runtime starts.
        scope = mirrored().scope if args.strategy else contextlib.nullcontext
        work = workload(name)
        batches = args.batches or (6 if args.quick else 20)
        x, y = work.data(work.batch_size * batches)
        service = None
        if args.service and mode.staged:
            service = LocalService(num_workers=1)
            options = {**mode.options, "service": service.target}
            mode = dataclasses.replace(mode, options=options)
        with scope():
            built = mode.build(work, x)
        fresh = functools.partial(feeds, work, x, y, method)
        kept = None if args.new_datasets else fresh()
        if kept and built.kind == "expert":
            # The hand split's datasets mapped once, as its user keeps them.
            kept = fresh(built.feed)
            built = Built(built.model, "plain")  # fed as they are from now on
        feed = fresh if args.new_datasets else (lambda: kept)
        return built, method.split("-")[0], feed, args.calls, service

    def trial(self, state):
        built, method, feed, calls, _ = state
        for _ in range(calls):
            data, kwargs = feed()
            built.call(method, data, **kwargs)

    def close(self, state):
        if state[-1] is not None:
            state[-1].close()  # the tf.data service


SCENARIO = Calls()
