"""`determinism`: the stage's verdict under op determinism against its clock's.

Without op determinism the stage times itself (a clock in its pipeline and
step); under `enable_op_determinism()` its figures come from tf.data's own
model of its iterator (`keras_stage/data/pipeline_model.py`). That cannot be
turned off: each round runs in a fresh process, a 3-epoch staged fit whose
metrics are the last epoch's `PrefetchCallback.verdict` figures. Workloads:
`slow_source` (the source sleeps 20 ms a batch: input-bound), `slow_step`
(the step does: compute-bound), `criteo` (its TSV parsing staged).
"""

import time

import keras
import tensorflow as tf

from benchmarks.modes import MODES, Mode
from benchmarks.runner import Scenario
from benchmarks.workloads import workload
from benchmarks.workloads.tables import Dense

WORKLOADS = "slow_source,slow_step,criteo"
SLEEP_SECONDS = 0.02
FIGURES = ("input_bound", "wait_ratio", "buffer_fill") + tuple(
    f"{part}_seconds_per_batch" for part in ("prepare", "train", "delivery")
)


class OpDeterminism(Mode):
    """A staged mode built under op determinism (on for the process)."""

    def build(self, *args, **kwargs):
        tf.config.experimental.enable_op_determinism()
        return super().build(*args, **kwargs)


# The same stage under op determinism, and the clock's control.
for _mode in (
    OpDeterminism("staged_deterministic", "staged", {"adaptive": False}),
    Mode("staged_always_again", "staged", {"adaptive": False}),
):
    MODES[_mode.name] = _mode


def sleepy(x):
    """`x`, after `SLEEP_SECONDS` of `time.sleep` in a `tf.py_function`."""
    slept = tf.py_function(
        lambda value: time.sleep(SLEEP_SECONDS) or value, [x], x.dtype
    )
    return tf.ensure_shape(slept, x.shape)


class Slow(Dense):
    """`dense` of 8 features, batches of 4, sleeping in its source or step."""

    batch_size, steps, quick_steps, features, widths = 4, 40, 20, 8, ()

    def __init__(self, name):
        self.name = name

    def trunk(self, features):
        out = super().trunk(features)
        if self.name == "slow_step":  # past Dense: SmartStage leaves it
            out = keras.layers.Lambda(sleepy)(out)
        return out

    def dataset(self, x, y=None, shuffle_seed=None):
        data = super().dataset(x, y, shuffle_seed)
        if self.name == "slow_source":
            data = data.map(lambda x, y: (sleepy(x), y))
        return data


class Determinism(Scenario):
    name = "determinism"
    modes = ("staged_always", "staged_deterministic", "staged_always_again")
    reference, control = "staged_always", "staged_always_again"
    process, rounds, quick_rounds = "round", 3, 1

    def arguments(self, parser):
        parser.add_argument("--workloads", default=WORKLOADS)

    def cases(self, args):
        return args.workloads.split(",")

    def setup(self, case, mode, args):
        work = Slow(case) if case.startswith("slow_") else workload(case)
        steps = work.quick_steps if args.quick else work.steps
        x, y = work.data(steps * work.batch_size)
        built = mode.build(work, x)  # first: it may enable determinism
        return built, work.dataset(x, y)

    def trial(self, state):
        built, data = state
        built.call("fit", data, epochs=3)
        verdict = built.prefetch.verdict
        return {k: float(verdict[k]) for k in FIGURES if verdict[k] is not None}


SCENARIO = Determinism()
