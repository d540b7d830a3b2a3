"""What is timed, and the statistics of the timed repetitions.

This module owns the measurement itself:

- `StepTimer`, the Keras callback timing one `fit` epoch: from the
  *beginning of the first training batch* (`on_train_batch_begin` of
  batch 0) to the *end of the last training batch*
  (`on_train_batch_end`), i.e. every training step of the epoch including
  the first one and every wait for data, but not `fit`'s own set-up before
  the first batch (data adapter, iterator and stage creation, callbacks'
  `on_train_begin`/`on_epoch_begin`) nor its tear-down after the last one.
  The first step alone is recorded too, and the modes time the whole
  `fit` call around it (`call_seconds`), which the headline ratios
  compare (see `TIMED`).
- `summarize`, the median, min and max of the repetitions' times.

The definitions are stated once here, in `TIMED`, and copied into every
results file.
"""

import os
import statistics
import time

import keras

TIMED = (
    "Whole calls (the headline ratios): training modes: one repetition is "
    "one epoch, model.fit(dataset, epochs=1) over `steps` batches, timed "
    "from the call to its return (fit's set-up, the steps and its "
    "tear-down: `call_seconds`, equal to `fit_seconds`); compute-bound is "
    "such a fit of the trunk alone on batches held in memory. input-bound: "
    "one repetition is making an iterator of the staged dataset, one eager "
    "pass of `steps` elements and dropping the iterator. "
    "Steps only (the `steps_` ratios, `seconds`, `steps_per_second`): "
    "training modes from on_train_batch_begin of the first batch to "
    "on_train_batch_end of the last (all steps, waits for data included; "
    "fit's set-up before the first batch and tear-down after the last "
    "excluded); input-bound from before the first next() to after the "
    "last (the iterator made before). "
    "outside_seconds = call_seconds - seconds. "
    "cpu_seconds: this process's CPU time (all threads) over the steps "
    "window; cores = cpu_seconds / seconds. "
    "A warm-up repetition per mode (tracing) is not timed, nor the "
    "gc.collect() after each repetition (cleanup_seconds). Medians over "
    "the repetitions; ratios are of the medians (whole calls: of seconds "
    "per step; steps: of steps/s), time ratios: above 1 is slower than "
    "the reference. The limit is the slower of compute-bound and "
    "input-bound, of the same kind."
)


class StepTimer(keras.callbacks.Callback):
    """Times the training steps of one epoch (see the module docstring).

    After `fit`, `seconds` is the time from the first batch's beginning to
    the last batch's end, `steps` the batches completed,
    `first_step_seconds` the first batch alone and `cpu_seconds` the
    process's CPU time over the same window.
    """

    def __init__(self):
        super().__init__()
        self.reset()

    def reset(self):
        """Forgets the previous epoch's measurement."""
        self.steps = 0
        self._first_begin = None
        self._first_end = None
        self._last_end = None
        self._cpu_begin = None
        self._cpu_end = None

    def on_train_begin(self, logs=None):
        self.reset()

    def on_train_batch_begin(self, batch, logs=None):
        if self._first_begin is None:
            self._cpu_begin = cpu_time()
            self._first_begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._last_end = time.perf_counter()
        self._cpu_end = cpu_time()
        self.steps += 1
        if self._first_end is None:
            self._first_end = self._last_end

    @property
    def seconds(self):
        """Seconds from the first batch's beginning to the last one's end."""
        if self._first_begin is None or self._last_end is None:
            return None
        return self._last_end - self._first_begin

    @property
    def cpu_seconds(self):
        """The process's CPU time over the same window as `seconds`."""
        if self._cpu_begin is None or self._cpu_end is None:
            return None
        return self._cpu_end - self._cpu_begin

    @property
    def first_step_seconds(self):
        """Seconds of the first batch alone (stage start-up included)."""
        if self._first_begin is None or self._first_end is None:
            return None
        return self._first_end - self._first_begin


def cpu_time():
    """CPU seconds used so far by this process, all threads together."""
    times = os.times()
    return times.user + times.system


def summarize(values):
    """Median, min and max of a non-empty list of numbers."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }
