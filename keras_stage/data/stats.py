"""In-graph statistics of one stage.

`StageStats` owns the counters a stage keeps while it runs: elements
produced, consumed and skipped, seconds the producers computed and the
consumer waited, and buffer fill sampled at every fetch. Counters are
TensorFlow variables updated by graph ops (one update per element on each
side, packed in a vector), so measuring costs no Python on the hot path;
only skipped elements (an error path) are counted in Python.

The consumer's side is recorded either by the pipeline itself (a marker and
a map around the fetch: works for any consumer) or by a consumer that owns
its step graph (the Keras integration records it inside the training step,
where a few more ops join a graph that runs anyway, while a tf.data map on
the fetch path is one more function call per batch). A step cannot see
when its call asks the pipeline for the batch, only when its previous step
ended; the time from there to a batch that was ready (returning to Python,
callbacks, dispatching the next call) is learnt as a baseline and only
what exceeds it counts as waiting (see `record_fetch`). A step that
returns a report to Python (`report`, `take_report`) leaves that
arithmetic to Python, where it costs a few float operations instead of
some 30 graph ops in every step; a step that cannot (its outputs do not
reach Python) runs it in its graph (`accumulate`). Both run the one
definition, `_fetch_figures`.

Under op determinism (`tf.config.experimental.enable_op_determinism`)
TensorFlow refuses to run `tf.timestamp`: steps built then count their
fetches without a clock, a pipeline built then holds no counter at all
(`count_nothing`), and `snapshot` reads what it could not count from
tf.data's own model of the stage's iterators (`pipeline_model`), or
reports it as NaN where that model cannot be read (see `clock_allowed`).
"""

import logging
import math
import threading
import time

import tensorflow as tf

from keras_stage.data import pipeline_model

logger = logging.getLogger("keras_stage")

# How many error messages of skipped elements a stage keeps per report.
MAX_SKIPPED_MESSAGES = 5

# Slots of the one counter vector, float64 (counts exact up to 2**53).
# One vector, so each side of the pipeline updates it with a single op:
# variable ops are the costly part of a tf.data function.
_PRODUCED, _BUSY = 0, 1
_CONSUMED, _WAIT, _BUFFERED = 2, 3, 4
# Start time of the last fetch that finished. A fetch is in progress while
# the last fetch started (a separate variable: fetches can end without
# finishing, at the end of the data or on an error) is later than this.
_DONE_FETCH = 5
# Consumers recording in their step: the usual time from a step's end to
# the arrival of a batch that was ready, and the elements produced but left
# in the buffers of iterators dropped before an epoch began.
_BASELINE, _ORPHANS = 6, 7
# Elements that entered the buffer, counted in the order the consumer gets
# them (see `count_ready`); `_PRODUCED` counts them as they finish.
_READY = 8
_SLOTS = 9
# Weight of one ready fetch in the moving baseline.
_BASELINE_WEIGHT = 0.1


def _fetch_figures(marked, took, buffered, baseline, to_float, maximum):
    """A recorded fetch's wait, and how far it moves the baseline.

    See `StageStats.record_fetch`. The same lines run on tensors in a
    step's graph (`accumulate`: `to_float` a cast, `maximum` tf.maximum)
    and on Python floats (`take_report`: `float`, `max`), so the two
    sides cannot drift apart. Arithmetic on 0/1 masks rather than
    branches: fewer ops in every step.

    Args:
        marked: The fetch's start mark (negative: an epoch's first fetch,
            whose time may include tracing the step and is not waiting).
        took: Seconds from the mark to the batch's arrival.
        buffered: Other finished elements buffered at the arrival.
        baseline: The baseline before this fetch (0: none yet).

    Returns:
        `(waited, moved)`: the seconds the fetch waited, and the change of
        the baseline.
    """
    later = to_float(marked > 0.0)
    ready = to_float(buffered > 0.0)
    beyond = took - baseline
    waited = later * (1.0 - ready) * maximum(beyond, 0.0)
    # A ready fetch moves the baseline by a fraction of its distance from
    # it; the first one sets it.
    rate = 1.0 - (1.0 - _BASELINE_WEIGHT) * to_float(baseline > 0.0)
    moved = later * ready * rate * beyond
    return waited, moved


def _slots(values):
    """A counter-vector update: `values` ({slot: value}), zeros elsewhere.

    One constant when every value is a Python number, else one stack:
    each op of a per-element or per-step function costs microseconds.
    """
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
# arrival time, the counters at the arrival and after the step; or, for a
# step that accumulated its fetches in the graph, the counters after it.
_REPORT_MARK, _REPORT_ARRIVED, _REPORT_COUNTERS = 0, 1, 2
_REPORT_SIZE = 2 + 2 * _SLOTS


# Called while tf.data and tf.function trace with AutoGraph: converting
# the logging (down to pytest's handlers) is not theirs to do.
@tf.autograph.experimental.do_not_convert
def clock_allowed():
    """Whether a graph built now may read the clock (`tf.timestamp`).

    Not under op determinism: TensorFlow's Timestamp kernel then fails
    every run with a `FailedPreconditionError`. TensorFlow exports the
    setter (`tf.config.experimental.enable_op_determinism`) but no getter
    (only the private `tensorflow.python.framework.config
    .is_op_determinism_enabled`), so this asks the kernel itself: what is
    checked is exactly what would fail, for the cost of one eager op.
    Called while a graph is traced, never at import: a user may enable
    determinism after importing keras_stage, and a graph keeps the clock
    (or its absence) it was traced with.
    """
    if op_determinism_enabled():
        _note_no_clock()
        return False
    return True


def op_determinism_enabled():
    """Whether op determinism is on now (see `clock_allowed` for how)."""
    with tf.init_scope(), tf.device("/CPU:0"):
        try:
            tf.timestamp()
        except tf.errors.FailedPreconditionError:
            return True
    return False


# The note `_note_no_clock` logs, once per process.
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
    """Counters of one stage, read with `snapshot()`.

    Args:
        name: The stage's name.
        track_peak: Also track the largest buffer fill seen (one more
            update per fetch; needed to scale the fill of `"auto"`
            buffers). Defaults to `False`.
    """

    # The length of a step's report of its fetch (see `report`).
    REPORT_SIZE = _REPORT_SIZE

    def __init__(self, name, track_peak=False):
        self.name = name
        self.track_peak = track_peak
        # Created outside any function or strategy scope: these belong to
        # the stage, not to a model or a replica.
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
            # Start mark of the last fetch a step recorded (see
            # `record_fetch`); `_DONE_FETCH` holds the pipeline's.
            self._fetch_done = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="fetch_done"
            )
            # Set when the stage is closed after a timeout: an element that
            # was abandoned blocked must not arrive late (it would train a
            # step nobody waits for).
            self._closed = tf.Variable(False, trainable=False, name="closed")
        self._lock = threading.Lock()
        # The `StagePool` of the stages counted here (set by the first one
        # built with an adaptive pool): kept with the counters, it outlives
        # one `fit` call like they do, so the next call starts with the
        # size the last epoch chose.
        self.pool = None
        self.skipped = 0
        self.skipped_messages = []
        # The consumer's side as `take_report` accumulates it in Python.
        self._reported_wait = 0.0
        self._reported_buffered = 0.0
        self._reported_peak = 0.0
        self._baseline = 0.0
        # Fetches of calls that ran without recording them (their elements
        # were known to be buffered, see `count_taken`), not yet added to
        # the consumed slot (`mark_request` adds them).
        self._taken = 0
        # Whether the graphs last traced on each side took timestamps (see
        # `clock_allowed`); None until one is traced.
        self._wait_timed = None
        self._busy_timed = None
        # Whether any graph traced on these stats holds a clock.
        self._clocked = False
        # Whether the consumer timed its fetches on the host
        # (`record_host_fetch`).
        self._host_waits = False
        # Whether the pipeline counts its elements (see `count_nothing`).
        self._pipeline_counts = True
        # tf.data's model of the watched iterators, when it does not.
        self._host_model = None

    def count_nothing(self, computes=True, maps_above=0):
        """Notes that the stage's pipeline holds no counter (op determinism).

        Under op determinism a stateful op in any function of a pipeline
        makes tf.data run the whole pipeline one element at a time with no
        buffer (see `staging._build_pipeline`), so a stage built then counts
        nothing in its pipeline: `snapshot` reports the elements it
        finished as those consumed, and reads the consumer's wait, the
        stage's busy time and its buffer's fill from tf.data's own model
        of each iterator `watch`ed (`PipelineModel`), or reports them as
        not measured (NaN) where that model cannot be read. `computes`:
        whether the stage has work of its own (a stage that computes
        nothing is known to spend no time on it). `maps_above`: the maps
        between the stage's buffer and its own (see `PipelineModel`).
        """
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
        """Reads the watched iterator's figures now (see `count_nothing`).

        A consumer calls it between steps, every
        `pipeline_model.SAMPLE_FETCHES` fetches or more often; `snapshot`
        calls it too.
        """
        if self._host_model is not None:
            self._host_model.sample()

    @property
    def samples(self):
        """Whether figures are read from the watched iterators (`sample`)."""
        return self._host_model is not None

    @property
    def pipeline_counts(self):
        """Whether the stage's pipeline counts its elements."""
        return self._pipeline_counts

    # -- graph side: called inside tf.data functions -------------------------

    def start_busy(self):
        """The start of an element's staged computation, in its map.

        A timestamp, or None when the clock is forbidden (see
        `clock_allowed`): `count_produced` then counts the element without
        its busy time, which `snapshot` reports as not measured.
        """
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
        """Counts one finished element; fails it if its pipeline was closed.

        Args:
            started: When the staged computation began on it
                (`start_busy`), or None for a stage with nothing to compute
                (no busy time, two ops fewer per element) or no clock.
            gate: The pipeline's boolean variable, False once it is closed
                (see `staging.build_stage`): an iterator a finished call
                left alive must not count its elements in stats the next
                call's iterator shares, nor deliver them late.
            ready: Whether to count it ready too (see `count_ready`): the
                stage finishes its elements in the order it delivers them.
                Defaults to `True`.
        """
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
        """Counts one element entering the buffer, in delivery order.

        For a stage whose ordered parallel map finishes elements out of
        order (`count_produced(..., ready=False)` counts them there): run
        after the map, in the order it delivers them, so a counted element
        is in the buffer or on its way there, and a fetch of it cannot
        wait on the source, however long an earlier-numbered one hangs
        (see `runner.ReadyElements`).
        """
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
        """Adds a fetch's wait and fill; with `count`, counts it done too.

        `started` and `waited` are None for a fetch timed by no clock.
        """
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
        """Records, in a step, the fetch that delivered `element`.

        The fetch began when the previous step ended (`record_step_end`);
        the time from there to the batch's arrival also holds returning to
        Python, the callbacks and the next call's dispatch. When more
        finished elements were buffered than this one, the batch was ready
        before it was asked for: it did not wait, and its time feeds a
        moving baseline of that overhead. Otherwise its wait is the time
        beyond the baseline. The first fetch of an epoch began at
        `mark_request`, which stores the time negated: the first call of
        an epoch may also trace the step, so that fetch's wait is not
        counted (its timeout still is). Fails if the stage was closed, so a
        late element never trains a step. Without a clock (see
        `clock_allowed`) the fetch is counted, with the buffer fill it saw,
        and its arrival time is None (NaN in `report`).

        Args:
            element: The fetched element; the record waits for it.
            accumulate: Whether to add the fetch's wait and buffer fill to
                the counters here. With False only the element is counted
                (and the fetch marked done), and the step returns
                `report(fetch, ...)` for `take_report` to accumulate in
                Python, or calls `accumulate` itself. Defaults to `True`.

        Returns:
            The fetch: `(mark, arrival time, counters before it)`.
        """
        leaves = tf.nest.flatten(element, expand_composites=True)
        check = self._open_check()
        timed = self._wait_clock()
        # Ops without inputs run whenever the step's graph likes: tie the
        # clock to the element's arrival.
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
        """Adds a fetch's wait and buffer fill to the counters, in the graph.

        For steps that do not hand `report` to Python (see `record_fetch`).

        Args:
            fetch: What `record_fetch` returned.
            count: Also count the element consumed and mark the fetch done
                (`record_fetch` with `accumulate=True` does). Defaults to
                `False`.
        """
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
        # Only the consumer writes the baseline: a delta keeps the update
        # one op.
        return self._record_fetch(
            counters,
            started,
            waited,
            buffered=buffered,
            extra={_BASELINE: moved},
            count=count,
        )

    def report(self, fetch, end):
        """A step's report for `take_report`: one float64 vector.

        Args:
            fetch: What `record_fetch(..., accumulate=False)` returned, or
                None for a step that accumulated its fetches itself.
            end: What `record_step_end` returned.
        """
        if fetch is None:
            return end
        marked, arrived, counters = fetch
        if arrived is None:  # no clock: `take_report` times nothing
            arrived = tf.constant(math.nan, tf.float64)
        return tf.concat([tf.stack([marked, arrived]), counters, end], 0)

    def record_step_end(self, outputs):
        """Marks, at the end of a step, that the next fetch begins.

        Args:
            outputs: The step's outputs, which the mark waits for.

        Returns:
            The counters once the step is done, for `report`: returned
            with the step's outputs, they tell the consumer's next call
            whether its batch is ready at the cost of one output instead
            of a variable read between steps (see `take_report`).
        """
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
        """Accumulates a step's `report`; returns its unconsumed count.

        The same arithmetic as `accumulate` (`_fetch_figures`), on Python
        floats.

        Args:
            values: The report's values, a sequence of floats.
            called: When the consumer's call that made the fetch began
                (`time.time()`), if the fetch was the call's first; None
                otherwise. The fetch is then timed from the call, not from
                the previous step's end: the gap between the two (Python,
                callbacks) is not waiting, and a fetch that found its
                batch ready most often followed a long gap, so a baseline
                learnt from the gaps would take real waits for overhead.

        Returns:
            The elements ready and not consumed once the step was done
            (see `unconsumed`): a floor for the next call, since ready
            elements only grow and only the consumer consumes them.
        """
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
        """Counts, in Python, a fetch that waited `seconds` for its element.

        For a consumer that reads the pipeline without the consumer's side
        of the counters (`StagedDataset.lean_pipeline`) and times on the
        host each fetch that may wait: an eager iterator, whose call does
        nothing but fetch (`StageIterator`). Its fetches known to be
        buffered are counted with `count_taken` (no wait). Consumed-count
        readers add both (see `count_taken`).
        """
        with self._lock:
            self._taken += 1
            self._reported_wait += seconds
            self._host_waits = True

    @property
    def fetches_timed(self):
        """Whether the consumer's fetches are timed in the graph.

        As the consumer's side was last traced; before any trace, as a
        graph traced now would be (see `clock_allowed`).
        """
        if self._wait_timed is None:
            return clock_allowed()
        return self._wait_timed

    @property
    def clock_refused(self):
        """Whether graphs traced on these stats hold a clock now refused.

        True once op determinism was enabled after such a graph was traced
        (a consumer's step, or a pipeline): it fails at run time with a
        `FailedPreconditionError`, and must be traced again, on new stats
        for a consumer that keeps its traced step with its stats.
        """
        return self._clocked and not clock_allowed()

    def count_taken(self, elements, buffered):
        """Counts, in Python, the fetches of a call that did not record them.

        For a consumer whose step records its fetches (`record_fetch`) and
        which runs a call without that recording when its elements were
        known to be buffered (`ReadyElements`): such fetches did not wait,
        and each saw about `buffered` other elements in the buffer (an
        estimate: the count at the last reading). Consumed-count readers
        here add them (`unconsumed`, `snapshot`, `take_report`);
        `mark_request` moves them into the counters.

        Args:
            elements: The fetches the call made.
            buffered: The buffer fill to record for each.
        """
        with self._lock:
            self._taken += elements
            self._reported_buffered += elements * buffered
            self._reported_peak = max(self._reported_peak, buffered)

    def mark_request(self, orphan=True):
        """Starts the consumer's fetch clock now (at an epoch's start).

        Elements produced and never consumed so far were left in the
        buffer of an iterator dropped before this epoch (Keras makes one
        per epoch); from now on they no longer count as buffered. With
        `orphan=False` they stay buffered: the stage runs its epochs on one
        iterator, so what it holds is this epoch's. Fetches counted in
        Python (`count_taken`) join the counters here, so the graph's own
        arithmetic (`accumulate`) sees them from now on.
        """
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
        """Elements counted ready (see `count_ready`) and not consumed, ever.

        Includes those left in the buffers of dropped iterators. One raw
        read, called between training steps: `Variable.numpy()` adds name
        scopes and an identity op to each read.
        """
        counters = tf.raw_ops.ReadVariableOp(
            resource=self._counters.handle, dtype=tf.float64
        ).numpy()
        return self._ready(counters)

    def consumed(self):
        """Fetches counted in the graph so far (one raw variable read).

        A fetch is counted when its element arrives, clock or no clock: a
        consumer's wait can be timed on the host from it (the runner's
        timeout does so under op determinism).
        """
        counters = tf.raw_ops.ReadVariableOp(
            resource=self._counters.handle, dtype=tf.float64
        ).numpy()
        return int(counters[_CONSUMED])

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
        """Seconds the consumer has been waiting for its current element.

        Args:
            since: When the consumer's current call began (`time.time()`),
                for a consumer recording in its step: a fetch marked at
                the end of its previous call waits from here on, not
                while Python ran in between. Defaults to `None`.
        """
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
        """Returns the counters as a dict of Python numbers.

        `wait_seconds` and `busy_seconds` are NaN when the graphs last
        traced could not time them (see `clock_allowed`): not measured,
        which a difference of two snapshots keeps.
        """
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
