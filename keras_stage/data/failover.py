"""Ending a tf.data service epoch whose worker was lost, and its ledger.

A service epoch whose worker died never ends, so once the consumer waited
`worker_timeout` in an epoch that has delivered, a branch beside the reads
delivers an end marker the runner reads as the end of the data. The ledger
reports what each epoch lost or repeated against one pass of the source.
"""

import logging
import threading
import weakref

import tensorflow as tf

from keras_stage.data.stats import op_determinism_enabled

logger = logging.getLogger("keras_stage")

__all__ = ["ServiceLedger"]

_POLL_SECONDS = 0.2  # how long a poll of the end request blocks
# Arrived from the service, copies started and ended, rows delivered.
_ARRIVED, _COPIES, _DELIVERED, _ENDED = range(4)
_SLOTS = 4
# What the end branch says: nothing yet, the reads ended, end the epoch.
_NOTHING, _FINISHED, _END, _STOP = 0, 1, 2, 3
_DATA = _NOTHING
# Seconds a consumer waits in an epoch that has all its elements (see
# `_complete`) before the stage ends it: the service's end can come late.
_COMPLETE_WAIT = 5.0
# Tokens of ended iterators kept (those dropped mid-epoch never finish).
_MAX_TOKENS = 64
# Text of the end marker's error (an InvalidArgumentError from its fetch).
_END_MARK = "keras_stage: the service epoch was ended by fail-over"


class ServiceLedger:
    """The fail-over and per-epoch counts of one stage on the tf.data service
    (`per_copy`: the examples, or elements, of one pass over the source, or
    None; `batched`: elements are batches whose rows are counted)."""

    def __init__(
        self, name, processing_mode, worker_timeout, per_copy, batched
    ):
        self.name = name
        self.processing_mode = processing_mode
        self.worker_timeout = worker_timeout
        self.per_copy = per_copy
        self.batched = batched
        with tf.init_scope(), tf.device("/CPU:0"):
            self._counts = tf.Variable(
                tf.zeros([_SLOTS], tf.int64),
                trainable=False,
                name=f"{name}_ledger",
            )
        self._end = threading.Event()
        self._ended = False  # the end marker reached the consumer
        self._settled = [0] * _SLOTS
        # Per iterator token: its reads ended; its arrivals at its start.
        self._finished = {}
        self._started = {}
        self._tokens = 0
        self._lock = threading.Lock()
        self._ordered = False  # op determinism: no end branch
        self._warned_ordered = False
        self._iterator = None  # weak reference to the one being read
        self._arrived_before = 0  # arrivals when it was first read
        self.epochs = []  # one report per epoch settled
        self._unreported = None  # see `end_of_data`

    @property
    def parallel(self):
        return self.processing_mode == "parallel_epochs"

    def worker_side(self, dataset):
        """`dataset` numbered on each worker, `(element, position)`, in
        `"parallel_epochs"`: a stream's first position marks a copy."""
        if not self.parallel:
            return dataset

        def number(position, element):
            # `scan` passes the element as one argument, a tuple as is.
            return position + 1, (element, position)

        numbered = dataset.scan(tf.constant(0, tf.int64), number)
        # Each worker's stream ends with a mark (position -1).
        spec = numbered.element_spec[0]
        if not _placeable(spec):
            return numbered
        end = tf.data.Dataset.from_tensors(0).map(
            lambda _: (
                tf.nest.map_structure(_placeholder, spec),
                tf.constant(-1, tf.int64),
            )
        )
        return numbered.concatenate(end)

    def client_side(self, dataset):
        """The service's stream counted, unnumbered, beside the end branch."""
        parallel = self.parallel
        unpacked = type(dataset.element_spec) is tuple
        batched = self.batched

        def arrive(*args):
            ended = tf.constant(0, tf.int64)
            if parallel:
                element, position = args
                copies = tf.cast(tf.equal(position, 0), tf.int64)
                ended = tf.cast(tf.equal(position, -1), tf.int64)
            else:
                element = args if unpacked else args[0]
                copies = tf.constant(0, tf.int64)
            update = self._counts.assign_add(
                tf.stack([1 - ended, copies, 0, ended])
            )
            with tf.control_dependencies([update]):
                element = tf.nest.map_structure(tf.identity, element)
            # A stream's end mark goes no further (`_FINISHED` is dropped).
            state = tf.where(ended > 0, _FINISHED, _DATA)
            return tf.cast(state, tf.int64), element

        served = dataset.map(arrive, name=f"{self.name}_arrive")
        spec = served.element_spec[1]
        if self.worker_timeout is not None and not _placeable(spec):
            # The end marker needs a placeholder element; composites have none.
            logger.warning(
                "Stage '%s': its elements hold composite tensors (ragged or "
                "sparse) or tensors of unknown rank, so an epoch whose "
                "service worker is lost cannot be ended by fail-over; the "
                "stage's `timeout` applies.",
                self.name,
            )
            self.worker_timeout = None
        if self.worker_timeout is None:  # counted only
            served = served.filter(lambda state, _: state != _FINISHED)
            return served.map(lambda _, element: element)
        new_token, poll, finish = self._new_token, self._poll, self._finish

        def epoch(token):
            # The service's reads (which may block for good) beside the end
            # branch, which they end as they end (`_finish`).
            def marked(_):
                state = tf.py_function(finish, [token], tf.int64)
                return state, tf.nest.map_structure(_placeholder, spec)

            reads = served
            if not parallel and self.per_copy is not None:
                reads = _until_complete(reads, self.per_copy, spec, batched)
            reads = reads.concatenate(
                tf.data.Dataset.from_tensors(0).map(marked)
            )

            def polled(_):
                state = tf.py_function(poll, [token], tf.int64)
                return state, tf.nest.map_structure(_placeholder, spec)

            ends = tf.data.Dataset.from_tensors(0).repeat().map(polled)
            ends = ends.take_while(lambda state, _: state != _FINISHED)
            ends = ends.filter(lambda state, _: state == _END)
            branches = tf.data.Dataset.from_tensors(reads).concatenate(
                tf.data.Dataset.from_tensors(ends)
            )
            return branches.interleave(
                lambda branch: branch,
                cycle_length=2,
                num_parallel_calls=2,
                deterministic=False,
            )

        # A token per iterator, so the end branch of each knows its reads.
        tokens = tf.data.Dataset.from_tensors(0).map(
            lambda _: tf.py_function(new_token, [], tf.int64)
        )
        merged = tokens.flat_map(epoch)
        merged = merged.filter(lambda state, _: state != _FINISHED)

        def fail_at_end(state, element):
            check = tf.debugging.Assert(
                tf.not_equal(state, _END), [f"{_END_MARK} ('{self.name}')"]
            )
            with tf.control_dependencies([check]):
                return tf.nest.map_structure(tf.identity, element)

        return merged.map(fail_at_end, name=f"{self.name}_end")

    def delivered(self, dataset):
        """`dataset` (the service's elements, as delivered) counted."""
        batched = self.batched
        unpacked = type(dataset.element_spec) is tuple

        def count(*args):
            element = args if unpacked else args[0]
            rows = _rows(element, batched)
            update = self._counts.assign_add(tf.stack([0, 0, rows, 0]))
            with tf.control_dependencies([update]):
                return tf.nest.map_structure(tf.identity, element)

        return dataset.map(count, name=f"{self.name}_delivered")

    def _new_token(self):
        # Runs when an iterator starts (an epoch's first fetch).
        ordered = op_determinism_enabled()
        with self._lock:
            self._tokens += 1
            token = self._tokens
            for old in [t for t in self._finished if t <= token - _MAX_TOKENS]:
                del self._finished[old]
                self._started.pop(old, None)
            self._finished[token] = threading.Event()
            self._started[token] = self._read()
            if ordered:
                # Op determinism alternates branches: end the end branch now.
                self._finished[token].set()
        if ordered and not self._warned_ordered:
            self._warned_ordered = True
            logger.warning(
                "Stage '%s': op determinism is enabled, under which tf.data "
                "reads interleaved branches in turn, so the stage cannot end "
                "an epoch whose tf.data service worker died (its `timeout` "
                "applies). Later epochs still end once they hold every "
                "element (distributed_epoch, known size).",
                self.name,
            )
        self._ordered = ordered
        return token

    def _finish(self, token):
        with self._lock:
            event = self._finished.get(int(token))
        if event is not None:
            event.set()
        return _FINISHED

    def _poll(self, token):
        # Blocks a little, so the end branch costs few Python calls.
        with self._lock:
            event = self._finished.get(int(token))
        if event is None or event.wait(_POLL_SECONDS):
            return _FINISHED
        return _END if self._end.is_set() else _NOTHING

    def _complete(self):
        """Whether each stream started in the parallel epoch read has ended."""
        if not self.parallel:
            return False
        with self._lock:
            started = self._started.get(self._tokens)
        if started is None:
            return False
        now = self._read()
        copies = now[_COPIES] - started[_COPIES]
        return copies > 0 and now[_ENDED] - started[_ENDED] >= copies

    @property
    def streams_started(self):
        """Worker streams started in the epoch read (None unless parallel)."""
        if not self.parallel:
            return None
        return self._read()[_COPIES] - self._settled[_COPIES]

    def _read(self):
        counts = tf.raw_ops.ReadVariableOp(
            resource=self._counts.handle, dtype=tf.int64
        )
        return [int(v) for v in counts.numpy()]

    def note_call(self, iterator):
        """Notes the iterator a consumer's call reads (an epoch's)."""
        if self._iterator is not None and self._iterator() is iterator:
            return
        try:
            self._iterator = weakref.ref(iterator)
        except TypeError:
            self._iterator = None
        self._arrived_before = self._read()[_ARRIVED]

    def should_end(self, waited):
        """Whether a consumer that waited `waited` s ends its epoch now
        (only one that has delivered: a job's first element may be slow)."""
        if self.worker_timeout is None or self._end.is_set() or self._ordered:
            return False
        if waited >= min(_COMPLETE_WAIT, self.worker_timeout) and (
            self._complete()
        ):
            return True
        if waited < self.worker_timeout:
            return False
        return self._read()[_ARRIVED] > self._arrived_before

    def request_end(self, waited):
        """Asks the pipeline to end the epoch (the end branch delivers)."""
        if self._complete():
            # Nothing is missing: no warning (`settle` reports the epoch).
            self._end.set()
            return
        logger.warning(
            "Stage '%s': no element from the tf.data service for %.1f s "
            "(worker_timeout=%g s) in an epoch that had delivered: a worker "
            "was lost, or its elements take longer than worker_timeout. "
            "Ending this epoch with what arrived; the next epoch is a new "
            "job on the workers still alive. Raise `worker_timeout` if "
            "elements legitimately take this long.",
            self.name,
            waited,
            self.worker_timeout,
        )
        self._end.set()

    def is_end(self, error):
        """Whether `error` is the end marker's (the epoch was ended)."""
        message = getattr(error, "message", None) or str(error)
        if _END_MARK not in message:
            return False
        self._ended = True
        self._end.clear()  # the next epoch's pipeline must not see it
        return True

    def settle(self):
        """Closes an epoch's count; returns its report (also in `epochs`):
        `delivered`, `copies` (`"parallel_epochs"`), `expected`, `lost` and
        `repeated` (None for a source of unknown size), `ended_early`
        (fail-over ended it). A loss or a repeat is logged as a warning."""
        now = self._read()
        delivered = now[_DELIVERED] - self._settled[_DELIVERED]
        copies = now[_COPIES] - self._settled[_COPIES]
        self._settled = now
        expected = lost = repeated = None
        if self.per_copy is not None:
            expected = self.per_copy * (copies if self.parallel else 1)
            lost = max(expected - delivered, 0)
            repeated = max(delivered - expected, 0)
        report = {
            "epoch": len(self.epochs),
            "processing_mode": self.processing_mode,
            "delivered": delivered,
            "copies": copies if self.parallel else None,
            "expected": expected,
            "lost": lost,
            "repeated": repeated,
            "ended_early": self._ended,
        }
        self._ended = False
        self._end.clear()
        self.epochs.append(report)
        if lost or repeated or (report["ended_early"] and expected is None):
            unit = "examples" if self.batched else "elements"
            logger.warning(
                "Stage '%s' on the tf.data service (%s): this epoch delivered "
                "%d %s of %s expected: %s lost, %s repeated%s.",
                self.name,
                self.processing_mode,
                delivered,
                unit,
                "an unknown number" if expected is None else expected,
                "unknown" if lost is None else lost,
                "unknown" if repeated is None else repeated,
                "; it was ended by fail-over" if report["ended_early"] else "",
            )
        return report

    def end_of_data(self):
        """Settles the epoch whose iterator ran out, before Keras's ends it."""
        self._unreported = self.settle()

    def epoch_report(self):
        """The report of the epoch ending (for the epoch-end logs)."""
        unreported, self._unreported = self._unreported, None
        if unreported is not None and self._read() == self._settled:
            return unreported
        return self.settle()


def _rows(element, batched):
    """Rows of `element` (its first tensor's first dimension), or 1."""
    if not batched:
        return tf.constant(1, tf.int64)
    first = tf.nest.flatten(element)[0]
    return tf.cast(tf.shape(first)[0], tf.int64)


def _until_complete(served, per_copy, spec, batched):
    """`served` (`(state, element)`) ended once it has `per_copy` rows, so
    a `"distributed_epoch"` job with a task on a lost worker still ends."""

    def tally(total, state_and_element):
        state, element = state_and_element
        data = tf.cast(tf.equal(state, _DATA), tf.int64)
        total += _rows(element, batched) * data
        return total, (state, element, total >= per_copy)

    def then_stop(state, element, done):
        stop = tf.data.Dataset.from_tensors(
            (
                tf.constant(_STOP, tf.int64),
                tf.nest.map_structure(_placeholder, spec),
            )
        )
        return tf.data.Dataset.from_tensors((state, element)).concatenate(
            stop.take(tf.cast(done, tf.int64))
        )

    counted = served.scan(tf.constant(0, tf.int64), tally)
    return counted.flat_map(then_stop).take_while(
        lambda state, _: state != _STOP
    )


def _placeable(spec):
    """Whether `_placeholder` can make an element of `spec`."""
    return all(
        isinstance(s, tf.TensorSpec) and s.shape.rank is not None
        for s in tf.nest.flatten(spec)
    )


def _placeholder(spec):
    """An element of `spec` for the end marker: zeros, unknown dims empty."""
    shape = [0 if d is None else d for d in spec.shape.as_list()]
    zeros = tf.zeros(shape, spec.dtype)
    # With the spec's own static shape, so the two branches match.
    return tf.raw_ops.PlaceholderWithDefault(input=zeros, shape=spec.shape)
