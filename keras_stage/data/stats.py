"""In-graph statistics of one stage.

`StageStats` keeps a stage's counters in one variable vector updated by graph
ops: no Python per element. A consumer recording in its step counts as waiting
only what exceeds a baseline of ready fetches (`_fetch_figures`). Under op
determinism (no `tf.timestamp`) they come from `pipeline_model`, or are NaN.
"""

import logging
import math
import threading
import time

import tensorflow as tf

from keras_stage.data import pipeline_model

logger = logging.getLogger("keras_stage")

MAX_SKIPPED_MESSAGES = 5  # skipped elements' errors a report keeps

# Slots of the one float64 counter vector (one update op per side).
_PRODUCED, _BUSY = 0, 1
_CONSUMED, _WAIT, _BUFFERED = 2, 3, 4
_DONE_FETCH = 5  # start time of the last fetch that finished
# The usual time from a step's end to a ready batch's arrival; elements
# left in the buffers of dropped iterators.
_BASELINE, _ORPHANS = 6, 7
_READY = 8  # elements that entered the buffer, in delivery order
_SLOTS = 9
_BASELINE_WEIGHT = 0.1  # of one ready fetch in the moving baseline


def _fetch_figures(marked, took, buffered, baseline, to_float, maximum):
    """`(waited, moved)`: a recorded fetch's wait, and the baseline's change.

    `marked` is the fetch's start mark (negative: an epoch's first fetch,
    whose time may include tracing the step and is not waiting), `took` the
    seconds to the arrival, `buffered` the other elements buffered then,
    `baseline` the one before (0: none yet). Runs on tensors (`accumulate`)
    and floats (`take_report`): 0/1 masks, not branches, keep graphs small.
    """
    later = to_float(marked > 0.0)
    ready = to_float(buffered > 0.0)
    beyond = took - baseline
    waited = later * (1.0 - ready) * maximum(beyond, 0.0)
    # A ready fetch moves the baseline part of the way; the first sets it.
    rate = 1.0 - (1.0 - _BASELINE_WEIGHT) * to_float(baseline > 0.0)
    moved = later * ready * rate * beyond
    return waited, moved


def _slots(values):
    """A counter-vector update: `values` ({slot: value}), zeros elsewhere."""
    if all(isinstance(v, (int, float)) for v in values.values()):
        return tf.constant(
            [float(values.get(slot, 0.0)) for slot in range(_SLOTS)],
            tf.float64,
        )
    return tf.stack([_float64(values.get(s, 0.0)) for s in range(_SLOTS)])


def _float64(value):
    if isinstance(value, (int, float)):
        return tf.constant(float(value), tf.float64)
    return tf.cast(value, tf.float64)


# The counter vector's dot product with this is the number of finished
# elements not yet consumed (dropped iterators' leftovers aside).
_UNCONSUMED = [0.0] * _SLOTS
_UNCONSUMED[_PRODUCED] = 1.0
_UNCONSUMED[_CONSUMED] = _UNCONSUMED[_ORPHANS] = -1.0

# A step's report (see `StageStats.report`): the fetch's start mark, its
# arrival time, the counters at the arrival and after the step.
_REPORT_MARK, _REPORT_ARRIVED, _REPORT_COUNTERS = 0, 1, 2
_REPORT_SIZE = 2 + 2 * _SLOTS


# Called while tracing: AutoGraph is not to convert the logging.
@tf.autograph.experimental.do_not_convert
def clock_allowed():
    """Whether a graph built now may read the clock (no op determinism)."""
    if op_determinism_enabled():
        _note_no_clock()
        return False
    return True


def op_determinism_enabled():
    """Whether op determinism is on now (asks the Timestamp kernel)."""
    with tf.init_scope(), tf.device("/CPU:0"):
        try:
            tf.timestamp()
        except tf.errors.FailedPreconditionError:
            return True
    return False


NO_CLOCK_NOTE = (
    "Op determinism is on: TensorFlow forbids in-graph clocks then, so "
    "keras_stage reads its stages' waits, buffer fill and staged work from "
    "tf.data's own model of their iterators, sampled between steps. The "
    "stages still run in parallel: their pipelines hold no counter."
    if pipeline_model.AVAILABLE
    else "Op determinism is on: TensorFlow forbids in-graph clocks then, "
    "and this TensorFlow cannot read tf.data's model of an iterator "
    "(tf.data.experimental.get_model_proto, TensorFlow 2.17+), so "
    "keras_stage counts batches but does not time its stages or count "
    "their buffers (no stage_wait_ratio in the logs). The stages still run "
    "in parallel: their pipelines hold no counter."
)
_no_clock_noted = False
_no_clock_lock = threading.Lock()


def _note_no_clock():
    global _no_clock_noted
    with _no_clock_lock:
        if _no_clock_noted:
            return
        _no_clock_noted = True
    logger.warning(NO_CLOCK_NOTE)


class StageStats:
    """Counters of one stage, read with `snapshot()`; `track_peak` also tracks
    the largest fill (one more update per fetch) for `"auto"` buffers."""

    REPORT_SIZE = _REPORT_SIZE  # the length of a step's `report`

    def __init__(self, name, track_peak=False):
        self.name = name
        self.track_peak = track_peak
        # Outside any function or strategy scope: they belong to the stage.
        with tf.init_scope(), tf.device("/CPU:0"):
            self._counters = tf.Variable(
                tf.zeros([_SLOTS], tf.float64), trainable=False, name="counters"
            )
            self._fetch_start = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="fetch_start"
            )
            self._peak = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="peak"
            )
            # The last fetch a step recorded; `_DONE_FETCH`: the pipeline's.
            self._fetch_done = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="fetch_done"
            )
            # Set on a close after a timeout.
            self._closed = tf.Variable(False, trainable=False, name="closed")
        self._lock = threading.Lock()
        self.pool = None  # the adaptive `StagePool` of the stages counted
        self.skipped = 0
        self.skipped_messages = []
        # The consumer's side as `take_report` accumulates it in Python.
        self._reported_wait = 0.0
        self._reported_buffered = 0.0
        self._reported_peak = 0.0
        self._baseline = 0.0
        self._taken = 0  # see `count_taken`
        # Whether the graphs last traced on each side took timestamps.
        self._wait_timed = None
        self._busy_timed = None
        self._clocked = False  # whether any graph traced holds a clock
        self._host_waits = False  # see `record_host_fetch`
        self._pipeline_counts = True  # see `count_nothing`
        self._host_model = None

    def count_nothing(self, computes=True, maps_above=0):
        """Notes that the pipeline holds no counter (op determinism): `snapshot`
        reads tf.data's model of each iterator `watch`ed instead. `computes`:
        the stage has work of its own; `maps_above`: see `PipelineModel`."""
        self._pipeline_counts = False
        if computes:
            self._busy_timed = False
        if self._host_model is None:
            self._host_model = pipeline_model.PipelineModel(
                maps_above=maps_above if computes else None
            )

    def watch(self, iterator):
        """Reads `iterator`'s figures from now on (see `count_nothing`)."""
        if self._host_model is not None:
            self._host_model.watch(iterator)

    def sample(self):
        """Reads the watched iterator's figures now (see `count_nothing`)."""
        if self._host_model is not None:
            self._host_model.sample()

    @property
    def samples(self):
        """Whether figures are read from the watched iterators (`sample`)."""
        return self._host_model is not None

    @property
    def pipeline_counts(self):
        return self._pipeline_counts

    # -- graph side: called inside tf.data functions -------------------------

    def start_busy(self):
        """The start time of an element's staged work, or None (no clock)."""
        self._busy_timed = clock_allowed()
        if not self._busy_timed:
            return None
        self._clocked = True
        return tf.timestamp()

    def _open_check(self):
        # An element that was abandoned blocked must not arrive late.
        return tf.debugging.Assert(
            tf.logical_not(self._closed),
            [
                f"Stage '{self.name}' was closed after a timeout; its late "
                "element is dropped. Build a new stage to retry."
            ],
        )

    def count_produced(self, started, gate, ready=True):
        """Counts one finished element; fails it once `gate` (the pipeline's
        open flag) is False. `started`: `start_busy`'s time; `ready`: also
        count it ready (a stage finishing elements in delivery order)."""
        check = tf.debugging.Assert(
            gate,
            [
                f"Stage '{self.name}' was closed (its call ended or it timed "
                "out); its late element is dropped. Build a new stage to "
                "retry."
            ],
        )
        values = {_PRODUCED: 1}
        if ready:
            values[_READY] = 1
        with tf.control_dependencies([check]):
            if started is not None:
                values[_BUSY] = tf.timestamp() - started
            return self._counters.assign_add(_slots(values))

    def count_ready(self):
        """Counts one element entering the buffer, in delivery order."""
        return self._counters.assign_add(_slots({_READY: 1}))

    def _wait_clock(self):
        """Whether the consumer's side being traced may take timestamps."""
        self._wait_timed = clock_allowed()
        self._clocked = self._clocked or self._wait_timed
        return self._wait_timed

    def begin_wait(self):
        """Marks a fetch as begun; returns its start time (NaN: no clock)."""
        if not self._wait_clock():
            return tf.constant(math.nan, tf.float64)
        now = tf.timestamp()
        with tf.control_dependencies([self._fetch_start.assign(now)]):
            return tf.identity(now)

    def end_wait(self, started):
        """Records a finished fetch that began at `started`."""
        counters = self._counters.read_value()
        if not self._wait_clock():
            return self._record_fetch(counters, None, None)
        waited = tf.timestamp() - started
        return self._record_fetch(counters, started, waited)

    def _buffered(self, counters):
        # Finished elements still waiting, not counting the one just taken.
        unconsumed = tf.reduce_sum(
            counters * tf.constant(_UNCONSUMED, tf.float64)
        )
        return tf.maximum(unconsumed - 1.0, tf.constant(0.0, tf.float64))

    def _record_fetch(
        self, counters, started, waited, buffered=None, extra=None, count=True
    ):
        """Adds a fetch's wait and fill and, with `count`, counts it done
        (`started` and `waited` are None for a fetch no clock timed)."""
        if buffered is None:
            buffered = self._buffered(counters)
        values = {_BUFFERED: buffered}
        if waited is not None:
            values[_WAIT] = waited
        if count:
            values[_CONSUMED] = 1
            if started is not None:
                # Only the consumer's thread writes this slot.
                values[_DONE_FETCH] = started - counters[_DONE_FETCH]
        values.update(extra or {})
        update = self._counters.assign_add(_slots(values))
        if not self.track_peak:
            return update
        return tf.group(
            update, self._peak.assign(tf.maximum(self._peak, buffered))
        )

    # -- graph side: called inside a consumer's own step --------------------

    def record_fetch(self, element, accumulate=True):
        """Records, in a step, the fetch that delivered `element` (begun as
        the previous step ended; an epoch's first, marked negative by
        `mark_request`, is not counted); fails once closed. Returns `(mark,
        arrival time, counters before it)`. `accumulate`: add its wait and
        fill here; with False only the element is counted (see `report`)."""
        leaves = tf.nest.flatten(element, expand_composites=True)
        check = self._open_check()
        timed = self._wait_clock()
        # Tie the clock to the element's arrival.
        with tf.control_dependencies(leaves + [check]):
            marked = self._fetch_start.read_value()
            counters = self._counters.read_value()
            arrived = tf.timestamp() if timed else None
        fetch = (marked, arrived, counters)
        if accumulate:
            self.accumulate(fetch, count=True)
            return fetch
        with tf.control_dependencies([counters]):
            self._counters.assign_add(_slots({_CONSUMED: 1}))
        self._fetch_done.assign(tf.abs(marked))
        return fetch

    def accumulate(self, fetch, count=False):
        """Adds the wait and fill of `fetch` (from `record_fetch`) in the
        graph; `count`: also count it consumed and mark it done."""
        marked, arrived, counters = fetch
        if arrived is None:  # no clock: the fill only
            return self._record_fetch(counters, None, None, count=count)
        started = tf.abs(marked)
        buffered = self._buffered(counters)
        waited, moved = _fetch_figures(
            marked,
            arrived - started,
            buffered,
            counters[_BASELINE],
            lambda mask: tf.cast(mask, tf.float64),
            tf.maximum,
        )
        # Only the consumer writes the baseline: a delta is one op.
        return self._record_fetch(
            counters,
            started,
            waited,
            buffered=buffered,
            extra={_BASELINE: moved},
            count=count,
        )

    def report(self, fetch, end):
        """A step's float64 report for `take_report`, from `record_step_end`
        and `record_fetch(..., accumulate=False)` (or None)."""
        if fetch is None:
            return end
        marked, arrived, counters = fetch
        if arrived is None:  # no clock: `take_report` times nothing
            arrived = tf.constant(math.nan, tf.float64)
        return tf.concat([tf.stack([marked, arrived]), counters, end], 0)

    def record_step_end(self, outputs):
        """Marks, once the step's `outputs` are done, that the next fetch
        begins; returns the counters then, for `report`."""
        leaves = tf.nest.flatten(outputs, expand_composites=True)
        if not self._wait_clock():
            with tf.control_dependencies(leaves):
                return self._counters.read_value()
        with tf.control_dependencies(leaves):
            mark = self._fetch_start.assign(tf.timestamp())
        with tf.control_dependencies([mark]):
            return self._counters.read_value()

    # -- Python side ---------------------------------------------------------

    def take_report(self, values, called=None):
        """Accumulates a step's `report` as `accumulate` does, in Python;
        `called`: the call's start (`time.time()`) if the fetch was its
        first. Returns the elements ready and not consumed after the step."""
        if len(values) == _REPORT_SIZE:
            self._take_fetch(values, called)
        return self._ready(values[-_SLOTS:])

    def _take_fetch(self, values, called):
        marked = values[_REPORT_MARK]
        counters = values[_REPORT_COUNTERS : _REPORT_COUNTERS + _SLOTS]
        began = abs(marked) if called is None else max(abs(marked), called)
        took = values[_REPORT_ARRIVED] - began
        with self._lock:
            unconsumed = self._unconsumed(counters) - counters[_ORPHANS]
            buffered = max(unconsumed - 1.0, 0.0)
            # A step traced without a clock reports its arrival as NaN.
            if not math.isnan(took):
                waited, moved = _fetch_figures(
                    marked, took, buffered, self._baseline, float, max
                )
                self._reported_wait += waited
                self._baseline += moved
            self._reported_buffered += buffered
            self._reported_peak = max(self._reported_peak, buffered)

    def record_host_fetch(self, seconds):
        """Counts a fetch an eager iterator timed on the host."""
        with self._lock:
            self._taken += 1
            self._reported_wait += seconds
            self._host_waits = True

    @property
    def fetches_timed(self):
        """Whether the consumer's fetches are timed in the graph (as last
        traced, or as a graph traced now would be)."""
        if self._wait_timed is None:
            return clock_allowed()
        return self._wait_timed

    @property
    def clock_refused(self):
        """Whether graphs traced on these stats hold a clock now refused
        (op determinism enabled since): they must be traced again."""
        return self._clocked and not clock_allowed()

    def count_taken(self, elements, buffered):
        """Counts in Python the fetches a call did not record (buffered, so
        they did not wait); `buffered`: the fill to record for each."""
        with self._lock:
            self._taken += elements
            self._reported_buffered += elements * buffered
            self._reported_peak = max(self._reported_peak, buffered)

    def mark_request(self, orphan=True):
        """Starts the consumer's fetch clock (an epoch's start); elements not
        consumed so far were left in a dropped iterator's buffer, unless
        `orphan=False` (one iterator runs the epochs)."""
        self._fetch_start.assign(-time.time())  # negated: see `record_fetch`
        with self._lock:  # `snapshot` reads both sides at once
            taken, self._taken = self._taken, 0
            counters = self._counters.numpy()
            update = {_CONSUMED: taken}
            if orphan:
                consumed = counters[_CONSUMED] + taken
                left = max(0.0, counters[_PRODUCED] - consumed)
                update[_ORPHANS] = left - counters[_ORPHANS]
            self._counters.assign_add(_slots(update))

    def unconsumed(self):
        """Elements counted ready (see `count_ready`) and not consumed, ever."""
        return self._ready(self._read())

    def consumed(self):
        """Fetches counted in the graph so far, clock or no clock."""
        return int(self._read()[_CONSUMED])

    def _read(self):
        # A raw read: `Variable.numpy()` adds ops between training steps.
        return tf.raw_ops.ReadVariableOp(
            resource=self._counters.handle, dtype=tf.float64
        ).numpy()

    def _unconsumed(self, counters):
        # The counters lack the fetches counted in Python (`count_taken`).
        return int(counters[_PRODUCED] - counters[_CONSUMED]) - self._taken

    def _ready(self, counters):
        if not self._pipeline_counts:
            return 0  # nothing is known to be buffered
        return int(counters[_READY] - counters[_CONSUMED]) - self._taken

    @property
    def closed(self):
        return bool(self._closed.numpy())

    def close(self):
        """Makes any element still in flight fail instead of arriving."""
        self._closed.assign(True)

    def record_skip(self, error):
        with self._lock:
            self.skipped += 1
            if len(self.skipped_messages) < MAX_SKIPPED_MESSAGES:
                message = getattr(error, "message", None) or str(error)
                self.skipped_messages.append(
                    f"{type(error).__name__}: {message.strip()}"
                )

    def seconds_waiting(self, since=None):
        """Seconds the consumer has been waiting for its current element
        (`since`: its call's start, for a consumer recording in its step)."""
        started = abs(float(self._fetch_start.numpy()))
        done = max(
            float(self._counters.numpy()[_DONE_FETCH]),
            float(self._fetch_done.numpy()),
        )
        if started <= done:
            return 0.0
        if since is not None:
            started = max(started, since)
        return max(0.0, time.time() - started)

    def snapshot(self):
        """The counters, as Python numbers (NaN: a time no clock took)."""
        model = self._host_model
        if model is not None:
            model.sample(boundary=True)
            measures = model.measures
        with self._lock:
            skipped = self.skipped
            messages = list(self.skipped_messages)
            wait = self._reported_wait
            buffered = self._reported_buffered
            peak = self._reported_peak
            taken = self._taken
            counters = self._counters.numpy()
            wait_timed = self._wait_timed is not False or self._host_waits
        busy_timed = self._busy_timed is not False
        consumed = int(counters[_CONSUMED]) + taken
        counts = self._pipeline_counts
        wait = float(counters[_WAIT]) + wait if wait_timed else math.nan
        busy = float(counters[_BUSY]) if busy_timed else math.nan
        buffered_sum = (
            int(counters[_BUFFERED] + buffered) if counts else math.nan
        )
        peak = int(max(self._peak.numpy(), peak)) if counts else 0
        if model is not None and measures:
            # Counted nothing in the graph: tf.data's model measured them.
            if not wait_timed:
                wait = model.wait_seconds
            if not busy_timed:
                busy = model.busy_seconds
            buffered_sum, peak = model.buffered_sum, model.buffered_peak
        return {
            # Uncounted: at least every consumed element was finished.
            "produced": int(counters[_PRODUCED]) if counts else consumed,
            "consumed": consumed,
            "skipped": skipped,
            "skipped_messages": messages,
            "wait_seconds": wait,
            "busy_seconds": busy,
            "buffered_sum": buffered_sum,
            "buffered_peak": peak,
            "time": time.time(),
        }

    def clear_skipped_messages(self):
        with self._lock:
            self.skipped_messages = []
