"""The modes: the ways one workload is trained (or only fed) and timed.

This module owns what each mode builds and what one repetition of it runs.
Every mode does the same work per batch (the workload's preprocessing
layers, then its trunk, or only one of the two for the limits):

- `plain`: the whole model as a `keras.Model`, preprocessing in the model,
  fed the raw batches (tf.data's default options, no map, no prefetch).
- `expert`: what a skilled user writes by hand: the preprocessing in
  `dataset.map(preprocess, num_parallel_calls=AUTOTUNE)
  .prefetch(AUTOTUNE)`, a `keras.Model` of the trunk trained on it.
- `staged`: keras_stage's three lines with default options:
  `StagedInput()` first, `keras_stage.Model(...).compile(...,
  smart_stage=True)`, a `PrefetchCallback` in `fit`; fed the raw batches.
- `staged-tuned`: the same with the `num_threads`/`capacity` the
  `PrefetchCallback` verdict of an untimed `staged` epoch suggests.
- `compute-bound`: the trunk alone on the preprocessed batches,
  materialised once in memory (`Dataset.from_tensor_slices` + prefetch);
  its whole call is that `fit`'s.
- `input-bound`: `keras_stage.data.stage(raw batches, fn=preprocess)` with
  default options, iterated eagerly with no training; its whole call is
  making the iterator, the pass, and dropping the iterator.

Each mode keeps its model (and so its traced step) for all repetitions.

Every repetition's record times two windows: the steps (`seconds`, the
first batch's beginning to the last batch's end; for `input-bound` the
first `next()` to the last) and the whole call (`call_seconds`: the `fit`
call, its set-up and tear-down included; for `input-bound` making the
iterator, the pass and dropping the iterator). The headline ratios of the
report are of whole calls (see `benchmarks.harness.add_ratios`).
"""

import time

import keras
import numpy as np
import tensorflow as tf

import keras_stage
from benchmarks.timing import StepTimer, cpu_time

# Keys of the PrefetchCallback verdict kept per repetition.
_VERDICT_KEYS = (
    "input_bound",
    "source_bound",
    "wait_ratio",
    "buffer_fill",
    "source_seconds_per_batch",
    "delivery_seconds_per_batch",
    "prepare_seconds_per_batch",
    "train_seconds_per_batch",
    "suggested_num_threads",
    "suggested_capacity",
    "thread_pool_size",
    "next_thread_pool_size",
    "cpu_load",
    "cores_busy",
    "message",
)


def _with_features(preprocess):
    """`(x, y) -> (preprocess(x), y)`, the map of a labelled dataset."""

    def map_fn(x, y):
        return preprocess(x), y

    return map_fn


class Mode:
    """One way of running a workload; `run` is one timed repetition.

    Args:
        workload: The `benchmarks.workloads.Workload` to run.
    """

    name = ""
    description = ""

    def __init__(self, workload):
        self.workload = workload

    def setup(self):
        """Builds the mode's model and data (not timed)."""

    def run(self):
        """Runs one repetition; returns its record (see `_record`)."""
        raise NotImplementedError

    def settings(self):
        """What the report says about how the mode was configured."""
        return {}

    def close(self):
        """Releases the mode's threads and data."""

    def _record(self, seconds, steps, first_step_seconds, cpu_seconds, **extra):
        if steps != self.workload.steps:
            raise RuntimeError(
                f"{self.name}: ran {steps} steps, expected "
                f"{self.workload.steps}"
            )
        return {
            "seconds": seconds,
            "steps": steps,
            "steps_per_second": steps / seconds,
            "first_step_seconds": first_step_seconds,
            "cpu_seconds": cpu_seconds,
            "cores": cpu_seconds / seconds,
            **extra,
        }


class FitMode(Mode):
    """A mode that trains a model with `fit`, one epoch per repetition."""

    def build(self):
        """Returns `(compiled model, dataset)`."""
        raise NotImplementedError

    def callbacks(self):
        """Callbacks passed to `fit` besides the timer."""
        return []

    def setup(self):
        self.model, self.dataset = self.build()
        self.timer = StepTimer()

    def fit_once(self):
        """One epoch of `fit`; returns `(history, seconds of the call)`."""
        started = time.perf_counter()
        history = self.model.fit(
            self.dataset,
            epochs=1,
            verbose=0,
            # Datasets are not shuffled by fit; saying so avoids a warning.
            shuffle=False,
            callbacks=[self.timer, *self.callbacks()],
        )
        return history, time.perf_counter() - started

    def run(self):
        history, fit_seconds = self.fit_once()
        return self._record(
            self.timer.seconds,
            self.timer.steps,
            self.timer.first_step_seconds,
            self.timer.cpu_seconds,
            fit_seconds=fit_seconds,
            # The whole call: what the headline ratios compare.
            call_seconds=fit_seconds,
            # fit's own set-up and tear-down, outside the steps window.
            outside_seconds=fit_seconds - self.timer.seconds,
            loss=float(history.history["loss"][-1]),
            **self.extras(history),
        )

    def extras(self, history):
        """Mode-specific values recorded with each repetition."""
        return {}


class PlainMode(FitMode):
    name = "plain"
    description = (
        "keras.Model of the whole model (preprocessing as layers), raw "
        "batches, tf.data default options"
    )

    def build(self):
        model = self.workload.whole_model(keras.Model)
        model.compile(**self.workload.compile_kwargs())
        return model, self.workload.raw_dataset()


class ExpertMode(FitMode):
    name = "expert"
    description = (
        "preprocessing in dataset.map(num_parallel_calls=AUTOTUNE)"
        ".prefetch(AUTOTUNE), keras.Model of the trunk"
    )

    def build(self):
        dataset = self.workload.raw_dataset()
        preprocess = self.workload.preprocess_fn()
        if preprocess is not None:
            dataset = dataset.map(
                _with_features(preprocess),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
        # Nothing to map (the `none` workload): the prefetch alone.
        dataset = dataset.prefetch(tf.data.AUTOTUNE)
        model = self.workload.trunk_model()
        model.compile(**self.workload.compile_kwargs())
        return model, dataset

    def settings(self):
        return {
            "map": "none"
            if self.workload.preprocess_fn() is None
            else "num_parallel_calls=AUTOTUNE",
            "prefetch": "AUTOTUNE",
        }


class StagedMode(FitMode):
    """keras_stage's three lines, with `StagedInput(**options)`.

    Args:
        workload: The workload.
        name: The mode's name in the report.
        options: `StagedInput` options; none for the defaults.
        tuned_from: For the report: where the options came from.
    """

    name = "staged"
    description = (
        "keras_stage.Model, StagedInput() with defaults first, "
        "compile(smart_stage=True), PrefetchCallback in fit; raw batches"
    )

    def __init__(self, workload, name=None, options=None, tuned_from=None):
        super().__init__(workload)
        if name is not None:
            self.name = name
        self.options = dict(options or {})
        self.tuned_from = tuned_from
        if self.options:
            values = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
            self.description = f"as staged, with StagedInput({values})"
            if tuned_from is not None:
                self.description += (
                    " (threads and capacity from the PrefetchCallback "
                    "verdict of an untimed staged epoch)"
                )

    def build(self):
        self.staged_input = keras_stage.layers.StagedInput(**self.options)
        model = self.workload.whole_model(
            keras_stage.Model, staged_input=self.staged_input
        )
        model.compile(**self.workload.compile_kwargs(), smart_stage=True)
        self.prefetch = keras_stage.callbacks.PrefetchCallback(verbose=0)
        return model, self.workload.raw_dataset()

    def callbacks(self):
        return [self.prefetch]

    def extras(self, history):
        logs = history.history
        verdict = self.prefetch.verdict or {}

        def last(key, kind):
            # A fit the package ran unstaged (it could not repay its stage,
            # see keras_stage/models/decision/calls.py) logs no stage keys.
            return kind(logs[key][-1]) if key in logs else None

        return {
            "stage_wait_ratio": last("stage_wait_ratio", float),
            "stage_buffer_fill": last("stage_buffer_fill", float),
            "stage_skipped": last("stage_skipped", int),
            "unstaged": "stage_skipped" not in logs,
            "verdict": {k: verdict.get(k) for k in _VERDICT_KEYS},
        }

    def calibrate(self):
        """One untimed epoch; returns its PrefetchCallback verdict.

        Run after the warm-up, so the verdict is not skewed by tracing.
        """
        # Staged whatever the call decision says (a short calibration fit
        # on data in memory may otherwise run unstaged, with no verdict):
        # the verdict of a staged epoch is what is read here.
        adaptive = self.staged_input.adaptive
        self.staged_input.adaptive = False
        try:
            self.fit_once()
        finally:
            self.staged_input.adaptive = adaptive
        verdict = self.prefetch.verdict
        if verdict is None:
            raise RuntimeError(f"{self.name}: the callback gave no verdict")
        return {k: verdict.get(k) for k in _VERDICT_KEYS}

    def settings(self):
        options = self.staged_input.stage_options
        plan = self.model.get_stage_plan()
        out = {
            "staged_input_options": self.options,
            "capacity": options.capacity,
            "num_threads": options.num_threads,
            "thread_pool_size": options.resolved_pool_size(),
            "deterministic": options.deterministic,
            "timeout": options.timeout,
            "staged_layers": list(plan.staged_layers),
            "trunk_layers": list(plan.trunk_layers),
            "cut": [
                {
                    "name": b.name,
                    "dtype": str(b.dtype),
                    "bytes_per_example": b.bytes_per_example,
                }
                for b in plan.boundary
            ],
        }
        if getattr(plan, "note", None):
            out["plan_note"] = plan.note
        if self.tuned_from is not None:
            out["tuned_from"] = self.tuned_from
        return out


class ComputeBoundMode(FitMode):
    name = "compute-bound"
    description = (
        "the trunk alone on preprocessed batches materialised once in memory "
        "(Dataset.from_tensor_slices + prefetch(AUTOTUNE))"
    )

    def build(self):
        dataset = self.workload.raw_dataset()
        preprocess = self.workload.preprocess_fn()
        if preprocess is not None:
            dataset = dataset.map(
                _with_features(preprocess),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
        # Preprocess every batch once and keep the tensors: stacked, they
        # are sliced back into the same batches with no work per batch.
        batches = [
            keras.tree.map_structure(lambda t: t.numpy(), element)
            for element in dataset
        ]
        stacked = keras.tree.map_structure(
            lambda *leaves: np.stack(leaves), *batches
        )
        materialised = tf.data.Dataset.from_tensor_slices(stacked).prefetch(
            tf.data.AUTOTUNE
        )
        model = self.workload.trunk_model()
        model.compile(**self.workload.compile_kwargs())
        return model, materialised


class InputBoundMode(Mode):
    name = "input-bound"
    description = (
        "keras_stage.data.stage(raw batches, fn=preprocess) with defaults, "
        "iterated eagerly with no training"
    )

    def setup(self):
        preprocess = self.workload.preprocess_fn()
        fn = None
        if preprocess is not None:
            map_fn = _with_features(preprocess)

            def fn(element):
                return map_fn(*element)

        self.staged = keras_stage.data.stage(
            self.workload.raw_dataset(),
            fn=fn,
            name=f"{self.workload.name}_input_bound",
        )

    def run(self):
        steps = 0
        first = None
        # The whole call, as a fit's: making the iterator (which starts the
        # stage's epoch), the pass, and dropping the iterator at the end.
        call_started = time.perf_counter()
        iterator = iter(self.staged)
        # The steps window opens after the iterator is made, as fit makes
        # its iterator before the first step: it holds the waits for
        # elements, not the set-up.
        cpu = cpu_time()
        started = time.perf_counter()
        for _ in iterator:
            steps += 1
            if first is None:
                first = time.perf_counter() - started
        ended = time.perf_counter()
        cpu_seconds = cpu_time() - cpu
        del iterator
        call_seconds = time.perf_counter() - call_started
        seconds = ended - started
        return self._record(
            seconds,
            steps,
            first,
            cpu_seconds,
            call_seconds=call_seconds,
            outside_seconds=call_seconds - seconds,
        )

    def settings(self):
        options = self.staged.stage_options
        return {
            "capacity": options.capacity,
            "num_threads": options.num_threads,
            "thread_pool_size": options.resolved_pool_size(),
        }

    def close(self):
        staged = getattr(self, "staged", None)
        if staged is not None:
            staged.close()


# The modes built from a workload alone, in the order they run; the harness
# adds `staged-tuned` (after `staged`) once `staged` has been calibrated.
BASE_MODES = (
    PlainMode,
    ExpertMode,
    StagedMode,
    ComputeBoundMode,
    InputBoundMode,
)
MODE_ORDER = (
    "plain",
    "expert",
    "staged",
    "staged-tuned",
    "compute-bound",
    "input-bound",
)
MODE_DESCRIPTIONS = {
    **{cls.name: cls.description for cls in BASE_MODES},
    "staged-tuned": (
        "as staged, with StagedInput(num_threads=..., capacity=...) from the "
        "PrefetchCallback verdict of an untimed staged epoch"
    ),
}
