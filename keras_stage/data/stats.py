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
where two more ops cost next to nothing, while a tf.data map on the fetch
path costs about 0.2 ms per batch here). In the second case the step marks
when it asks for the next element at its end, so the time between two
compiled calls, spent in Python, is reported by `note_call` and taken out.
"""

import threading
import time

import tensorflow as tf

# How many error messages of skipped elements a stage keeps per report.
MAX_SKIPPED_MESSAGES = 5

# Slots of the one counter vector, float64 (counts exact up to 2**53).
# One vector, so each side of the pipeline updates it with a single op:
# variable ops are the costly part of a tf.data function.
_PRODUCED, _BUSY, _SOURCE = 0, 1, 2
_CONSUMED, _WAIT, _BUFFERED = 3, 4, 5
# Start time of the last fetch that finished. A fetch is in progress while
# the last fetch started (a separate variable: fetches can end without
# finishing, at the end of the data or on an error) is later than this.
_DONE_FETCH = 6
_SLOTS = 7


def _slots(values):
    """A counter-vector update: `values` ({slot: value}), zeros elsewhere."""
    parts = [tf.constant(0.0, tf.float64)] * _SLOTS
    for slot, value in values.items():
        parts[slot] = tf.cast(value, tf.float64)
    return tf.stack(parts)


class StageStats:
    """Counters of one stage, read with `snapshot()`.

    Args:
        name: The stage's name.
        track_peak: Also track the largest buffer fill seen (one more
            update per fetch; needed to scale the fill of `"auto"`
            buffers). Defaults to `False`.
    """

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
            # Set when the stage is closed after a timeout: an element that
            # was abandoned blocked must not arrive late (it would train a
            # step nobody waits for).
            self._closed = tf.Variable(False, trainable=False, name="closed")
        self._lock = threading.Lock()
        self.skipped = 0
        self.skipped_messages = []
        # Consumer recorded in its step: Python time between its calls,
        # counted as waiting by the step's marks and taken out here.
        self._between_calls = 0.0
        self._last_call_end = None

    # -- graph side: called inside tf.data functions -------------------------

    def _open_check(self):
        # An element that was abandoned blocked must not arrive late.
        return tf.debugging.Assert(
            tf.logical_not(self._closed),
            [
                f"Stage '{self.name}' was closed after a timeout; its late "
                "element is dropped. Build a new stage to retry."
            ],
        )

    def count_produced(self, pulled, started):
        """Counts one finished element; fails it if the stage was closed.

        Args:
            pulled: When the stage began pulling it from its source.
            started: When the staged computation began on it.
        """
        check = self._open_check()
        with tf.control_dependencies([check]):
            busy = tf.timestamp() - started
        return self._counters.assign_add(
            _slots({_PRODUCED: 1, _BUSY: busy, _SOURCE: started - pulled})
        )

    def begin_wait(self):
        """Marks a fetch as begun; returns its start time."""
        now = tf.timestamp()
        with tf.control_dependencies([self._fetch_start.assign(now)]):
            return tf.identity(now)

    def end_wait(self, started, counted=True):
        """Records a finished fetch that began at `started`.

        Args:
            started: When the fetch began.
            counted: Whether its wait counts (a scalar bool tensor or
                Python bool). Defaults to `True`.
        """
        counters = self._counters.read_value()
        waited = tf.timestamp() - started
        if counted is not True:
            waited = tf.where(counted, waited, tf.zeros_like(waited))
        # Finished elements still waiting, not counting the one just taken.
        buffered = tf.maximum(
            counters[_PRODUCED] - counters[_CONSUMED] - 1.0,
            tf.constant(0.0, tf.float64),
        )
        update = self._counters.assign_add(
            _slots(
                {
                    _CONSUMED: 1,
                    _WAIT: waited,
                    _BUFFERED: buffered,
                    # Only the consumer's thread writes this slot.
                    _DONE_FETCH: started - counters[_DONE_FETCH],
                }
            )
        )
        if not self.track_peak:
            return update
        return tf.group(
            update, self._peak.assign(tf.maximum(self._peak, buffered))
        )

    # -- graph side: called inside a consumer's own step --------------------

    def record_fetch(self, element):
        """Records, in a step, the fetch that delivered `element`.

        The fetch began when the previous step ended (`record_step_end`).
        The first one of an epoch began at `mark_request`, which stores the
        time negated: the first call of an epoch may also trace the step,
        and the step cannot tell that time from waiting, so that fetch's
        wait is not counted (its timeout still is). Fails if the stage was
        closed, so a late element never trains a step.
        """
        leaves = tf.nest.flatten(element, expand_composites=True)
        with tf.control_dependencies(leaves):
            marked = self._fetch_start.read_value()
        check = self._open_check()
        # Ops without inputs run whenever the step's graph likes: tie the
        # clock to the element's arrival.
        with tf.control_dependencies(leaves + [check]):
            return self.end_wait(tf.abs(marked), counted=marked > 0.0)

    def record_step_end(self, outputs):
        """Marks, at the end of a step, that the next fetch begins."""
        leaves = tf.nest.flatten(outputs, expand_composites=True)
        with tf.control_dependencies(leaves):
            return self._fetch_start.assign(tf.timestamp())

    # -- Python side ---------------------------------------------------------

    def mark_request(self):
        """Starts the consumer's fetch clock now (at an epoch's start)."""
        self._fetch_start.assign(-time.time())  # negated: see `record_fetch`
        with self._lock:
            # The Python time before the first call (Keras makes the
            # epoch's iterator then) belongs to the first fetch, which is
            # not counted either.
            self._last_call_end = None

    def note_call(self, started, ended):
        """Reports one compiled call of a consumer recording in its step.

        Args:
            started: `time.time()` just before the call.
            ended: `time.time()` just after it returned.
        """
        with self._lock:
            if self._last_call_end is not None:
                self._between_calls += max(0.0, started - self._last_call_end)
            self._last_call_end = ended

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
        done = float(self._counters.numpy()[_DONE_FETCH])
        if started <= done:
            return 0.0
        if since is not None:
            started = max(started, since)
        return max(0.0, time.time() - started)

    def snapshot(self):
        """Returns the counters as a dict of Python numbers."""
        with self._lock:
            skipped = self.skipped
            messages = list(self.skipped_messages)
            between_calls = self._between_calls
        counters = self._counters.numpy()
        return {
            "produced": int(counters[_PRODUCED]),
            "consumed": int(counters[_CONSUMED]),
            "skipped": skipped,
            "skipped_messages": messages,
            "wait_seconds": max(0.0, float(counters[_WAIT]) - between_calls),
            "busy_seconds": float(counters[_BUSY]),
            "source_seconds": float(counters[_SOURCE]),
            "buffered_sum": int(counters[_BUFFERED]),
            "buffered_peak": int(self._peak.numpy()),
            "time": time.time(),
        }

    def clear_skipped_messages(self):
        with self._lock:
            self.skipped_messages = []
