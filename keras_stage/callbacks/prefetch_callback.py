"""`PrefetchCallback`: runs a staged call's stages and reports on them."""

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

# Waiting for data this share of the epoch makes a run input-bound.
_INPUT_BOUND_WAIT_RATIO = 0.1
# Margin over prepare / train threads: with exactly that many, jitter waits.
_THREADS_HEADROOM = 1.25
_MIN_SUGGESTED_CAPACITY = 2  # one batch taken while the next waits
_MAX_SUGGESTED_CAPACITY = 64
# A stage this much slower than its threads was starved by its source.
_SOURCE_BOUND_FACTOR = 1.5
# At this share of the cores in use, more threads would only share them.
_CORES_BUSY_LOAD = 0.85


def _process_cpu_seconds():
    times = os.times()
    return times.user + times.system


def _snapshot(staged):
    """The stage's counters, with this process's CPU seconds so far."""
    return {
        **staged.stats.snapshot(),
        "process_cpu_seconds": _process_cpu_seconds(),
    }


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
        # `PrefetchCallback.attach` documents the arguments.
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
        self.skipped_before = 0  # the stage's skip counter is cumulative

    def begin_epoch(self):
        if not self.in_epoch:
            if self.adapter is not None:
                self.adapter.on_epoch_begin()
            if self.staged.runner.records_in_step:
                # The step marks the next fetch at its end; the first is now.
                held = self.long_lived and (self.epochs_begun or self.carried)
                self.staged.stats.mark_request(orphan=not held)
            self.epochs_begun += 1
            self.skipped_before = self.staged.stats.snapshot()["skipped"]
        self.in_epoch = True

    def end_epoch(self):
        if self.adapter is not None and self.in_epoch:
            self.adapter.on_epoch_end()
        self.in_epoch = False


class PrefetchCallback(keras.callbacks.Callback):
    """Runs the stages of a staged model and reports what they are doing.

    `keras_stage.Model` and `keras_stage.Sequential` add one to `fit`,
    `evaluate` and `predict` when none is passed, first in the callback
    list so that History, EarlyStopping and TensorBoard see its logs.

    Each epoch it adds to the logs:

    - `stage_wait_ratio`: fraction of the epoch's training time spent
      waiting for input (0..1); absent when it could not be measured.
    - `stage_buffer_fill`: mean fill of the stage buffer when the step
      asked for a batch (0..1). Near 1: batches were waiting.
    - `stage_skipped`: batches skipped this epoch (ignored exceptions).
    - `stage_unstaged`: 1 for every epoch of a fit the model runs without
      its stage (its other `stage_*` figures are then 0); else absent.

    Each epoch also gets a verdict: input-bound or compute-bound and what
    to change, by DeepRec's rules of thumb (`num_threads >= preprocessing
    time / training time`, `capacity ~ compute time / wait time`). A stage
    with `num_threads="auto"` and no `thread_pool_size` has its pool
    resized by it between epochs. A model with no stage gets one warning.

    Args:
        verbose: 1 prints the verdict each epoch, 0 only logs it at debug
            level. Defaults to `0`.
        log_dir: Folder for TensorBoard `stage/*` scalars of the stage's
            and the verdict's figures (needs `tensorboard`), or `None`.
            Defaults to `None`.

    Attributes:
        verdict: The latest training epoch's verdict: a dict of its
            figures (`input_bound`, `source_bound`, `wait_ratio`,
            `buffer_fill`, `{source,delivery,prepare,train}_seconds_per_batch`,
            `suggested_num_threads`, `suggested_capacity`,
            `thread_pool_size`, `next_thread_pool_size`; None if not
            measured), `staged` (False for a fit run without the stage),
            `message` and `epoch`. None until a `fit`'s first epoch ends.

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
            # Fails now, not at the first epoch's end.
            try:
                import tensorboard.summary.v2  # noqa: F401  (tf.summary's)
            except ImportError as e:
                raise ImportError(
                    "PrefetchCallback(log_dir=...) writes TensorBoard event "
                    "files, which needs the `tensorboard` package, and it is "
                    "not installed. Install it with `pip install tensorboard` "
                    '(or `pip install -e ".[tensorboard]"` in the keras_stage '
                    "checkout), or pass log_dir=None. Received: "
                    f"log_dir={log_dir!r}"
                ) from e
        self.verbose = int(verbose)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self._writer = None
        self._warned_without_stage = False  # once per callback, not per fit
        self.verdict = None
        self._bindings = {}
        self._unstaged_call = None
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

    def attach(self, phase, staged, adapter=None, **binding):
        """Registers the stage feeding `phase` ("train", "test", "predict");
        `binding`: `long_lived` (its epochs run on one iterator), `carried`
        (an earlier call left it), `pool_shrinks` (the verdict may shrink an
        adaptive pool), `call_reason` (why the call is staged) and
        `iterator_cost` (what a resized pool costs, or None)."""
        self._bindings[phase] = _Binding(phase, staged, adapter, **binding)

    def attach_unstaged(self, reason):
        """Registers a fit the model runs without its stage, and why."""
        self._unstaged_call = reason

    def close(self, timeout=5.0):
        """Ends the sources' epochs and stops every stage thread; True if
        none was left behind."""
        clean = True
        for binding in self._bindings.values():
            try:
                binding.end_epoch()
            finally:
                clean = binding.staged.close(timeout) and clean
        self._bindings = {}
        self._unstaged_call = None
        return clean

    def on_train_begin(self, logs=None):
        self.verdict = None
        self._warn_without_stage()

    def on_train_batch_begin(self, batch, logs=None):
        if self._samples_due(batch):
            self._bindings["train"].staged.stats.sample()
        if not self._starting_epoch or self._snapshot is None:
            return
        # The first step pays the epoch's start: the figures start as the
        # second begins (a batch-end hook would make Keras wait each step).
        if not self._first_step_begun:
            self._first_step_begun = True
            return
        self._starting_epoch = False
        binding = self._bindings.get("train")
        if binding is not None:
            binding.staged.stats.sample()  # see `PipelineModel.sample`
            self._after_first_step = (_snapshot(binding.staged), time.time())

    def _samples_due(self, batch):
        """Whether tf.data's model of the train stage is due a sample."""
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
            # Validation in fit: the epoch's training ends.
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
        # Only keras_stage models have it.
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
            skipped = snapshot["skipped"] - binding.skipped_before
            self._report_skips(binding, snapshot, skipped)

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
        options = binding.staged.stage_options
        stats = epoch_statistics(before, now, ended - started, options)
        whole = epoch_statistics(
            self._snapshot, now, ended - self._epoch_start, options
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
        if logs is not None:
            # Unmeasured is left out: NaN would read as a diverged loss.
            if stats["wait_ratio"] is not None:
                logs["stage_wait_ratio"] = stats["wait_ratio"]
            if stats["buffer_fill"] is not None:
                logs["stage_buffer_fill"] = stats["buffer_fill"]
            logs["stage_skipped"] = stats["skipped"]
        pool = binding.staged.thread_pool
        pool_size = None if pool is None else pool.size
        self.verdict = verdict(stats, options, pool_size=pool_size)
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
        self.verdict["call"] = binding.call_reason
        if binding.call_reason is not None and binding.epochs_begun == 1:
            self.verdict["message"] += (
                f" The call is staged: {binding.call_reason}."
            )
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
        self.verdict = {
            **dict.fromkeys(_VERDICT_FIGURES),
            "message": (
                f"Model '{self.model.name}': this fit runs the whole model in "
                f"Keras's step, without its stage: {self._unstaged_call}."
            ),
            "epoch": epoch,
            "next_thread_pool_size": None,
            "staged": False,
            "call": self._unstaged_call,
        }
        self._say(first)

    def _say(self, printed=True):
        """Prints the verdict's message with `verbose`, else logs it."""
        if self.verbose and printed:
            print(self.verdict["message"])
        else:
            logger.debug(self.verdict["message"])

    def _adapt_pool(self, pool, verdict, shrink, keep):
        """Resizes the pool from `verdict`, unless `keep` says why not."""
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
        """Why a smaller pool cannot pay for the rest of the fit, or None: it
        costs a new iterator, and saves at most the batches left times the
        least staged work per batch after the iterator's first epoch."""
        cost = (
            None if binding.iterator_cost is None else binding.iterator_cost()
        )
        prepare = self.verdict["prepare_seconds_per_batch"]
        params = self.params or {}
        epochs, steps = params.get("epochs"), params.get("steps")
        if prepare is None:
            return None
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
        """Writes the epoch's figures and the verdict's under `log_dir`."""
        if self.log_dir is None:
            return
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

    def _report_skips(self, binding, snapshot, skipped):
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


# A verdict's figures: None when not measured, or for a fit run unstaged.
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
    "thread_pool_size",
    "cpu_load",
    "cores_busy",
)


def _measured(seconds):
    """`seconds`, or None for a time the stage could not take (NaN)."""
    return None if math.isnan(seconds) else seconds


def epoch_statistics(before, after, seconds, options):
    """One epoch's statistics from two stage snapshots (None: unmeasured)."""
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
    """Gives `window` the stage's busy time per element over the `epoch`,
    most of whose elements it may have made before the window."""
    if epoch["produced"] <= 0:
        return
    window["produced"] = window["consumed"]
    if epoch["busy_seconds"] is not None:
        window["busy_seconds"] = (
            epoch["busy_seconds"] / epoch["produced"] * window["produced"]
        )


def _rates_of_batches_read_ahead(stats, epoch, binding):
    """Gives an epoch whose batches a long-lived iterator read ahead the
    stage's last measured work per batch."""
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
    """The bottleneck verdict of one epoch, by DeepRec's rules of thumb
    (`pool_size`: the epoch's resized pool). The source is not timed: an
    input-bound stage much slower than its threads was starved by it."""
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
    else:  # the input keeps up: a deeper buffer would only hold batches
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
            "(num_parallel_calls) and reads (interleave), or make that work "
            "the stage's own computation so the stage's threads run it: as "
            "layers of the model with compile(smart_stage=True), or as the "
            "`fn` of keras_stage.data.stage."
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
    """Whether the stage computed, rather than only buffered."""
    return stats["busy_seconds"] is not None and stats["busy_seconds"] > 0


def _untimed_verdict(stats, options, pool_size):
    """The verdict of an epoch not fully timed (op determinism): no advice."""
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
    if fill is None:
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
        delivery_seconds_per_batch=pace,
        prepare_seconds_per_batch=prepare,
    )


def _verdict_record(stats, pool_size, message, **figures):
    """The verdict dict: the epoch's `figures` and what every verdict has."""
    cpu_load = stats.get("cpu_load")
    return {
        **dict.fromkeys(_VERDICT_FIGURES),
        **figures,
        "wait_ratio": stats["wait_ratio"],
        "buffer_fill": stats["buffer_fill"],
        "thread_pool_size": pool_size,
        "cpu_load": cpu_load,
        # Unknown counts as busy: no growth past the usual size.
        "cores_busy": cpu_load is None or cpu_load >= _CORES_BUSY_LOAD,
        "message": message,
    }


def _log_service_epoch(binding, logs):
    """Closes a tf.data service stage's epoch; logs `stage_service_*`."""
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
