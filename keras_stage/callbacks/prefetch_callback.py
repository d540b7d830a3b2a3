"""`PrefetchCallback`: the lifecycle and the report of a staged run.

It begins and ends the epochs of the sources feeding the stages, reads the
stages' counters at epoch boundaries, logs them with a bottleneck verdict,
and stops the stages' threads when the run ends, however it ends.
"""

import logging
import math
import os
import time

import keras
import tensorflow as tf

from keras_stage.data.options import usable_cpus
from keras_stage.data.pipeline_model import SAMPLE_FETCHES
from keras_stage.layers.staged_input import StagedInput, warn_not_staged

logger = logging.getLogger("keras_stage")

# Above this fraction of the epoch spent waiting for data, a run is called
# input-bound.
_INPUT_BOUND_WAIT_RATIO = 0.1
# Margin over prepare / train workers: with exactly that many, any jitter
# makes the step wait.
_THREADS_HEADROOM = 1.25
# One batch being taken while the next waits.
_MIN_SUGGESTED_CAPACITY = 2
# An input-bound stage whose threads would deliver a batch this many times
# faster than it did was starved by the pipeline before it.
_SOURCE_BOUND_FACTOR = 1.5
_MAX_SUGGESTED_CAPACITY = 64
# At this share of the cores in use, an input-bound stage is computing, not
# waiting: more threads would only share the cores.
_CORES_BUSY_LOAD = 0.85


def _process_cpu_seconds():
    """CPU seconds this process has used so far, all threads together."""
    times = os.times()
    return times.user + times.system


def _snapshot(staged):
    """The stage's counters, with this process's CPU seconds so far."""
    return {
        **staged.stats.snapshot(),
        "process_cpu_seconds": _process_cpu_seconds(),
    }


def _require_tensorboard(log_dir):
    """Raises now, not at the first epoch's end, if TensorBoard is missing."""
    try:
        import tensorboard.summary.v2  # noqa: F401  (what tf.summary uses)
    except ImportError as e:
        raise ImportError(
            "PrefetchCallback(log_dir=...) writes TensorBoard event files, "
            "which needs the `tensorboard` package, and it is not installed. "
            "Install it with `pip install tensorboard` (or "
            '`pip install -e ".[tensorboard]"` in the keras_stage checkout), '
            f"or pass log_dir=None. Received: log_dir={log_dir!r}"
        ) from e


class _Binding:
    """One stage feeding one phase (train, test or predict) of a run."""

    def __init__(
        self,
        phase,
        staged,
        adapter,
        long_lived=False,
        pool_shrinks=True,
        carried=False,
        call_reason=None,
        iterator_cost=None,
    ):
        # The arguments are `PrefetchCallback.attach`'s.
        self.phase = phase
        self.staged = staged
        self.adapter = adapter
        self.pool_shrinks = pool_shrinks
        self.long_lived = long_lived
        self.carried = carried
        self.call_reason = call_reason
        self.iterator_cost = iterator_cost
        self.epochs_begun = 0
        self.in_epoch = False
        # See `_rates_of_batches_read_ahead` and `_shrink_cannot_pay`.
        self.busy_rate = None
        self.least_prepare = None
        # The stage's skip counter is cumulative.
        self.skipped_before = 0

    def begin_epoch(self):
        if not self.in_epoch:
            if self.adapter is not None:
                self.adapter.on_epoch_begin()
            if self.staged.runner.records_in_step:
                # The step marks each next fetch at its end; the epoch's
                # first begins now. A long-lived stage already holds the
                # epoch's batches.
                held = self.long_lived and (self.epochs_begun or self.carried)
                self.staged.stats.mark_request(orphan=not held)
            self.epochs_begun += 1
            self.skipped_before = self.staged.stats.snapshot()["skipped"]
        self.in_epoch = True

    def skipped_this_epoch(self, snapshot):
        return snapshot["skipped"] - self.skipped_before

    def end_epoch(self):
        if self.adapter is not None and self.in_epoch:
            self.adapter.on_epoch_end()
        self.in_epoch = False


class PrefetchCallback(keras.callbacks.Callback):
    """Runs the stages of a staged model and reports what they are doing.

    Pass it to `fit` (or `evaluate`/`predict`) of a `keras_stage.Model` or
    `keras_stage.Sequential` with a `StagedInput`; the model adds one when
    you do not, first in the callback list so that History, the progress
    bar, EarlyStopping and TensorBoard all see its logs.

    Each epoch it adds to the logs:

    - `stage_wait_ratio`: fraction of the epoch's training time spent
      waiting for input (0..1). Near 0: the stage keeps up. Under op
      determinism it is read from tf.data's model of the stage's iterator;
      absent when that cannot be read either.
    - `stage_buffer_fill`: mean fill of the stage buffer when the training
      step asked for a batch (0..1). Near 1: batches were waiting.
    - `stage_skipped`: batches skipped this epoch by
      `ignored_exception_types`.
    - `stage_unstaged`: 1 for every epoch of a fit the model runs in
      Keras's step without its stage (its other `stage_*` figures are then
      0); not logged by a staged fit.

    With `verbose=1` it prints a one-line verdict per epoch: input-bound or
    compute-bound, and what to change, by DeepRec's rules of thumb
    (`num_threads >= preprocessing time / training time`,
    `capacity ~ compute time / wait time`). The latest verdict is also in
    `callback.verdict` as a dict. On a model with no stage it logs a
    warning instead, once, naming the fix.

    A stage that leaves its threads to keras_stage (`num_threads="auto"`,
    no `thread_pool_size`) is also resized by the verdict between epochs
    (see `keras_stage.data.pool`).

    A `keras.callbacks.TensorBoard` in the callbacks writes the `stage_*`
    logs with the others. Given `log_dir`, this callback also writes them
    with the verdict's per-batch times under `log_dir/stage` (tags
    `stage/wait_ratio`, `stage/buffer_fill`, `stage/skipped`,
    `stage/prepare_ms_per_batch`, `stage/train_ms_per_batch`,
    `stage/delivery_ms_per_batch`, `stage/suggested_num_threads`,
    `stage/suggested_capacity`).

    Args:
        verbose: 1 prints the verdict each epoch, 0 only logs it at debug
            level. Defaults to `0`.
        log_dir: Folder for TensorBoard event files of the stage's
            figures (needs the `tensorboard` package), or `None` for none.
            Defaults to `None`.

    Attributes:
        verdict: The latest training epoch's verdict, a dict with
            `input_bound`, `source_bound`, `wait_ratio`, `buffer_fill`,
            the per-batch seconds (`source_seconds_per_batch`,
            `delivery_seconds_per_batch`, `prepare_seconds_per_batch`
            (None for a stage with no staged computation, which only
            buffers), `train_seconds_per_batch`), `suggested_num_threads`,
            `suggested_capacity`, `thread_pool_size` and
            `next_thread_pool_size` (for a stage whose pool is resized;
            else None), `staged` (False for an epoch run without the
            stage), `message` and `epoch`; `None` until the first epoch of
            a `fit` ends. Figures the epoch could not time are None.

    Example:

    >>> import numpy as np, keras, keras_stage
    >>> inputs = keras.Input(shape=(2,))
    >>> x = keras_stage.layers.StagedInput(
    ...     num_threads=2, capacity=2, adaptive=False)(inputs)
    >>> model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> cb = keras_stage.callbacks.PrefetchCallback()
    >>> h = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4,
    ...               callbacks=[cb], verbose=0)
    >>> sorted(k for k in h.history if k.startswith("stage_"))
    ['stage_buffer_fill', 'stage_skipped', 'stage_wait_ratio']
    """

    def __init__(self, verbose=0, log_dir=None):
        super().__init__()
        if verbose not in (0, 1, True, False):
            raise ValueError(
                "Invalid value for argument `verbose`. Expected 0 or 1. "
                f"Received: verbose={verbose!r}"
            )
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(
                "Invalid value for argument `log_dir`. Expected a folder "
                f"path or None. Received: log_dir={log_dir!r}"
            )
        if log_dir is not None:
            _require_tensorboard(log_dir)
        self.verbose = int(verbose)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self._writer = None
        self._warned_without_stage = False  # once per callback, not per fit
        self.verdict = None
        self._bindings = {}
        self._unstaged_call = None  # see `attach_unstaged`
        self._epoch_start = None
        self._train_time = None
        self._train_cpu = None
        self._snapshot = None
        # See `on_train_batch_begin`.
        self._starting_epoch = False
        self._first_step_begun = False
        self._after_first_step = None
        self._sampled_batch = 0  # see `_samples_due`

    # -- wiring, called by the staged model ---------------------------------

    def attach(
        self,
        phase,
        staged,
        adapter=None,
        long_lived=False,
        pool_shrinks=True,
        carried=False,
        call_reason=None,
        iterator_cost=None,
    ):
        """Registers the stage feeding `phase` ("train", "test", "predict").

        `long_lived`: the call's epochs run on one iterator; `carried`: an
        earlier call left it. `pool_shrinks`: whether the verdict may
        shrink an adaptive pool, or only grow it. `call_reason`: why the
        call is staged. `iterator_cost`: what a resized pool costs, or None
        (see `_shrink_cannot_pay`). Called by `keras_stage.Model`.
        """
        self._bindings[phase] = _Binding(
            phase,
            staged,
            adapter,
            long_lived,
            pool_shrinks,
            carried,
            call_reason,
            iterator_cost,
        )

    def attach_unstaged(self, reason):
        """Registers a fit the model runs without its stage, and why."""
        self._unstaged_call = reason

    def close(self, timeout=5.0):
        """Ends the sources' epochs and stops every stage thread.

        Returns:
            True if no thread was left behind.
        """
        clean = True
        for binding in self._bindings.values():
            try:
                binding.end_epoch()
            finally:
                clean = binding.staged.close(timeout) and clean
        self._bindings = {}
        self._unstaged_call = None
        return clean

    # -- Keras hooks ----------------------------------------------------------

    def on_train_begin(self, logs=None):
        self.verdict = None
        self._starting_epoch = True
        self._first_step_begun = False
        self._warn_without_stage()

    def on_train_batch_begin(self, batch, logs=None):
        if self._samples_due(batch):
            # Op determinism: tf.data's model keeps a window of fetches.
            self._bindings["train"].staged.stats.sample()
        if not self._starting_epoch or self._snapshot is None:
            return
        # An epoch's first step pays the epoch's start (a trace, a new
        # pipeline), which is neither training nor input: the figures start
        # as the second step begins. Not in a batch-end hook, which would
        # make Keras wait for every step's logs.
        if not self._first_step_begun:
            self._first_step_begun = True
            return
        self._starting_epoch = False
        binding = self._bindings.get("train")
        if binding is not None:
            binding.staged.stats.sample()  # see `PipelineModel.sample`
            self._after_first_step = (_snapshot(binding.staged), time.time())

    def _samples_due(self, batch):
        """Whether the train stage's figures are due a sample now."""
        binding = self._bindings.get("train")
        if binding is None or not binding.staged.stats.samples:
            return False
        if 0 <= batch - self._sampled_batch < SAMPLE_FETCHES:
            return False
        self._sampled_batch = batch
        return True

    def on_epoch_begin(self, epoch, logs=None):
        binding = self._bindings.get("train")
        if binding is None:
            return
        binding.begin_epoch()
        self._snapshot = _snapshot(binding.staged)
        self._starting_epoch = True  # see `on_train_batch_begin`
        self._first_step_begun = False
        self._epoch_start = time.time()
        self._train_time = None
        self._train_cpu = None

    def on_test_begin(self, logs=None):
        if self._epoch_start is not None and self._train_time is None:
            # Validation inside fit: the training part of the epoch ends.
            self._train_time = time.time() - self._epoch_start
            self._train_cpu = _process_cpu_seconds()
        self._warn_without_stage()
        self._begin_phase("test")

    def on_test_end(self, logs=None):
        self._end_phase("test")

    def on_predict_begin(self, logs=None):
        self._warn_without_stage()
        self._begin_phase("predict")

    def on_predict_end(self, logs=None):
        self._end_phase("predict")

    def _warn_without_stage(self):
        """Warns once if the callback's model has no stage to report."""
        model = self.model
        if self._warned_without_stage or model is None:
            return
        staged_inputs = [
            layer
            for layer in getattr(model, "layers", ())
            if isinstance(layer, StagedInput)
        ]
        # Only keras_stage models have it (their module imports this one).
        smart_stage = getattr(model, "smart_stage", None)
        if smart_stage is None and staged_inputs:
            for layer in staged_inputs:
                warn_not_staged(
                    layer,
                    f"its model '{model.name}' is a plain Keras "
                    f"`{type(model).__name__}` (so PrefetchCallback has no "
                    "stage to report)",
                )
        elif smart_stage is None:
            logger.warning(
                "PrefetchCallback has no stage to report: model '%s' is a "
                "plain Keras `%s`, which runs none. Build it with "
                "`keras_stage.Model` or `keras_stage.Sequential`, with a "
                "`keras_stage.layers.StagedInput` right after its inputs (or "
                "compiled with `smart_stage=True`).",
                model.name,
                type(model).__name__,
            )
        elif not staged_inputs and not smart_stage:
            logger.warning(
                "PrefetchCallback has no stage to report: model '%s' has no "
                "`keras_stage.layers.StagedInput` among its layers and is "
                "compiled without `smart_stage`, so it trains like a plain "
                "Keras model. Put a `StagedInput` right after its inputs, or "
                "compile it with `smart_stage=True`.",
                model.name,
            )
        else:
            return
        self._warned_without_stage = True

    def _begin_phase(self, phase):
        binding = self._bindings.get(phase)
        if binding is not None:
            binding.begin_epoch()

    def _end_phase(self, phase):
        binding = self._bindings.get(phase)
        if binding is not None:
            binding.end_epoch()
            _log_service_epoch(binding, None)
            snapshot = binding.staged.stats.snapshot()
            self._report_skips(
                binding, snapshot, binding.skipped_this_epoch(snapshot)
            )

    def on_epoch_end(self, epoch, logs=None):
        binding = self._bindings.get("train")
        if binding is None and self._unstaged_call is not None:
            self._end_epoch_of_unstaged_call(epoch, logs)
            return
        if binding is None or self._snapshot is None:
            return
        binding.end_epoch()
        now = _snapshot(binding.staged)
        if self._train_cpu is not None:
            now["process_cpu_seconds"] = self._train_cpu
        ended = (
            self._epoch_start + self._train_time
            if self._train_time is not None
            else time.time()
        )
        before, started = self._snapshot, self._epoch_start
        if self._after_first_step is not None:
            first, first_ended = self._after_first_step
            if now["consumed"] > first["consumed"]:
                before, started = first, first_ended
        stats = epoch_statistics(
            before, now, ended - started, binding.staged.stage_options
        )
        whole = epoch_statistics(
            self._snapshot,
            now,
            ended - self._epoch_start,
            binding.staged.stage_options,
        )
        if before is not self._snapshot:
            _producer_rates_of_the_epoch(stats, whole)
        _rates_of_batches_read_ahead(stats, whole, binding)
        # Skips are the epoch's, first step included.
        stats["skipped"] = now["skipped"] - self._snapshot["skipped"]
        _log_service_epoch(binding, logs)
        self._snapshot = None
        self._epoch_start = None
        self._after_first_step = None
        self._starting_epoch = False
        if logs is not None:
            # Not measured: left out, as NaN would read as a diverged loss.
            if stats["wait_ratio"] is not None:
                logs["stage_wait_ratio"] = stats["wait_ratio"]
            if stats["buffer_fill"] is not None:
                logs["stage_buffer_fill"] = stats["buffer_fill"]
            logs["stage_skipped"] = stats["skipped"]
        pool = binding.staged.thread_pool
        pool_size = None if pool is None else pool.size
        self.verdict = verdict(
            stats, binding.staged.stage_options, pool_size=pool_size
        )
        self.verdict["epoch"] = epoch
        self.verdict["next_thread_pool_size"] = None
        if pool is not None and self.verdict["input_bound"] is not None:
            self._adapt_pool(
                pool,
                self.verdict,
                binding.pool_shrinks,
                keep=self._shrink_cannot_pay(epoch, binding),
            )
        self.verdict["staged"] = True
        self._add_call_reason(binding)
        self._write_summaries(epoch, stats, self.verdict)
        self._say()
        self._report_skips(binding, now, stats["skipped"])

    def _end_epoch_of_unstaged_call(self, epoch, logs):
        """Logs 0 for the `stage_*` keys and a verdict that says why."""
        if logs is not None:
            logs["stage_wait_ratio"] = 0.0
            logs["stage_buffer_fill"] = 0.0
            logs["stage_skipped"] = 0
            logs["stage_unstaged"] = 1.0
        first = self.verdict is None
        self.verdict = _unstaged_verdict(
            f"Model '{self.model.name}': this fit runs the whole model in "
            f"Keras's step, without its stage: {self._unstaged_call}.",
            epoch,
        )
        self.verdict["call"] = self._unstaged_call
        self._say(first)

    def _say(self, printed=True):
        """Prints the verdict's message with `verbose`, else logs it."""
        if self.verbose and printed:
            print(self.verdict["message"])
        else:
            logger.debug(self.verdict["message"])

    def _add_call_reason(self, binding):
        """Says why the call was staged, in the verdict and first message."""
        self.verdict["call"] = binding.call_reason
        if binding.call_reason is not None and binding.epochs_begun == 1:
            self.verdict["message"] += (
                f" The call is staged: {binding.call_reason}."
            )

    def _adapt_pool(self, pool, verdict, shrink=True, keep=None):
        """Resizes the stage's pool for the next epoch from `verdict`.

        `keep`: why a smaller pool cannot pay (`_shrink_cannot_pay`), or
        None to shrink as the verdict asks.
        """
        before = pool.size
        after = pool.adapt(
            verdict["input_bound"],
            verdict["suggested_num_threads"],
            cores_busy=verdict["cores_busy"],
            shrink=shrink,
        )
        if after < before and keep is not None:
            after = pool.resize(before)
            verdict["message"] += (
                f" Its thread pool stays at {before} threads: {keep}."
            )
        verdict["next_thread_pool_size"] = after
        if after != before:
            verdict["message"] += (
                f" Its thread pool goes from {before} to {after} threads "
                "for the next epoch."
            )

    def _shrink_cannot_pay(self, epoch, binding):
        """Why a smaller pool cannot pay for the rest of the fit, or None.

        A resized pool costs a new iterator (`iterator_cost`); it saves at
        most the staged work of the batches left, per batch the least
        `prepare_seconds_per_batch` after the iterator's first epoch (which
        also holds the stage's start). None when either is unknown.
        """
        cost = (
            None if binding.iterator_cost is None else binding.iterator_cost()
        )
        prepare = self.verdict["prepare_seconds_per_batch"]
        params = self.params or {}
        epochs, steps = params.get("epochs"), params.get("steps")
        if prepare is None:
            return None
        # The first epoch's figure holds the staged layers' first-time work.
        first = binding.epochs_begun == 1 and not binding.carried
        least = binding.least_prepare
        if not first:
            least = prepare if least is None else min(least, prepare)
            binding.least_prepare = least
        if cost is None or not epochs or not steps:
            return None
        left = (epochs - epoch - 1) * steps
        # After the last epoch the next call makes an iterator anyway.
        if not left or not cost:
            return None
        if first:
            return (
                "the staged work per batch of an iterator's first epoch "
                "includes its start; the next epoch's figure decides"
            )
        if left * least >= cost:
            return None
        return (
            f"the {left} batches left in this fit hold at most "
            f"{1000 * left * least:.1f} ms of staged work, less than the "
            f"{1000 * cost:.1f} ms a new iterator of the stage costs"
        )

    def on_train_end(self, logs=None):
        self.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write_summaries(self, epoch, stats, verdict):
        """Writes the epoch's figures as TensorBoard scalars (`log_dir`)."""
        if self.log_dir is None:
            return
        # A writer of its own: the verdict's figures are no epoch logs.
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.log_dir, "stage")
            )
        values = {
            "wait_ratio": stats["wait_ratio"],
            "buffer_fill": stats["buffer_fill"],
            "skipped": stats["skipped"],
            "suggested_num_threads": verdict["suggested_num_threads"],
            "suggested_capacity": verdict["suggested_capacity"],
        }
        for key in ("prepare", "train", "delivery"):
            seconds = verdict.get(f"{key}_seconds_per_batch")
            if seconds is not None:
                values[f"{key}_ms_per_batch"] = 1000.0 * seconds
        with self._writer.as_default():
            for name, value in values.items():
                if value is None:  # not measured (op determinism)
                    continue
                tf.summary.scalar(f"stage/{name}", float(value), step=epoch)
        self._writer.flush()

    def _report_skips(self, binding, snapshot, skipped=None):
        if skipped is None:
            skipped = snapshot["skipped"]
        if not skipped:
            return
        messages = snapshot["skipped_messages"]
        binding.staged.stats.clear_skipped_messages()
        first = "\n  ".join(messages) if messages else "(no message)"
        logger.warning(
            "Stage '%s' skipped %d element(s) in this %s epoch "
            "(ignored_exception_types). First errors:\n  %s",
            binding.staged.name,
            skipped,
            binding.phase,
            first,
        )


# The figures of a verdict that an epoch run without its stage has none of.
_VERDICT_FIGURES = (
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
)


def _unstaged_verdict(message, epoch):
    """The verdict of an epoch run without the stage: no figures."""
    return {
        **{key: None for key in _VERDICT_FIGURES},
        "thread_pool_size": None,
        "cpu_load": None,
        "cores_busy": None,
        "message": message,
        "epoch": epoch,
        "next_thread_pool_size": None,
        "staged": False,
    }


def _measured(seconds):
    """`seconds`, or None for a time the stage could not take (NaN)."""
    return None if math.isnan(seconds) else seconds


def epoch_statistics(before, after, seconds, options):
    """Turns two stage snapshots into one epoch's statistics (None: not
    measured)."""
    consumed = after["consumed"] - before["consumed"]
    produced = after["produced"] - before["produced"]
    wait = _measured(after["wait_seconds"] - before["wait_seconds"])
    busy = _measured(after["busy_seconds"] - before["busy_seconds"])
    buffered = after["buffered_sum"] - before["buffered_sum"]
    if isinstance(options.capacity, int):
        capacity = options.capacity
    else:  # "auto": tf.data sizes the buffer; use the largest fill seen.
        capacity = max(1, after["buffered_peak"])
    seconds = max(seconds, 1e-9)
    cpu_load = None
    if "process_cpu_seconds" in before and "process_cpu_seconds" in after:
        cpu = after["process_cpu_seconds"] - before["process_cpu_seconds"]
        cpu_load = max(0.0, cpu / seconds / usable_cpus())
    return {
        "consumed": consumed,
        "produced": produced,
        "skipped": after["skipped"] - before["skipped"],
        "seconds": seconds,
        "wait_seconds": wait,
        "busy_seconds": busy,
        "wait_ratio": (
            None if wait is None else min(1.0, max(0.0, wait / seconds))
        ),
        "cpu_load": cpu_load,  # share of the machine's cores used
        "buffer_fill": (
            None
            if math.isnan(buffered)
            else min(1.0, buffered / (consumed * capacity))
            if consumed
            else 0.0
        ),
    }


def _producer_rates_of_the_epoch(window, epoch):
    """Gives `window`'s statistics the stage's rates over the whole epoch.

    The window starts after the first step, when the stage may have made
    most of the epoch's elements already: its busy time is taken per
    element over the epoch, for each batch taken in the window.
    """
    if epoch["produced"] <= 0:
        return
    window["produced"] = window["consumed"]
    if epoch["busy_seconds"] is not None:
        window["busy_seconds"] = (
            epoch["busy_seconds"] / epoch["produced"] * window["produced"]
        )


def _rates_of_batches_read_ahead(stats, epoch, binding):
    """Gives an epoch whose batches were made earlier the stage's rate then.

    A long-lived iterator may have read an epoch's batches ahead in the
    epochs before; its work per batch is then the last measured rate.
    """
    if epoch["produced"] > 0:
        if epoch["busy_seconds"] is not None:
            binding.busy_rate = epoch["busy_seconds"] / epoch["produced"]
        return
    if binding.busy_rate is None or stats["busy_seconds"] is None:
        return
    stats["produced"] = stats["consumed"]
    stats["busy_seconds"] = binding.busy_rate * stats["consumed"]


def _duration(seconds):
    """`seconds` in the unit that shows it: s, ms, or us below a millisecond.

    >>> _duration(0.0213), _duration(0.00042), _duration(1.5)
    ('21.3 ms', '420 us', '1.50 s')
    """
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def verdict(stats, options, pool_size=None):
    """The bottleneck verdict of one epoch, by DeepRec's rules of thumb.

    The stage delivers a batch every max(source, prepare / num_threads)
    seconds. The source is not timed per batch: an input-bound stage that
    delivered much slower (`_SOURCE_BOUND_FACTOR`) than its threads compute
    was starved by its source. `pool_size`: the threads of the pool the
    epoch ran on, if resized between epochs.
    """
    if stats["wait_seconds"] is None or stats["busy_seconds"] is None:
        return _untimed_verdict(stats, options, pool_size)
    produced = max(stats["produced"], 1)
    consumed = max(stats["consumed"], 1)
    pace = stats["seconds"] / produced
    prepare = stats["busy_seconds"] / produced
    compute = max(stats["seconds"] - stats["wait_seconds"], 0.0) / consumed
    needed_threads = max(
        1, math.ceil(_THREADS_HEADROOM * prepare / max(compute, 1e-9))
    )
    input_bound = stats["wait_ratio"] >= _INPUT_BOUND_WAIT_RATIO
    if input_bound:
        capacity = math.ceil(
            (stats["seconds"] - stats["wait_seconds"]) / stats["wait_seconds"]
        )
    else:
        # The input keeps up: a deeper buffer would only hold batches.
        capacity = _MIN_SUGGESTED_CAPACITY
    capacity = min(
        max(capacity, _MIN_SUGGESTED_CAPACITY), _MAX_SUGGESTED_CAPACITY
    )
    if isinstance(options.num_threads, int):
        threads = options.num_threads
    elif pool_size is not None:
        threads = pool_size
    else:
        threads = options.resolved_pool_size()
    source_bound = input_bound and (
        pace >= _SOURCE_BOUND_FACTOR * prepare / threads
    )
    name = options.name
    computes = _computes(stats)
    staged_work = (
        f"{_duration(prepare)} of staged computation (per thread)"
        if computes
        else _NO_STAGED_COMPUTATION
    )
    timing = (
        f"per batch: {staged_work}, {_duration(compute)} to train; the "
        f"stage delivered one every {_duration(pace)}"
    )
    waited = (
        f"the training step waited {stats['wait_ratio']:.0%} of the epoch "
        "for data"
    )
    if source_bound:
        threads_could = (
            f"its {threads} threads could deliver one every "
            f"{_duration(prepare / threads)}"
            if computes
            else f"it has no computation of its own for its {threads} threads"
        )
        message = (
            f"Stage '{name}': input-bound, {waited}; {timing}. The pipeline "
            "before the stage is the bottleneck (the stage pulls from it one "
            f"batch at a time, and {threads_could}): parallelize its maps "
            "(num_parallel_calls) and "
            "reads (interleave), or make that work the stage's own "
            "computation so the stage's threads run it: as layers of the "
            "model with compile(smart_stage=True), or as the `fn` of "
            "keras_stage.data.stage."
        )
    elif input_bound:
        message = (
            f"Stage '{name}': input-bound, {waited}; {timing}. Use "
            f"num_threads >= {needed_threads} (now {options.num_threads}) "
            f"and capacity ~{capacity} (now {options.capacity})."
        )
    else:
        message = (
            f"Stage '{name}': compute-bound, {waited}; {timing}. The input "
            f"keeps up; num_threads={needed_threads} would be enough (now "
            f"{options.num_threads})."
        )
    return _verdict_record(
        stats,
        pool_size,
        message,
        input_bound=input_bound,
        source_bound=source_bound,
        source_seconds_per_batch=pace if source_bound else None,
        delivery_seconds_per_batch=pace,
        prepare_seconds_per_batch=prepare if computes else None,
        train_seconds_per_batch=compute,
        suggested_num_threads=needed_threads,
        suggested_capacity=capacity,
    )


_NO_STAGED_COMPUTATION = "no staged computation (the stage only buffers)"


def _computes(stats):
    """Whether the epoch's stage ran a computation of its own (it only
    buffers otherwise, with no busy time)."""
    return stats["busy_seconds"] is not None and stats["busy_seconds"] > 0


def _untimed_verdict(stats, options, pool_size):
    """The verdict of an epoch whose wait or staged work was not timed
    (op determinism): what was measured, and no advice."""
    pace = stats["seconds"] / max(stats["produced"], 1)
    wait_ratio = stats["wait_ratio"]
    busy = stats["busy_seconds"]
    prepare = None if busy is None else busy / max(stats["produced"], 1)
    unmeasured = []
    if wait_ratio is None:
        waited = "the training step's wait for data was not measured"
        unmeasured.append("the wait")
    else:
        waited = (
            f"the training step waited {wait_ratio:.0%} of the epoch for data"
        )
    if prepare is None:
        unmeasured.append("the staged computation")
    elif not _computes(stats):
        prepare = None
        waited += f"; {_NO_STAGED_COMPUTATION}"
    fill = stats["buffer_fill"]
    if fill is None:  # see `StageStats.count_nothing`
        held = "its buffer's fill was not counted"
    else:
        held = f"its buffer was {fill:.0%} full"
    clock = (
        f", and TensorFlow forbids the clock that times "
        f"{' and '.join(unmeasured)}"
        if unmeasured
        else ""
    )
    message = (
        f"Stage '{options.name}': {waited}; per batch, the stage delivered "
        f"one every {_duration(pace)} and {held}. Op determinism is on"
        f"{clock}: no advice on num_threads or capacity."
    )
    return _verdict_record(
        stats,
        pool_size,
        message,
        input_bound=None,
        source_bound=None,
        source_seconds_per_batch=None,
        delivery_seconds_per_batch=pace,
        prepare_seconds_per_batch=prepare,
        train_seconds_per_batch=None,
        suggested_num_threads=None,
        suggested_capacity=None,
    )


def _verdict_record(stats, pool_size, message, **figures):
    """The verdict dict: the epoch's `figures` and what every verdict has."""
    return {
        "input_bound": figures.pop("input_bound"),
        "source_bound": figures.pop("source_bound"),
        "wait_ratio": stats["wait_ratio"],
        "buffer_fill": stats["buffer_fill"],
        **figures,
        "thread_pool_size": pool_size,
        "cpu_load": stats.get("cpu_load"),
        # Unknown counts as busy: no growth past the pool's usual size.
        "cores_busy": stats.get("cpu_load") is None
        or stats["cpu_load"] >= _CORES_BUSY_LOAD,
        "message": message,
    }


def _log_service_epoch(binding, logs):
    """Closes the epoch of a stage on the tf.data service; logs its counts.

    `stage_service_delivered`: examples delivered this epoch;
    `stage_service_lost` and `stage_service_repeated`: against one pass of
    the data per copy, when its size is known (`keras_stage.data.failover`);
    `stage_service_ended_early`: 1.0 if the stage ended the epoch itself.
    """
    ledger = binding.staged.service_ledger
    if ledger is None:
        return
    report = ledger.epoch_report()
    if logs is None:
        return
    logs["stage_service_delivered"] = report["delivered"]
    if report["lost"] is not None:
        logs["stage_service_lost"] = report["lost"]
        logs["stage_service_repeated"] = report["repeated"]
    logs["stage_service_ended_early"] = float(report["ended_early"])
