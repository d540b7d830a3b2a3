"""In-graph statistics of one stage.

`StageStats` owns the counters a stage keeps while it runs: elements
produced, consumed and skipped, seconds the producers computed and the
consumer waited, and buffer fill sampled at every fetch. Counters are
TensorFlow variables updated by the pipeline's own ops (one update per
element on each side, packed in a vector), so measuring costs no Python on
the hot path; only skipped elements (an error path) are counted in Python.
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

    # -- graph side: called inside tf.data functions -------------------------

    def count_produced(self, pulled, started):
        """Counts one finished element; fails it if the stage was closed.

        Args:
            pulled: When the stage began pulling it from its source.
            started: When the staged computation began on it.
        """
        check = tf.debugging.Assert(
            tf.logical_not(self._closed),
            [
                f"Stage '{self.name}' was closed after a timeout; its late "
                "element is dropped. Build a new stage to retry."
            ],
        )
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

    def end_wait(self, started):
        """Records a finished fetch that began at `started`."""
        counters = self._counters.read_value()
        # Finished elements still waiting, not counting the one just taken.
        buffered = tf.maximum(
            counters[_PRODUCED] - counters[_CONSUMED] - 1.0,
            tf.constant(0.0, tf.float64),
        )
        update = self._counters.assign_add(
            _slots(
                {
                    _CONSUMED: 1,
                    _WAIT: tf.timestamp() - started,
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

    # -- Python side ---------------------------------------------------------

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

    def seconds_waiting(self):
        """Seconds the consumer has been waiting for its current element."""
        started = float(self._fetch_start.numpy())
        done = float(self._counters.numpy()[_DONE_FETCH])
        return time.time() - started if started > done else 0.0

    def snapshot(self):
        """Returns the counters as a dict of Python numbers."""
        with self._lock:
            skipped = self.skipped
            messages = list(self.skipped_messages)
        counters = self._counters.numpy()
        return {
            "produced": int(counters[_PRODUCED]),
            "consumed": int(counters[_CONSUMED]),
            "skipped": skipped,
            "skipped_messages": messages,
            "wait_seconds": float(counters[_WAIT]),
            "busy_seconds": float(counters[_BUSY]),
            "source_seconds": float(counters[_SOURCE]),
            "buffered_sum": int(counters[_BUFFERED]),
            "buffered_peak": int(self._peak.numpy()),
            "time": time.time(),
        }

    def clear_skipped_messages(self):
        with self._lock:
            self.skipped_messages = []
