"""A pipeline's epochs on one iterator (`LongLivedIterator`), which can
outlive a call: its source spans the epochs (`long_lived_source`) or is fed
each call's passes (`FedSource`), as `LongLivedEpochs` plans; it is dropped
on a thread of its own (`release`).
"""

import atexit
import sys
import threading
import time
import weakref

import tensorflow as tf

from keras_stage.data.runner import wait_at_exit
from keras_stage.data.source_passes import _unconverted, one_pass

RELEASE_THREAD = "tf.data-iterator-release"  # not a stage's helper thread
_releases = weakref.WeakSet()


@atexit.register
def _finish_releases():
    # Teardowns still running are waited for (see `runner.wait_at_exit`).
    wait_at_exit(thread.join for thread in list(_releases))


def release(held):
    """Empties the list `held` on a daemon thread, and returns the thread.

    Deleting a tf.data iterator joins its threads, which can block the
    caller (a list: an argument stays referenced until the call returns).
    Once the interpreter's exit has begun, `held` is emptied here and None
    returned: a thread started then could be in the teardown at finalization.
    """
    if sys.is_finalizing() or not threading.main_thread().is_alive():
        held.clear()
        return None
    thread = threading.Thread(
        target=held.clear, name=RELEASE_THREAD, daemon=True
    )
    thread.start()
    _releases.add(thread)
    return thread


# The long-lived iterators that outlived a call.
_running_on = weakref.WeakSet()


def _release_box(box, fed=None):
    """Finalizer of a `LongLivedIterator` that ran on: ends its fed source,
    releases its iterator."""
    if fed is not None:
        fed.close()
    if box[0] is not None:
        held, box[0] = [box[0]], None
        release(held)


@atexit.register
def _close_running_on():
    # In the exiting thread, while the interpreter can still run the
    # Python a staged map calls (see `release`).
    for shared in list(_running_on):
        shared.close()


class LongLivedEpochs:
    """How a stage runs a call's epochs on one iterator.

    Attributes:
        epochs: The epochs its source spans (None: as many as are read).
        start, stop, opens: The source's (see `long_lived_source`).
        source: The long-lived source (built when first read).
        ordinal: The staged random layers' count of numbered elements
            (`StageSplit.ordinal`) when the stage numbers them, else None.
        feeds: Whether each call feeds its passes to a `FedSource` (`fed`).
    """

    def __init__(
        self,
        epochs,
        batches,
        steps_per_execution,
        start,
        source,
        stop=None,
        opens=0,
        feeds=False,
    ):
        self.epochs = epochs
        self.batches = batches
        self.steps_per_execution = steps_per_execution
        self.start = start
        self.stop = stop
        self.opens = opens
        self._source = source  # or a function building it
        self.ordinal = None
        self.feeds = feeds
        self.fed = None

    @property
    def source(self):
        if callable(self._source):
            self._source = self._source()
        return self._source

    @property
    def restartable(self):
        """Whether an epoch can start on a new iterator: with `start`, or
        free passes (`epochs` None); not with `stop`, nor fed."""
        return (
            not self.feeds
            and self.stop is None
            and (self.start is not None or self.epochs is None)
        )


class LongLivedIterator:
    """The one real iterator of a pipeline spanning a call's epochs, each
    read through a view of its own (`read`). `plan`: its `LongLivedEpochs`
    (fewer epochs may be read, not more); `made(seconds)` is told how long
    each real iterator took; `pool`: the stage's `StagePool`, or None."""

    def __init__(self, pipeline, plan, made, pool=None, name="stage"):
        self._pipeline = pipeline
        self.batches = int(plan.batches)
        self.epochs = None if plan.epochs is None else int(plan.epochs)
        self.steps_per_execution = int(plan.steps_per_execution)
        self.made = made
        self._start = plan.start
        self._stop = plan.stop
        self._fed = plan.fed  # a `FedSource`: the passes fed, no other
        self.restartable = plan.restartable
        self._segment_end = None  # with `stop`: the epoch it ends before
        self._pool = pool
        self._name = name
        # Set from the batches taken (the real iterator reads ahead).
        self._ordinal = plan.ordinal
        self._ordinal_origin = None  # its value less the batches taken
        # The real iterator, in a list a finalizer can hand to `release`.
        self._box = [None]
        self._pool_size = None  # the pool size it was made on
        self._view = None  # the view read now
        self.read_batches = 0
        self.closed = False
        self.iterators_made = 0
        # The caller's datasets over this iterator, by id of the pipeline
        # they read: built once, not again by a later call reading on.
        self.epoch_pipelines = {}

    @property
    def _iterator(self):
        return self._box[0]

    @_iterator.setter
    def _iterator(self, iterator):
        self._replace(iterator)

    def _replace(self, iterator):
        """Makes `iterator` the real one; the one it replaces is deleted on
        another thread (`release`), which is returned (None if there was
        none). Its teardown waits for tf.data's autotuning thread to wake,
        whose period doubles as the iterator lives on: in a resize between
        calls, up to 25 s on the training thread (`images`, 2 cores)."""
        held, self._box[0] = [self._box[0]], iterator
        return None if held[0] is None else release(held)

    @property
    def _limit(self):
        """The epochs its source holds (None: as many as are read)."""
        return self.epochs if self._fed is None else self._fed.passes

    @property
    def epoch(self):
        """The epoch read now (0-based; the next, between epochs)."""
        return self.read_batches // self.batches

    def read(self, view, batches):
        """The real iterator, for `batches` batches of `view`'s epoch."""
        if self.closed:
            raise RuntimeError(
                f"Stage '{self._name}': its call has ended; an iterator "
                "kept from it cannot be read."
            )
        if view is not self._view:
            self._begin(view)
        self.read_batches += batches
        return self._iterator

    def _begin(self, view):
        """A view not read before: an epoch begins."""
        self._view = view
        left = -self.read_batches % self.batches
        if left:
            # The last epoch was left early: the next starts where a fresh
            # iterator would.
            if self.restartable:
                self._iterator = None  # the next is made at the next epoch
            else:
                for _ in range(left):
                    next(self._iterator)
            self.read_batches += left
        if self._limit is not None and self.epoch >= self._limit:
            raise RuntimeError(
                f"Stage '{self._name}' was built for {self._limit} epochs "
                "on one iterator, and Keras began one more: the caller of "
                "stage_data(epochs=...) must pass an upper bound of the "
                "epochs Keras reads."
            )
        if (
            self._iterator is not None
            and self.restartable
            and self._pool is not None
            and self._pool.size != self._pool_size
        ):
            # An iterator's pool size is fixed when it is made.
            self._iterator = None
        if self._iterator is not None and self._segment_end is not None:
            if self.epoch >= self._segment_end:
                self._end_segment()
        if self._iterator is None:
            self._make()

    def next_epoch_reads_on(self):
        """Whether the next epoch reads on from the real iterator (a pool
        resized for it would make an iterator)."""
        return self._iterator is not None and self.restartable

    def _end_segment(self):
        """Reads the real iterator to its end (`stop`), then drops it: its
        last pass takes its draws before the next iterator takes the next."""
        while True:
            try:
                next(self._iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                break
        self._iterator = None

    def _make(self):
        self._iterator = None  # the one it replaces goes first
        if self._start is not None:
            self._start.assign(self.epoch)
        if self._stop is not None:
            # The first epoch ends its iterator: the adaptive pool is
            # resized after it.
            self._segment_end = (
                self.epoch + 1 if self.epoch == 0 else self.epochs
            )
            self._stop.assign(self._segment_end)
        if self._ordinal is not None:
            if self._ordinal_origin is None:
                value = int(self._ordinal.numpy())
                self._ordinal_origin = value - self.read_batches
            self._count_taken()  # what the new iterator numbers on from
        self._pool_size = None if self._pool is None else self._pool.size
        started = time.perf_counter()
        self._iterator = iter(self._pipeline)
        self.iterators_made += 1
        self.made(time.perf_counter() - started)

    @property
    def carries(self):
        """Whether its iterator runs on into a later call's first epoch."""
        return (
            not self.closed
            and self._iterator is not None
            and self.read_batches % self.batches == 0
            and (self._fed is None or self._fed_read())
        )

    def _fed_read(self):
        """Whether it read every pass fed, on the pool as sized now (a
        resized pool runs in a stage built anew)."""
        return self.epoch == self._fed.passes and (
            self._pool is None or self._pool.size == self._pool_size
        )

    def _count_taken(self):
        """Sets `ordinal` to the elements taken (see `_ordinal`)."""
        if self._ordinal_origin is not None:
            self._ordinal.assign(self._ordinal_origin + self.read_batches)

    def detach(self):
        """Ends a call, the iterator running on: from now on it is released
        (`release`), not deleted in the thread dropping this object (its
        teardown can wait on a `tf.py_function` waiting for the interpreter
        lock), and before the interpreter exits (`_close_running_on`)."""
        self._view = None
        self._count_taken()
        if self not in _running_on:
            _running_on.add(self)
            weakref.finalize(self, _release_box, self._box, self._fed)

    def close(self):
        """Drops the real iterator on another thread (`release`).

        Returns:
            The thread that drops it (None once the interpreter exits).
        """
        self.closed = True
        self._count_taken()
        _running_on.discard(self)
        if self._fed is not None:
            self._fed.close()
        self._view = None
        return self._replace(None)


# The calls' passes a fed source holds at once (see `FedSource.feed`).
_FED_CAPACITY = 1


class FedSource:
    """A long-lived source that each call feeds its own passes.

    A loop building a new dataset of one structure per call would otherwise
    build a stage per call. This is a queue of datasets read in turn: each
    call feeds its passes (`feed`), every pass a fresh iterator of its
    dataset (as plain Keras's epochs are). With every pass read, the
    iterator waits in the dequeue for the next call's; `close` ends it.
    `element_spec` and `options`: the fed datasets', and the source's.
    """

    def __init__(self, element_spec, options):
        self.element_spec = element_spec
        self.options = options
        self.passes = 0  # fed so far, by every call
        self.closed = False
        with tf.init_scope(), tf.device("/CPU:0"):
            self._queue = tf.queue.FIFOQueue(
                _FED_CAPACITY, dtypes=[tf.variant], shapes=[[]]
            )
        queue = self._queue

        def next_passes(_):
            return queue.dequeue()

        def passes(variant):
            return tf.data.experimental.from_variant(variant, element_spec)

        self.dataset = (
            tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
            .repeat()
            .map(_unconverted(next_passes))
            .flat_map(_unconverted(passes))
            .with_options(options)
        )

    def accepts(self, dataset):
        """Whether `dataset`'s passes can be fed here (same structure)."""
        return (
            not self.closed
            and dataset.element_spec == self.element_spec
            and dataset.options() == self.options
        )

    def feed(self, dataset, passes, opens=0):
        """Feeds `passes` passes of `dataset` (each followed by `opens`
        unread iterators); those fed before must all be read (else
        RuntimeError)."""
        if self.closed or int(self._queue.size()) >= _FED_CAPACITY:
            raise RuntimeError(
                "A fed stage source was fed while its last call's passes "
                "were still unread (or after it was closed)."
            )
        self._queue.enqueue(
            tf.data.experimental.to_variant(
                one_pass(dataset, opens).repeat(int(passes))
            )
        )
        self.passes += int(passes)

    def close(self):
        """Ends the source: an iterator waiting for passes ends instead."""
        if self.closed:
            return
        self.closed = True
        try:
            # Eagerly: a finalizer (`_release_box`) may run this while a
            # step is traced, whose graph would otherwise take the op.
            with tf.init_scope():
                self._queue.close(cancel_pending_enqueues=True)
        except tf.errors.OpError:  # its resource already gone at exit
            pass
