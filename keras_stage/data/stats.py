"""In-graph statistics of one stage.

`StageStats` owns the counters a stage keeps while it runs: elements
produced, consumed and skipped, seconds the consumer waited, and buffer fill
sampled at every fetch. Counters are TensorFlow variables updated by the
pipeline's own ops, so measuring costs no Python on the hot path; only
skipped elements (an error path) are counted from Python.
"""

import threading
import time

import tensorflow as tf

# How many error messages of skipped elements a stage keeps per snapshot.
MAX_SKIPPED_MESSAGES = 5


class StageStats:
    """Counters of one stage, read with `snapshot()`."""

    def __init__(self, name):
        self.name = name
        # Created outside any function or strategy scope: these belong to
        # the stage, not to a model or a replica.
        with tf.init_scope(), tf.device("/CPU:0"):
            self.produced = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="produced"
            )
            self.consumed = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="consumed"
            )
            self.wait_seconds = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="wait_seconds"
            )
            # Seconds the producers spent computing elements, summed over
            # threads: the per-element preprocessing cost.
            self.busy_seconds = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="busy_seconds"
            )
            self.buffered_sum = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="buffered_sum"
            )
            self.buffered_peak = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="buffered_peak"
            )
            # Time the consumer started waiting for the current element, 0
            # when it is not waiting: read by the timeout watchdog.
            self.waiting_since = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="waiting_since"
            )
        self._lock = threading.Lock()
        self.skipped = 0
        self.skipped_messages = []

    # -- graph side: called inside tf.data functions -------------------------

    def count_produced(self, started):
        """Counts one finished element that began computing at `started`."""
        return tf.group(
            self.produced.assign_add(1),
            self.busy_seconds.assign_add(tf.timestamp() - started),
        )

    def begin_wait(self):
        """Marks the consumer as waiting; returns (start time, buffered)."""
        now = tf.timestamp()
        buffered = tf.maximum(
            self.produced.read_value() - self.consumed.read_value(),
            tf.constant(0, tf.int64),
        )
        ops = [
            self.waiting_since.assign(now),
            self.buffered_sum.assign_add(buffered),
            self.buffered_peak.assign(
                tf.maximum(self.buffered_peak.read_value(), buffered)
            ),
        ]
        with tf.control_dependencies(ops):
            return tf.identity(now)

    def end_wait(self, started):
        now = tf.timestamp()
        return tf.group(
            self.wait_seconds.assign_add(now - started),
            self.consumed.assign_add(1),
            self.waiting_since.assign(0.0),
        )

    # -- Python side ---------------------------------------------------------

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
        since = float(self.waiting_since.numpy())
        return time.time() - since if since > 0 else 0.0

    def snapshot(self):
        """Returns the counters as a dict of Python numbers."""
        with self._lock:
            skipped = self.skipped
            messages = list(self.skipped_messages)
        return {
            "produced": int(self.produced.numpy()),
            "consumed": int(self.consumed.numpy()),
            "skipped": skipped,
            "skipped_messages": messages,
            "wait_seconds": float(self.wait_seconds.numpy()),
            "busy_seconds": float(self.busy_seconds.numpy()),
            "buffered_sum": int(self.buffered_sum.numpy()),
            "buffered_peak": int(self.buffered_peak.numpy()),
            "time": time.time(),
        }

    def clear_skipped_messages(self):
        with self._lock:
            self.skipped_messages = []
