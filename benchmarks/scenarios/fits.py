"""`fits`: warm whole `fit` calls, string inputs on every backend.

Per workload, a round of a mode is one whole unshuffled `fit(epochs=3)` over
the workload's `steps` batches of raw data (the keras-rs recommenders also
validated, as their examples are), the model kept across rounds. The
reference is `plain` on TensorFlow, else the hand split (`expert`): there
plain Keras cannot take the string columns. The weight check: each mode
fits once in `setup`, from the same seed on the same batches, and its
weights must be within `TOLERANCE` of the first mode's (else a table of
modes that train different models measures nothing: `setup` raises).
"""

import sys

import keras
import numpy as np

from benchmarks.runner import Scenario
from benchmarks.workloads import workload

RECOMMENDERS = ("retrieval", "deep_retrieval", "dlrm")
# Off TensorFlow also the tables the JAX and torch families fitted.
WORKLOADS = {"tensorflow": RECOMMENDERS}
OTHERS = ("tabular", "criteo_columns", *RECOMMENDERS)
# Largest |difference| of two modes' weights after the same fit: float
# rounding is far below it, other batches or initial weights far above.
TOLERANCE = 1e-4


class Fits(Scenario):
    name = "fits"
    epochs = 3

    def __init__(self):
        if keras.backend.backend() == "tensorflow":
            self.reference, self.control = "plain", "plain_again"
        else:
            self.reference, self.control = "expert", "expert_again"
        self.modes = (self.reference, "staged", self.control)
        self.first = {}  # case: (mode, its weights after the check's fit)

    def arguments(self, parser):
        default = WORKLOADS.get(keras.backend.backend(), OTHERS)
        parser.add_argument("--workloads", default=",".join(default))
        parser.add_argument("--steps", type=int, help="batches per epoch")

    def cases(self, args):
        return args.workloads.split(",")

    def setup(self, case, mode, args):
        return self.fitted(case, workload(case), mode, args)

    def fitted(self, case, work, mode, args):
        """`work` built as `mode`, fitted once; its weights checked."""
        steps = args.steps or (work.quick_steps if args.quick else work.steps)
        x, y = work.data(steps * work.batch_size)
        state = {
            "case": case,
            "built": mode.build(work, x),
            "data": self.dataset(work, x, y),
            "kwargs": {"epochs": self.epochs},
        }
        if work.name in RECOMMENDERS:
            val = work.data(steps * work.batch_size // 8, seed=1)
            state["kwargs"]["validation_data"] = self.dataset(work, *val)
        self.trial(state)
        model = state["built"].model
        weights = [
            keras.ops.convert_to_numpy(w) for w in model.trainable_weights
        ]
        first, theirs = self.first.setdefault(case, (mode.name, weights))
        if first != mode.name:
            state["max_dw"] = max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(weights, theirs, strict=True)
            )
            check = (
                f"{self.name} {case}: weight check: max |{mode.name} - "
                f"{first}| after the same fit: {state['max_dw']:.1e}"
            )
            print(check, file=sys.stderr, flush=True)
            if state["max_dw"] > TOLERANCE:
                raise RuntimeError(f"{check}: the modes train different models")
        return state

    def dataset(self, work, x, y):
        return work.dataset(x, y)

    def trial(self, state):
        state["built"].call("fit", state["data"], **state["kwargs"])

    def close(self, state):
        self.first.pop(state["case"], None)  # a later run checks afresh


SCENARIO = Fits()
