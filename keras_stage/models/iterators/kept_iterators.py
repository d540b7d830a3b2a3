"""The iterators Keras gets from a staged call, and those kept alive.

Keras's `EpochIterator` makes an iterator of its dataset each epoch (and one
more as each epoch ends). A staged call (`CallIterators`) hands it
`KeptIterator`s, whose `resolve()` is the real iterator behind, one of:

- a `DeferredIterator`, made when first read: one Keras never reads costs
  nothing;
- the call's one `LongLivedIterator`, read through an `EpochView` per
  epoch: its source spans the epochs in plain Keras's orders
  (`epoch_sources.long_lived_source`), so an epoch pays no iterator;
- the iterator a `KeptStage` (the model's stage per role) left running
  across calls, over a source of free passes or a `FedSource`.

The batches a long-lived stage holds when an epoch begins are that epoch's
(not orphans to `StageStats.mark_request`). A call's end drops its real
iterator on a thread of its own (`release`).
"""

import atexit
import sys
import threading
import time
import weakref

import tensorflow as tf

from keras_stage.data.eager_iterated import EagerIterated
from keras_stage.data.runner import wait_at_exit


class KeptIterator:
    """An iterator Keras holds that stands for a real one (`resolve`)."""

    def resolve(self):
        """The real iterator."""
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.resolve())

    def get_next(self):
        return self.resolve().get_next()


def resolve(iterator):
    """`iterator`'s real iterator: what a compiled step call reads."""
    if isinstance(iterator, KeptIterator):
        return iterator.resolve()
    return iterator


class DeferredIterator(KeptIterator):
    """An eager iterator of `pipeline`, made when first read."""

    def __init__(self, pipeline, made):
        self._pipeline = pipeline
        self._made = made
        self._iterator = None

    def resolve(self):
        """The real iterator, made now if it was not yet."""
        if self._iterator is None:
            started = time.perf_counter()
            self._iterator = iter(self._pipeline)
            self._made(time.perf_counter() - started)
        return self._iterator

    @property
    def element_spec(self):
        return self._pipeline.element_spec


class DeferredPipeline(EagerIterated):
    """`pipeline` as a dataset whose eager iterators are `DeferredIterator`s.

    `made(seconds)` is told how long each real iterator took to make. With
    `defer=False` they are made when Keras asks for them, and only timed.
    """

    def __init__(self, pipeline, made, defer=True):
        self._made = made
        self._defer = defer
        super().__init__(pipeline)

    def eager_iter(self):
        iterator = DeferredIterator(self._base, self._made)
        return iterator if self._defer else iterator.resolve()


# The name of `release`'s threads (not a stage's helper thread).
RELEASE_THREAD = "tf.data-iterator-release"
_releases = weakref.WeakSet()


@atexit.register
def _finish_releases():
    # Teardowns still running are waited for (see `runner.wait_at_exit`).
    wait_at_exit(thread.join for thread in list(_releases))


def release(held):
    """Empties the list `held` on a daemon thread: its teardown may block.

    Deleting a tf.data iterator joins its threads, which can block a call's
    return. A list, not the iterator: an argument stays referenced by the
    caller until the call returns. Once the interpreter's exit has begun,
    `held` is emptied in the calling thread (a thread started then could
    still be in the teardown at finalization).

    Returns:
        The thread (tests join it), or None when emptied in place.
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
    """Finalizer of a `LongLivedIterator` that ran on: its fed source (if
    any) ended, its iterator dropped on a release thread."""
    if fed is not None:
        fed.close()
    if box[0] is not None:
        held, box[0] = [box[0]], None
        release(held)


@atexit.register
def _close_running_on():
    # Torn down in the exiting thread while the interpreter can still run
    # the Python a staged map calls (see `release`).
    for shared in list(_running_on):
        shared.close()


class LongLivedIterator:
    """The one real iterator of a pipeline spanning a call's epochs.

    `plan`: the pipeline's `LongLivedEpochs` (Keras may read fewer epochs,
    never more). `made(seconds)` is told how long each real iterator took;
    `pool`: the stage's `StagePool`, or None; `name`: the stage's.
    """

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
        # With `stop`: the epoch the real iterator ends before.
        self._segment_end = None
        self._pool = pool
        self._name = name
        # The staged random layers' count of numbered elements, kept here
        # from what Keras took (its iterator reads ahead), or None.
        self._ordinal = plan.ordinal
        # `ordinal`'s value less the batches read when first made.
        self._ordinal_origin = None
        # The real iterator, in a list a finalizer can hand to `release`.
        self._box = [None]
        self._pool_size = None  # the pool size it was made on
        self._view = None  # the view Keras reads now
        self.read_batches = 0
        self.closed = False
        self.iterators_made = 0
        self._epoch_pipelines = {}  # by id of the pipeline read

    @property
    def _iterator(self):
        return self._box[0]

    @_iterator.setter
    def _iterator(self, iterator):
        self._box[0] = iterator

    def epoch_pipeline(self, pipeline):
        """The `EpochPipeline` Keras reads `pipeline`'s epochs through.

        Built once: a later call reading on from this iterator builds no
        dataset.
        """
        held = self._epoch_pipelines.get(id(pipeline))
        if held is None or held[0] is not pipeline:
            held = (pipeline, EpochPipeline(self, pipeline))
            self._epoch_pipelines[id(pipeline)] = held
        return held[1]

    @property
    def _limit(self):
        """The epochs its source holds (None: as many as are read)."""
        return self.epochs if self._fed is None else self._fed.passes

    @property
    def epoch(self):
        """The epoch Keras reads now (0-based; the next, between epochs)."""
        return self.read_batches // self.batches

    def read(self, view, batches):
        """The real iterator, for `batches` batches of `view`'s epoch."""
        if self.closed:
            raise RuntimeError(
                f"Stage '{self._name}': its call has ended; an iterator "
                "Keras kept from it cannot be read."
            )
        if view is not self._view:
            self._begin(view)
        self.read_batches += batches
        return self._iterator

    def _begin(self, view):
        """Keras reads an iterator it has not read before: an epoch begins."""
        self._view = view
        left = -self.read_batches % self.batches
        if left:
            # Keras left the last epoch early: the next starts where a fresh
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
            # The adaptive pool was resized: an iterator's pool is fixed
            # when it is made.
            self._iterator = None
        if self._iterator is not None and self._segment_end is not None:
            if self.epoch >= self._segment_end:
                self._end_segment()
        if self._iterator is None:
            self._make()

    def next_epoch_reads_on(self):
        """Whether the next epoch reads on from the real iterator (so a
        pool resized for it makes an iterator the call would not make)."""
        return self._iterator is not None and self.restartable

    def _end_segment(self):
        """Reads the real iterator to its end (`stop`), then drops it.

        Read to its end, its last pass has taken its draws (the unread
        iterator plain Keras makes) before the next iterator takes the next.
        """
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
        """Sets `ordinal` to the elements Keras took (see `_ordinal`)."""
        if self._ordinal_origin is not None:
            self._ordinal.assign(self._ordinal_origin + self.read_batches)

    def detach(self):
        """Ends a call without dropping the iterator (see `KeptStage`).

        From now on the real iterator is never deleted in the thread that
        drops this object (its teardown can wait on a `tf.py_function`
        waiting for the interpreter lock), and is dropped before the
        interpreter exits (`_close_running_on`).
        """
        self._view = None
        self._count_taken()
        if self not in _running_on:
            _running_on.add(self)
            weakref.finalize(self, _release_box, self._box, self._fed)

    def close(self):
        """Drops the real iterator, torn down on another thread (`release`).

        Returns:
            The thread that drops it (None once the interpreter exits).
        """
        self.closed = True
        self._count_taken()
        _running_on.discard(self)
        if self._fed is not None:
            self._fed.close()
        held, self._iterator = [self._iterator], None
        self._view = None
        return release(held)


class EpochView(KeptIterator):
    """The iterator Keras gets for one epoch of a long-lived pipeline.

    `resolve` hands the compiled step the shared `LongLivedIterator`, for
    `steps_per_execution` batches. Python reads end with its epoch, so a
    reader that reads ahead (Keras's JAX trainer) gets the end, not the next
    epoch's first batch.

    `spec`: under a strategy of several replicas, one replica's batch
    structure. Keras reads one batch in Python from the first iterator of
    each `fit` and `evaluate` to build what is unbuilt (the staged call has
    built it all): a view's first Python read, before any step, gets a batch
    of `spec` with no rows and reads nothing from the shared iterator.
    """

    def __init__(self, shared, element_spec, spec=None):
        self._shared = shared
        self._element_spec = element_spec
        self._python_reads = 0
        self._spec = spec
        self._peeked = spec is None  # nothing to peek without a strategy
        self._stepped = False

    def resolve(self):
        """The real iterator, for one call of the compiled step."""
        self._stepped = True
        return self._shared.read(self, self._shared.steps_per_execution)

    def _peek(self):
        if self._peeked or self._stepped or self._python_reads:
            return None
        self._peeked = True
        return tf.nest.map_structure(_empty_batch, self._spec)

    def _read_one(self):
        if self._python_reads >= self._shared.batches:
            return None  # the epoch's end
        self._python_reads += 1
        return self._shared.read(self, 1)

    def __next__(self):
        peeked = self._peek()
        if peeked is not None:
            return peeked
        iterator = self._read_one()
        if iterator is None:
            raise StopIteration
        return next(iterator)

    def get_next(self):
        peeked = self._peek()
        if peeked is not None:
            return peeked
        iterator = self._read_one()
        if iterator is None:
            raise tf.errors.OutOfRangeError(None, None, "End of sequence")
        return iterator.get_next()

    @property
    def element_spec(self):
        return self._element_spec


class EpochPipeline(EagerIterated):
    """One epoch of a long-lived pipeline, as Keras sees it.

    Its cardinality is one epoch's batches; its eager iterators are
    `EpochView`s of the shared `LongLivedIterator`.
    """

    def __init__(self, shared, pipeline):
        self._shared = shared
        super().__init__(
            pipeline.take(shared.batches).apply(
                tf.data.experimental.assert_cardinality(shared.batches)
            )
        )

    def eager_iter(self):
        return EpochView(self._shared, self._base.element_spec)


def _empty_batch(spec):
    """A value of `spec` with no rows (a `None` dimension as 0).

    A composite spec stands for itself: Keras's peek reads only shapes and
    dtypes.
    """
    if not isinstance(spec, tf.TensorSpec):
        return spec
    shape = [0 if dim is None else dim for dim in spec.shape.as_list()]
    if spec.dtype == tf.string:
        return tf.fill(shape, "")
    return tf.zeros(shape, spec.dtype)


class DistributedEpochPipeline(tf.distribute.DistributedDataset):
    """One epoch of a long-lived distributed pipeline, as Keras sees it.

    Its iterators are `EpochView`s of the shared `LongLivedIterator` of the
    distributed pipeline (Keras wraps it with
    `_compat.distributed_dataset_adapter`).
    """

    def __init__(self, shared, distributed, spec):
        self._shared = shared
        self._distributed = distributed
        self._spec = spec  # one replica's batch (see `EpochView`)

    def __iter__(self):
        return EpochView(
            self._shared, self._distributed.element_spec, self._spec
        )

    @property
    def element_spec(self):
        return self._distributed.element_spec

    def cardinality(self):
        """The batches of one epoch (what Keras's adapter counts)."""
        return self._shared.batches

    def reduce(self, initial_state, reduce_func):
        raise TypeError(
            "One epoch of a long-lived staged pipeline is read only through "
            "its iterators; reduce the dataset before it is staged instead."
        )


class CallIterators:
    """What Keras iterates of one role's stage in one call.

    A `DeferredIterator` per epoch, or `EpochView`s of the call's
    `LongLivedIterator`, which the role's `KeptStage` may keep across calls.

    Args:
        data: The call's `StagedData`.
        plan: Its `LongLivedEpochs`, or None: an iterator per epoch.
    """

    def __init__(self, data, plan=None):
        self._data = data
        self.plan = plan
        self._shared = None  # its `LongLivedIterator`, made when read

    def eager_dataset(self):
        """What Keras reads in Python (predict; every phase on JAX)."""
        return self._per_epoch(self._data.staged)

    def compiled_dataset(self):
        """What the compiled step iterates."""
        data = self._data
        staged = data.staged
        pipeline = staged.lean_pipeline if data.in_step else staged.pipeline
        if data.strategy is not None:
            distributed = self._distributed(pipeline)
            if self.plan is not None:
                return DistributedEpochPipeline(
                    self._shared_iterator(distributed),
                    distributed,
                    pipeline.element_spec,
                )
            return distributed
        return self._per_epoch(pipeline)

    def _per_epoch(self, pipeline):
        """`pipeline`'s epochs: on the call's one iterator, or deferred."""
        if self.plan is not None:
            return self._shared_iterator(pipeline).epoch_pipeline(pipeline)
        data = self._data
        return DeferredPipeline(pipeline, data._made, defer=data.defers)

    def _shared_iterator(self, pipeline):
        """The call's `LongLivedIterator` of `pipeline`."""
        data, kept = self._data, self._data.kept
        spans = kept is not None and kept.spans_calls
        if self._shared is None and spans:
            self._shared = kept.iterator(pipeline)
            if self._shared is not None:
                self._shared.made = data._made
        if self._shared is None:
            self._shared = LongLivedIterator(
                pipeline,
                self.plan,
                data._made,
                pool=data.staged.thread_pool,
                name=data.staged.name,
            )
            if spans:
                kept.keep_iterator(pipeline, self._shared)
        return self._shared

    def _distributed(self, pipeline):
        """`pipeline` distributed by the strategy, kept with a kept stage."""
        kept = self._data.kept
        if kept is not None:
            return kept.distributed(pipeline, self._data.distribute)
        return self._data.distribute(pipeline)

    def resize_makes_an_iterator(self):
        """Whether a pool resized now makes an iterator the call would not
        (see `LongLivedIterator.next_epoch_reads_on`)."""
        return self._shared is not None and self._shared.next_epoch_reads_on()

    @property
    def restartable(self):
        """Whether any epoch can start on a new iterator (see `start`)."""
        return self.plan is None or self.plan.restartable

    def end_call(self):
        """Ends the call's iterators, or detaches one that runs on.

        Keras may leave an iterator alive (a traceback holds it): the gate
        keeps its late elements out of the stats the next call shares.

        Returns:
            The thread tearing down the long-lived iterator, or None.
        """
        data, kept = self._data, self._data.kept
        values = None
        if kept is not None and kept.carries():
            values = variable_values(data.split)
        if values is not None:
            # Its iterator runs on: its elements are the next call's.
            kept.end_call(values)
            return None
        if data.owned:
            data.staged.runner.close_gate()
        released = None
        if self._shared is not None:
            released = self._shared.close()
        if kept is not None:
            kept.drop_iterator()
            kept.released = released
            kept.in_use = False
        return released


class LongLivedEpochs:
    """How a stage runs a call's epochs on one iterator.

    Attributes:
        epochs: The epochs its source spans (None: as many as are read).
        start, stop: The source's first- and end-epoch variables (see
            `long_lived_source`), or None.
        opens: The unread iterators of the source each pass makes.
        source: The long-lived source (built when first read).
        ordinal: The staged random layers' count of numbered elements
            (`StageSplit.ordinal`) when the stage numbers them, else None.
        feeds: Whether each call feeds its passes to the source (a
            `FedSource`, `fed` once built).
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
        """Whether its epochs can start on a new iterator: with `start`, or
        free passes (`epochs` None); not with `stop`, nor fed."""
        return (
            not self.feeds
            and self.stop is None
            and (self.start is not None or self.epochs is None)
        )


def one_pass(dataset, opens=0):
    """One pass of `dataset`, then `opens` (0 or 1) unread iterators of it.

    `choose_from_datasets` with an empty selector makes (and drops) an
    iterator of `dataset`, reading nothing from it.
    """
    if not opens:
        return dataset
    unread = tf.data.Dataset.choose_from_datasets(
        [dataset], tf.data.Dataset.range(0)
    )
    return dataset.concatenate(unread)  # it keeps `dataset`'s options


def _unconverted(fn):
    """`fn` (no control flow) for tf.data without AutoGraph's conversion,
    which costs more than its trace and plain Keras never pays."""
    return tf.autograph.experimental.do_not_convert(fn)


# The calls' passes a fed source holds at once (see `FedSource.feed`).
_FED_CAPACITY = 1


class FedSource:
    """A long-lived source that each call feeds its own passes.

    A call on a new dataset object of a kept stage's structure (a loop
    building its dataset per call) would otherwise build the stage again.
    This source is a queue of datasets read one after another: each call
    feeds its passes (`feed`) and the stage's one iterator reads them next.
    Every pass reads a fresh iterator of its dataset, as plain Keras's
    epochs do. Once the passes fed are read, the iterator waits in the
    queue's dequeue for the next call's; `close` ends the wait.

    Args:
        element_spec: The structure of the fed datasets' elements.
        options: The fed datasets' `tf.data.Options`, the source's own.
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
        unread iterators), read after those fed before.

        Raises:
            RuntimeError: the passes fed before are not all read yet.
        """
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
            self._queue.close(cancel_pending_enqueues=True)
        except tf.errors.OpError:  # its resource already gone at exit
            pass


# How long a call waits for the teardown of a kept stage's last iterator
# before it builds a stage of its own.
TEARDOWN_WAIT_SECONDS = 5.0


class KeptStage:
    """A stage a model keeps for its later calls on the same dataset.

    What the stage depends on is held, not only its id, which a new object
    could take. `in_use` while a call runs it.
    """

    def __init__(
        self,
        layer,
        phase,
        source,
        batches,
        fn,
        stats,
        long_lived,
        class_weight=None,
        strategy=None,
        overrides=None,
        call_source=None,
    ):
        # `strategy`: the one of several replicas that distributes it.
        self.objects = (layer, source, fn, stats, strategy)
        self.values = (
            phase,
            batches,
            repr(sorted(layer.stage_options.get_config().items())),
            None
            if long_lived is None
            else (
                long_lived.epochs,
                long_lived.steps_per_execution,
                long_lived.feeds,
            ),
            # Keras weighs the batches in its dataset; copied, as a user
            # may change the dict between calls.
            None
            if class_weight is None
            else repr(sorted(dict(class_weight).items())),
            repr(sorted((overrides or {}).items())),
        )
        self.long_lived = long_lived  # its `LongLivedEpochs`, or None
        # One epoch of the call's source, which a fed stage's call feeds.
        self.call_source = call_source
        # Whether its one iterator outlives calls: that iterator, the
        # pipeline it iterates, and the staged layers' variables' values
        # when the last call ended (None: none to compare).
        self.spans_calls = long_lived is not None and long_lived.epochs is None
        self._shared = None
        self._shared_pipeline = None
        self._variables = None
        # The thread tearing down the last call's iterator, or None: a call
        # reusing the stage waits for it before it opens the gate.
        self.released = None
        self.staged = None
        self.in_use = False
        self._distributed = None  # `(pipeline, its distributed dataset)`

    def distributed(self, pipeline, distribute):
        """`pipeline` as `distribute(pipeline)` made it, for every call (made
        again, it would rewrite the pipeline for the replicas again)."""
        if self._distributed is None or self._distributed[0] is not pipeline:
            self._distributed = (pipeline, distribute(pipeline))
        return self._distributed[1]

    def same(self, other, split=None):
        """Whether `other`, wanted by a new call, is this stage.

        With a kept iterator, also whether the staged layers' variables
        still hold the values its buffer was computed with.
        """
        if self.values != other.values:
            return False
        objects, others = self.objects, other.objects
        if self.long_lived is not None and self.long_lived.feeds:
            # Fed: another dataset of its structure, while it runs on.
            fed = self.long_lived.fed
            if (
                fed is None
                or not self.keeps_running()
                or not fed.accepts(other.call_source)
            ):
                return False
            objects, others = objects[:1] + objects[2:], others[:1] + others[2:]
        if not all(a is b for a, b in zip(objects, others, strict=True)):
            return False
        if self._variables is None or not self.keeps_running():
            return True
        return _same_values(self._variables, variable_values(split))

    def iterator(self, pipeline):
        """The iterator an earlier call left over `pipeline`, or None."""
        if self._shared is not None and self._shared_pipeline is pipeline:
            return self._shared
        return None

    def keep_iterator(self, pipeline, shared):
        """Keeps `shared`, the one iterator of `pipeline`, across calls."""
        self.drop_iterator(ends_source=False)
        self._shared, self._shared_pipeline = shared, pipeline

    def keeps_running(self):
        """Whether the kept iterator runs on into a next call's epoch."""
        return self._shared is not None and self._shared.carries

    def carries(self):
        """Whether a call reusing this stage reads on from its iterator."""
        return self.spans_calls and self.keeps_running()

    def end_call(self, values):
        """Ends a call whose iterator runs on; `values`: the staged layers'
        variables' values now."""
        self._shared.detach()
        self._variables = values
        self.in_use = False

    def drop_iterator(self, ends_source=True):
        """Drops the kept iterator, if any (torn down on another thread).

        A fed source ends with it (`ends_source`): a new iterator would read
        the same queue of passes.
        """
        shared, self._shared = self._shared, None
        self._shared_pipeline, self._variables = None, None
        if shared is not None and not shared.closed:
            self.released = shared.close()
        fed = None if self.long_lived is None else self.long_lived.fed
        if ends_source and fed is not None:
            fed.close()

    def retire(self):
        """Ends this stage for good: a new one replaces it."""
        if self._shared is not None and self.staged is not None:
            self.staged.runner.close_gate()
        self.drop_iterator()


# A kept iterator runs on across calls only when the staged layers'
# variables, whose values each call compares, are this small in all.
VARIABLES_COMPARED_BYTES = 2**20


def variable_values(split):
    """The values of `split`'s staged layers' variables as NumPy arrays, or
    None when over `VARIABLES_COMPARED_BYTES` (the reader kept per split)."""
    if split is None:
        return ()
    read = _split_readers.get(split, False)
    if read is False:
        variables = tuple(split.prefix.variables)
        size = sum(
            tf.TensorShape(v.shape).num_elements() * tf.as_dtype(v.dtype).size
            for v in variables
        )
        read = None
        if size <= VARIABLES_COMPARED_BYTES:
            read = split.backend.variable_reader(variables)
        _split_readers[split] = read
    return None if read is None else read()


_split_readers = weakref.WeakKeyDictionary()


def _same_values(before, now):
    if before is None or now is None or len(before) != len(now):
        return False
    return all(
        a.shape == b.shape and (a == b).all()
        for a, b in zip(before, now, strict=True)
    )


def earlier_stage(kept, role):
    """The kept stage a call of `role` may run again, or None.

    Its role's; for an evaluate with none of its own, a fit's fed
    validation stage (the same step) that is not in use.
    """
    earlier = kept.get(role)
    if earlier is None and role == "test":
        val = kept.get("val")
        if (
            val is not None
            and not val.in_use
            and val.long_lived is not None
            and val.long_lived.feeds
        ):
            return val
    return earlier


def switched_data(earlier, x):
    """Whether a call on `x` follows calls of its role on other datasets
    (`earlier`, the role's kept stage, is fed or built on another)."""
    if earlier is None:
        return False
    plan = earlier.long_lived
    return (plan is not None and plan.feeds) or earlier.objects[1] is not x


def carries(kept, role, x):
    """Whether a call of `role` on `x` would read on from a kept iterator.

    `kept`: the model's kept stages, or None.
    """
    entry = None if kept is None else kept.get(role)
    return (
        entry is not None
        and not entry.in_use
        and entry.objects[1] is x
        and entry.carries()
    )


def kept_stage(kept, role, wanted, split=None):
    """The kept stage a call of `role` runs: an earlier one, or `wanted`.

    `kept`: the model's kept stages by role (updated here). None where the
    call builds a stage of its own (nested in the one running the role's
    stage, or its earlier iterator still torn down).
    """
    earlier = earlier_stage(kept, role)
    entry = wanted
    if earlier is not None and earlier.in_use:
        return None  # a call nested in the one running it: its own
    if (
        earlier is not None
        and earlier.same(wanted, split)
        and not earlier.staged.stats.closed  # by a timeout: it ended
    ):
        entry = earlier
        kept[role] = entry  # an evaluate's, too, once it feeds one
    elif kept.get(role) is not None:
        if kept[role] is kept.get("val") and role == "test":
            del kept[role]  # the fit's validation's, which goes on
        else:
            kept[role].retire()  # this call's stage replaces it
    if entry.released is not None:
        entry.released.join(TEARDOWN_WAIT_SECONDS)
        if entry.released.is_alive():
            return None  # still torn down: a stage of its own
        entry.released = None
    return entry


def retire_all(kept):
    """Ends every stage of `kept` (a model's kept stages, by role)."""
    for entry in kept.values():
        entry.retire()
    kept.clear()
