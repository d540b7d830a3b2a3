"""The iterators a staged call hands to Keras's epoch loop.

Keras's `EpochIterator` makes the next epoch's iterator as soon as an epoch
ends, so every call makes one more iterator than it reads, and an
iterator of a staged pipeline costs what instantiating the staged
computation costs (a trace's worth of functions). `DeferredPipeline`
hands Keras iterators that make the real one when first read: the step
guard (`resolve`) or Keras's own Python reads (`next`) make it; an
iterator nobody reads costs nothing.

Long-lived epochs
-----------------

A stage built with `stage_data(..., epochs=E)` (when it is safe, see
`staged_data.stage_data`) runs across the call's epochs: its source spans all E
of them (`epoch_sources.long_lived_source`: `range(E).flat_map` of the
epoch's source, each pass drawing the order plain Keras's epoch draws),
and the stage makes ONE real iterator of it, when first read. Keras
still makes its iterators: `EpochPipeline` hands it an `EpochView` for
each, and `resolve` turns every view into that same real iterator
(`LongLivedIterator`), so the compiled step reads the epoch's batches
from it. So an epoch pays no iterator (no instantiation of the staged
functions, no cold buffer), and the buffer fills on while Keras ends an
epoch, runs callbacks and validation.

It relies on Keras reading exactly the epoch's batch count from each of
its iterators and nothing past it (`EpochIterator` with a known
cardinality, which `EpochPipeline` reports: one epoch's batches), which
`stage_data` checks before it builds the long-lived source. The views
count what Keras reads (each resolve from the step guard is one call of
`steps_per_execution` batches): an epoch Keras leaves early (a callback's
`stop_evaluating`) is read to its end (or restarted, for a source whose
passes are independent) before the next begins, so every epoch still
starts where plain Keras's fresh iterator starts. A source whose passes are
independent (in-memory arrays) also starts a new iterator, at the epoch
boundary, when the stage's adaptive pool was resized (the real iterator
runs on the pool it was made on). A source that draws per iterator (a
reshuffling `shuffle`) on an adaptive pool runs its first epoch on an
iterator that ends with it, and the rest on one more, on the pool sized
from the first; while an `EpochSwitch` may still run an epoch without the
stage, each staged epoch ends its iterator too. Each such iterator is
read to its end before the next is made, and so is each epoch read
without the stage (`DrawOrder`): the passes draw in plain Keras's order.
`StagedData.end_call` drops the real iterator, however many of its epochs
were read: on a thread of its own (`release`), as its teardown can block,
and with the stage's gate closed first, so nothing it still finishes counts.

Under a strategy of several replicas the real iterator is one iterator of
the stage's distributed dataset, and Keras gets a `DistributedEpochPipeline`
(a `tf.distribute.DistributedDataset`) whose iterators are
`DistributedEpochView`s (see there for Keras's peek at each call's start).

Across calls
------------

A stage a model keeps for its later calls on the same dataset (see
`staged_data.stage_data(kept=...)`) over a source whose passes are free
(`SourceFacts.free_passes`: every pass reads what plain Keras's fresh
iterator would) keeps its one real iterator too: its source repeats for as
long as it is read (`epochs=None`), the call's end only detaches it
(`detach`), and the next call's views read on from the next pass. Between
the calls its buffer fills with the next call's first batches. A call that
left an epoch early, or a change of the staged layers' variables in between
(`StagedData.end_call` compares them), starts a new real iterator instead.

Once a role's call comes on another dataset object than its kept stage's
(a fit's validation from its first call), the stage it builds reads a fed
source (`epoch_sources.FedSource`): each call, on any dataset of that
structure, feeds its passes, and the one real iterator reads them on,
without a stage built or an iterator made again. Its iterator reads only
what was fed: a call must read all of it to be run on (`carries`), and no
new iterator starts at an epoch (`restartable`).

The batches a long-lived stage holds when an epoch begins are that
epoch's, not left behind by a dropped iterator: a consumer that marks each
epoch's start in the stage's stats (`StageStats.mark_request`, which counts
every finished and unconsumed element as orphaned) must not orphan them,
or the epoch's buffer fill and wait are misread. Batches read past in
Python to finish an epoch Keras left are not counted as consumed.
"""

import atexit
import sys
import threading
import time
import weakref

import tensorflow as tf

from keras_stage.data.eager_iterated import EagerIterated
from keras_stage.data.runner import wait_at_exit


class ResolvingIterator:
    """An iterator Keras holds that stands for a real one (`resolve`).

    The step guard hands the compiled step `resolve()`; Keras's Python
    reads (`next`, `get_next`) read it too. Subclasses define `resolve`
    and `element_spec`.
    """

    def resolve(self):
        """The real iterator."""
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.resolve())

    def get_next(self):
        return self.resolve().get_next()


class DeferredIterator(ResolvingIterator):
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

    Used as a dataset otherwise (inside a `tf.function`, transformed) it is
    `pipeline` itself. `made(seconds)` is told how long each real
    iterator took to make. With `defer=False` the real iterators are made
    when Keras asks for them, and only timed.
    """

    def __init__(self, pipeline, made, defer=True):
        self._made = made
        self._defer = defer
        super().__init__(pipeline)

    def eager_iter(self):
        iterator = DeferredIterator(self._base, self._made)
        return iterator if self._defer else iterator.resolve()


class DrawOrder:
    """Keeps the draws of a source's passes in the order they are read.

    A source that draws from a seed generator per iterator (a reshuffling
    `shuffle`) draws when each pass starts and, with plain Keras's unread
    iterator after it (`epoch_sources.one_pass(opens=1)`), when it ends.
    Each pass's iterator is read to its end (`finish`) before the next one
    is made, so the draws come in plain Keras's order whatever iterators
    Keras makes and leaves unread. Shared by a call's epochs run without
    the stage (`OrderedPipeline`) and its `LongLivedIterator`.
    """

    def __init__(self):
        self._current = None

    def hold(self, iterator):
        """`iterator` reads a pass now (after `finish`)."""
        self._current = iterator

    def finish(self):
        """Reads the pass read last to its end, and drops its iterator."""
        if self._current is not None:
            current, self._current = self._current, None
            _read_to_end(current)


class OrderedPipeline(EagerIterated):
    """`pipeline` (one pass) whose eager iterators keep a `DrawOrder`.

    Each is made when first read, after the pass read before it was read
    to its end: one Keras makes and never reads draws nothing.
    """

    def __init__(self, pipeline, order):
        self._order = order
        super().__init__(pipeline)

    def eager_iter(self):
        return _OrderedIterator(self._base, self._order)


class _OrderedIterator(DeferredIterator):
    def __init__(self, pipeline, order):
        super().__init__(pipeline, lambda seconds: None)
        self._order = order

    def resolve(self):
        if self._iterator is None:
            self._order.finish()
            super().resolve()
            self._order.hold(self._iterator)
        return self._iterator


# The name of `release`'s threads: not a stage's helper thread
# (`keras_stage-<stage>`), as it holds no stage, only a dropped iterator.
RELEASE_THREAD = "tf.data-iterator-release"
_releases = weakref.WeakSet()


@atexit.register
def _finish_releases():
    # Teardowns still running are waited for (see `runner.wait_at_exit`:
    # seen aborting in an iterator's function library's stack traces).
    # They end on their own, in well under a second.
    wait_at_exit(thread.join for thread in list(_releases))


def _exiting():
    """Whether the interpreter's exit has begun (its main thread ended)."""
    return sys.is_finalizing() or not threading.main_thread().is_alive()


def release(held):
    """Empties the list `held` on a daemon thread: its teardown may block.

    Deleting a tf.data iterator cancels and joins its threads in the
    deleting thread, which at the end of a long-lived call's last epoch
    can block the call's return (seen in `LongLivedIterator.close`) while
    the pipeline itself is idle. A list, not the iterator: an argument
    stays referenced by the caller until the call returns, which would
    delete it there. The
    caller must hold no other reference to what the list holds.

    Once the interpreter's exit has begun, `held` is emptied in the
    calling thread: a thread started then (by an exit hook or finalizer
    after `_finish_releases`, or by the garbage collector) could still be
    in the teardown when the interpreter finalizes.

    Returns:
        The thread (tests join it), or None when emptied in place.
    """
    if _exiting():
        held.clear()
        return None

    def drop():
        held.clear()

    thread = threading.Thread(target=drop, name=RELEASE_THREAD, daemon=True)
    thread.start()
    _releases.add(thread)
    return thread


# The long-lived iterators that outlived a call (see "Across calls").
_running_on = weakref.WeakSet()


def _release_box(box, fed=None):
    """Finalizer of a `LongLivedIterator` that ran on: its iterator dropped
    on a release thread (the box stays, for a still live owner at exit),
    its fed source (if any) ended first."""
    if fed is not None:
        fed.close()
    if box[0] is not None:
        held, box[0] = [box[0]], None
        release(held)


@atexit.register
def _close_running_on():
    # The iterators that ran on past their calls are torn down here, in
    # the exiting thread (see `release`), while the interpreter can still
    # run the Python a staged map calls (tearing one down gives the
    # interpreter lock up while TensorFlow waits for its threads).
    for shared in list(_running_on):
        shared.close()


def restarts_anywhere(start, epochs, stop=None):
    """Whether a long-lived source's epochs can start on a new iterator.

    `start`: its first-epoch variable (see `long_lived_source`), or None;
    `epochs` None: a source of free passes, every pass of which is a
    first one. `stop`: its end-epoch variable, or None; a source with one
    draws per iterator, and its epochs after the first run on one
    iterator (see `LongLivedIterator`).
    """
    return stop is None and (start is not None or epochs is None)


def resolve(iterator):
    """`iterator`, or the real iterator a deferred or epoch view stands for.

    Called by the step guard once per call of a compiled step; an
    `EpochView` counts each call as `steps_per_execution` batches read.
    """
    if isinstance(iterator, (ResolvingIterator, EpochView)):
        return iterator.resolve()
    return iterator


def _read_to_end(iterator):
    """Reads what `iterator` still yields, up to its end."""
    while True:
        try:
            next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            return


class LongLivedIterator:
    """The one real iterator of a pipeline spanning a call's epochs.

    Args:
        pipeline: The long-lived pipeline (`epochs` epochs of `batches`).
        batches: The batches of one epoch.
        epochs: The epochs it spans: Keras may read fewer, never more.
            None: as many as Keras reads (a source of free passes, which
            a new iterator can start at any epoch).
        made: `made(seconds)`, told how long each real iterator took.
        steps_per_execution: The batches each call of the compiled step
            reads (the model's `steps_per_execution`; it divides
            `batches`).
        start: The source's first-epoch variable (see
            `long_lived_source`) if its epochs are independent of one
            another, so an iterator can start at any of them, or if
            `stop` is given; else None.
        stop: The source's end-epoch variable (see `long_lived_source`)
            for a source that draws per iterator on an adaptive `pool`:
            its first epoch reads an iterator that ends with it, and the
            later ones one more, made on the pool sized from the first
            epoch (its draws are the next ones, as plain Keras's next
            iterator's). Else None.
        single_epochs: With `stop`, a function telling whether the next
            iterator must also end with its epoch (while an `EpochSwitch`
            may still run an epoch without the stage: `skip_epoch`), or
            None.
        order: With `stop`, the call's `DrawOrder`, which an iterator of
            the epochs run without the stage is read to its end in before
            this makes one.
        fed: The `epoch_sources.FedSource` the pipeline reads, or None. Its
            iterator reads the passes the calls fed (Keras may read fewer,
            never more), and no new one starts at any epoch: it would read
            the same queue of passes.
        ordinal: The staged random layers' count of numbered elements
            (`StageSplit.ordinal`), when the pipeline numbers them without
            writing it (`StageSplit.number(writes=False)`), else None. Its
            iterator reads ahead of Keras by as much as its threads got
            to, so the count is kept here, from what Keras took: the next
            element a new iterator numbers is the one after those, as
            with an iterator per epoch read to its end.
        pool: The stage's `StagePool`, or None.
        name: The stage's name, for messages.
    """

    def __init__(
        self,
        pipeline,
        batches,
        epochs,
        made,
        steps_per_execution=1,
        start=None,
        ordinal=None,
        pool=None,
        name="stage",
        stop=None,
        single_epochs=None,
        order=None,
        fed=None,
    ):
        self._pipeline = pipeline
        self.batches = int(batches)
        self.epochs = None if epochs is None else int(epochs)
        self.steps_per_execution = int(steps_per_execution)
        self.made = made
        self._start = start
        self._stop = stop
        self._single_epochs = single_epochs
        self._order = order
        self._fed = fed
        # Whether a new iterator can start at any epoch.
        self.restartable = fed is None and restarts_anywhere(
            start, epochs, stop
        )
        # With `stop`: the epoch the real iterator ends before.
        self._segment_end = None
        self._pool = pool
        self._name = name
        self._ordinal = ordinal
        # `ordinal`'s value less the batches read when first made.
        self._ordinal_origin = None
        # The real iterator, in a list a finalizer can hand to `release`.
        self._box = [None]
        self._pool_size = None  # the pool size it was made on
        self._view = None  # the view Keras reads now
        self.read_batches = 0  # batches Keras took (or was skipped past)
        self.closed = False
        self.iterators_made = 0
        # The `EpochPipeline` of each pipeline read through this iterator.
        self._epoch_pipelines = {}

    @property
    def _iterator(self):
        return self._box[0]

    @_iterator.setter
    def _iterator(self, iterator):
        self._box[0] = iterator

    def epoch_pipeline(self, pipeline):
        """The `EpochPipeline` Keras reads `pipeline`'s epochs through.

        Built once: a later call reading on from this iterator builds no
        dataset (its `take` and cardinality ops cost a call's worth of
        eager ops).
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
            # Keras left the last epoch early (plain Keras would drop that
            # iterator): the next starts where a fresh one would.
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
            # The adaptive pool was resized for this epoch: a new iterator
            # runs on it (an iterator's pool is fixed when it is made).
            self._iterator = None
        if self._iterator is not None and self._segment_end is not None:
            if self.epoch >= self._segment_end:
                # Its iterator ended with the last epoch: the next runs on
                # another, on the pool as sized now (see `_end_segment`).
                self._end_segment()
        if self._iterator is None:
            self._make()

    def next_epoch_reads_on(self):
        """Whether the next epoch reads on from the real iterator.

        Where it does, a pool resized for it makes a new iterator the call
        would not have made; where it does not (none yet, its segment ends,
        or a source that cannot restart, whose iterator keeps its pool), a
        resize makes none.
        """
        return (
            self._iterator is not None
            and self.restartable
            and (self._segment_end is None or self.epoch < self._segment_end)
        )

    def skip_epoch(self):
        """Keras reads the next epoch elsewhere (without the stage).

        Only for a source whose epochs can start on a new iterator
        (`start`): the real iterator is dropped (nothing of it runs on),
        and the epoch after starts a new one past the skipped epoch.
        """
        if not self.restartable and self._stop is None:
            raise RuntimeError(
                f"Stage '{self._name}': an epoch of a long-lived source that "
                "cannot start at any epoch cannot be skipped."
            )
        self.read_batches += -self.read_batches % self.batches  # its end
        if self._limit is not None and self.epoch >= self._limit:
            raise RuntimeError(
                f"Stage '{self._name}' was built for {self._limit} epochs "
                "on one iterator, and Keras began one more."
            )
        if self._iterator is not None and self._segment_end is not None:
            if self._segment_end > self.epoch:
                raise RuntimeError(
                    f"Stage '{self._name}': epoch {self.epoch} runs on an "
                    "iterator of the stage's draws, and cannot be skipped."
                )
            self._end_segment()
        self.read_batches += self.batches
        self._iterator = None
        self._view = None

    def _end_segment(self):
        """Reads the real iterator to its end (`stop`), then drops it.

        Its last pass makes the unread iterator plain Keras makes at its
        end: read to its end, that pass has taken its draws before the
        next iterator's first pass takes the next, whenever its threads
        would have got there.
        """
        _read_to_end(self._iterator)
        self._iterator = None

    def _make(self):
        self._iterator = None  # the one it replaces goes first
        if self._start is not None:
            self._start.assign(self.epoch)
        if self._stop is not None:
            if self._order is not None:
                self._order.finish()  # an epoch read without the stage
            single = self.epoch == 0 or (
                self._single_epochs is not None and self._single_epochs()
            )
            self._segment_end = self.epoch + 1 if single else self.epochs
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
        """Whether its iterator runs on into a next epoch, read from its start.

        So what it holds belongs to the epoch a later call reads first.
        """
        return (
            not self.closed
            and self._iterator is not None
            and self.read_batches % self.batches == 0
            and (self._fed is None or self._fed_read())
        )

    def _fed_read(self):
        """Whether it read every pass fed, on the pool as sized now.

        Passes fed and not read are not the next call's; and its pool was
        fixed when it was made, so a pool resized since (grown after an
        epoch that kept the step waiting) runs in a stage built anew.
        """
        return self.epoch == self._fed.passes and (
            self._pool is None or self._pool.size == self._pool_size
        )

    def _count_taken(self):
        """Sets `ordinal` to the elements Keras took (see the Args)."""
        if self._ordinal_origin is not None:
            self._ordinal.assign(self._ordinal_origin + self.read_batches)

    def detach(self):
        """Ends a call without dropping the iterator (see "Across calls").

        The next view read begins an epoch: the next pass, or a new
        iterator if the call left its epoch early. From now on the real
        iterator is never deleted in the thread that drops this object
        (its teardown can wait on a thread running the staged Python, a
        `tf.py_function`, that waits for the interpreter lock), and is
        dropped before the interpreter exits (`_close_running_on`).
        """
        self._view = None
        self._count_taken()
        if self not in _running_on:
            _running_on.add(self)
            weakref.finalize(self, _release_box, self._box, self._fed)

    def close(self):
        """Drops the real iterator; nothing of it runs any more.

        Its pipeline is torn down on another thread (`release`); the
        stage's gate, closed first by `StagedData.end_call`, keeps any
        element it still finishes out of the stage's counts.

        Returns:
            The thread that drops it (None once the interpreter exits).
        """
        self.closed = True
        self._count_taken()
        _running_on.discard(self)
        if self._fed is not None:
            # Its source's wait for passes ends: nothing else is fed.
            self._fed.close()
        held, self._iterator = [self._iterator], None
        self._view = None
        return release(held)


class EpochView:
    """The iterator Keras gets for one epoch of a long-lived pipeline.

    It reads the shared `LongLivedIterator`: the step guard's `resolve`
    hands the compiled step that iterator, and Keras's Python reads
    (`next`) read it. Python reads end with its epoch, as a fresh
    iterator of one epoch ends: a reader that reads ahead (Keras's JAX
    trainer reads the batch after the one it hands the step, to start its
    copy to the device) then gets the end, not the next epoch's first
    batch.
    """

    def __init__(self, shared, element_spec):
        self._shared = shared
        self._element_spec = element_spec
        self._python_reads = 0

    def resolve(self):
        """The real iterator, for one call of the compiled step."""
        return self._shared.read(self, self._shared.steps_per_execution)

    def __iter__(self):
        return self

    def _read_one(self):
        if self._python_reads >= self._shared.batches:
            return None  # the epoch's end
        self._python_reads += 1
        return self._shared.read(self, 1)

    def __next__(self):
        iterator = self._read_one()
        if iterator is None:
            raise StopIteration
        return next(iterator)

    def get_next(self):
        iterator = self._read_one()
        if iterator is None:
            raise tf.errors.OutOfRangeError(None, None, "End of sequence")
        return iterator.get_next()

    @property
    def element_spec(self):
        return self._element_spec


class EpochPipeline(EagerIterated):
    """One epoch of a long-lived pipeline, as Keras sees it.

    Its cardinality is one epoch's batches (Keras's count of an epoch); its
    eager iterators are `EpochView`s of the shared `LongLivedIterator`.
    Used as a dataset otherwise (inside a `tf.function`, transformed) it is
    the long-lived pipeline's first epoch.
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


class DistributedEpochView(EpochView):
    """An `EpochView` of a distributed long-lived iterator.

    Under a strategy Keras reads one batch in Python from the first
    iterator of each `fit` and `evaluate`, then drops it
    (`_maybe_symbolic_build` in Keras's TensorFlow trainer), to build what
    is unbuilt from its shapes and dtypes; the staged call has built all of
    it already (`TensorFlowBackend.build`). A read from the shared
    iterator would take the epoch's first batch from the step, so a view's
    first Python read, before any step read it, is that peek: it gets a
    batch of zeros of `spec` (one replica's structure, no batch rows) and
    reads nothing. Reads after it read the shared iterator.
    """

    def __init__(self, shared, element_spec, spec):
        super().__init__(shared, element_spec)
        self._spec = spec
        self._peeked = False
        self._stepped = False

    def resolve(self):
        self._stepped = True
        return super().resolve()

    def _peek(self):
        if self._peeked or self._stepped or self._python_reads:
            return None
        self._peeked = True
        return tf.nest.map_structure(_empty_batch, self._spec)

    def __next__(self):
        peeked = self._peek()
        return super().__next__() if peeked is None else peeked

    def get_next(self):
        peeked = self._peek()
        return super().get_next() if peeked is None else peeked


def _empty_batch(spec):
    """A value of `spec` with no rows (a `None` dimension as 0).

    A composite spec (ragged, sparse) stands for itself: Keras's peek reads
    only shapes and dtypes, which specs have.
    """
    if not isinstance(spec, tf.TensorSpec):
        return spec
    shape = [0 if dim is None else dim for dim in spec.shape.as_list()]
    if spec.dtype == tf.string:
        return tf.fill(shape, "")
    return tf.zeros(shape, spec.dtype)


class DistributedEpochPipeline(tf.distribute.DistributedDataset):
    """One epoch of a long-lived distributed pipeline, as Keras sees it.

    Under a strategy of several replicas Keras takes a distributed dataset
    as it is and makes its iterators with `iter`: they are
    `DistributedEpochView`s of the shared `LongLivedIterator`, whose real
    iterator is one iterator of the distributed pipeline. Keras takes it
    wrapped in its dataset adapter (`_compat.distributed_dataset_adapter`).
    """

    def __init__(self, shared, distributed, spec):
        self._shared = shared
        self._distributed = distributed
        self._spec = spec  # one replica's batch (see `DistributedEpochView`)

    def __iter__(self):
        return DistributedEpochView(
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
