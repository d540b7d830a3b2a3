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

# Slots of the producer vector and of the consumer vector. Counts are kept
# in float64, exact up to 2**53 elements.
_PRODUCED, _BUSY, _SOURCE = 0, 1, 2
_CONSUMED, _WAIT, _BUFFERED = 0, 1, 2


def _vector(size, name):
    return tf.Variable(tf.zeros([size], tf.float64), trainable=False, name=name)


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
            # produced, busy s, source s
            self._producer = _vector(3, "producer")
            self._consumer = _vector(3, "consumer")  # consumed, wait s, fill
            # (time the current fetch began, elements consumed before it):
            # the fetch is still waiting while the consumed count has not
            # moved past it. Read by the timeout watchdog.
            self._fetch = _vector(2, "fetch")
            self._peak = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="peak"
            )
            # Set when the stage is closed after a timeout: a fetch that was
            # abandoned blocked must not deliver its element late (it would
            # train a step nobody waits for).
            self._closed = tf.Variable(False, trainable=False, name="closed")
        self._lock = threading.Lock()
        self.skipped = 0
        self.skipped_messages = []

    # -- graph side: called inside tf.data functions -------------------------

    def count_produced(self, pulled, started):
        """Counts one finished element.

        Args:
            pulled: When the stage began pulling it from its source.
            started: When the staged computation began on it.
        """
        busy = tf.timestamp() - started
        return self._producer.assign_add(
            tf.stack([tf.constant(1.0, tf.float64), busy, started - pulled])
        )

    def begin_wait(self):
        """Marks a fetch as begun; returns (start time, elements buffered)."""
        now = tf.timestamp()
        consumed = self._consumer[_CONSUMED]
        buffered = tf.maximum(
            self._producer[_PRODUCED] - consumed,
            tf.constant(0.0, tf.float64),
        )
        ops = [self._fetch.assign(tf.stack([now, consumed]))]
        if self.track_peak:
            ops.append(self._peak.assign(tf.maximum(self._peak, buffered)))
        with tf.control_dependencies(ops):
            return tf.identity(now), tf.identity(buffered)

    def end_wait(self, started, buffered):
        check = tf.debugging.Assert(
            tf.logical_not(self._closed),
            [
                f"Stage '{self.name}' was closed after a timeout; its late "
                "element is dropped. Build a new stage to retry."
            ],
        )
        with tf.control_dependencies([check]):
            waited = tf.timestamp() - started
        return self._consumer.assign_add(
            tf.stack([tf.constant(1.0, tf.float64), waited, buffered])
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
        started, consumed_before = self._fetch.numpy()
        if started <= 0 or self._consumer.numpy()[_CONSUMED] > consumed_before:
            return 0.0
        return time.time() - started

    def snapshot(self):
        """Returns the counters as a dict of Python numbers."""
        with self._lock:
            skipped = self.skipped
            messages = list(self.skipped_messages)
        produced, busy, source = self._producer.numpy()
        consumed, wait, buffered = self._consumer.numpy()
        return {
            "produced": int(produced),
            "consumed": int(consumed),
            "skipped": skipped,
            "skipped_messages": messages,
            "wait_seconds": float(wait),
            "busy_seconds": float(busy),
            "source_seconds": float(source),
            "buffered_sum": int(buffered),
            "buffered_peak": int(self._peak.numpy()),
            "time": time.time(),
        }

    def clear_skipped_messages(self):
        with self._lock:
            self.skipped_messages = []
