"""The iterator of a role's stage for an epoch, as Keras gets it.

Keras's `EpochIterator` makes an iterator of its dataset each epoch (and one
more as each epoch ends). A staged call (`CallIterators`) hands it
`KeptIterator`s, whose `resolve()` is the real iterator behind: a
`DeferredIterator`, made when first read (one never read costs nothing), or
an `EpochView` of the one `data.epochs.LongLivedIterator` spanning the
call's epochs, which the role's `KeptStage` may keep running across calls.
"""

import time
import weakref

import tensorflow as tf

from keras_stage.data.eager_iterated import EagerIterated
from keras_stage.data.epochs import LongLivedIterator


class KeptIterator:
    """An iterator Keras holds that stands for a real one (`resolve`)."""

    def resolve(self):
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
        if self._iterator is None:
            started = time.perf_counter()
            self._iterator = iter(self._pipeline)
            self._made(time.perf_counter() - started)
        return self._iterator

    @property
    def element_spec(self):
        return self._pipeline.element_spec


class DeferredPipeline(EagerIterated):
    """`pipeline` with `DeferredIterator`s as eager iterators (made at once
    with `defer=False`), each timed by `made`."""

    def __init__(self, pipeline, made, defer=True):
        self._made = made
        self._defer = defer
        super().__init__(pipeline)

    def eager_iter(self):
        iterator = DeferredIterator(self._base, self._made)
        return iterator if self._defer else iterator.resolve()


class EpochView(KeptIterator):
    """The iterator Keras gets for one epoch of a `LongLivedIterator`.

    `resolve` gives the compiled step the shared iterator, for
    `steps_per_execution` batches. Python reads end with the epoch: a
    reader one batch ahead (Keras's JAX trainer) gets the end, not the next
    epoch's first batch. `spec`: under several replicas, one replica's
    batch. Keras reads one batch in Python from each `fit`'s and
    `evaluate`'s first iterator to build the model (the staged call built
    it already): that read, before any step, gets `spec` with no rows.
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

    def _next(self, read, end):
        """A batch read in Python: Keras's peek, or `read` of the shared
        iterator; `end()` is raised at the epoch's end."""
        if not (self._peeked or self._stepped or self._python_reads):
            self._peeked = True
            return tf.nest.map_structure(_empty_batch, self._spec)
        if self._python_reads >= self._shared.batches:
            raise end()
        self._python_reads += 1
        return read(self._shared.read(self, 1))

    def __next__(self):
        return self._next(next, StopIteration)

    def get_next(self):
        return self._next(_get_next, _end_of_sequence)

    @property
    def element_spec(self):
        return self._element_spec


class EpochPipeline(EagerIterated):
    """One epoch of a long-lived pipeline, as Keras sees it: its eager
    iterators are `EpochView`s of the shared iterator."""

    def __init__(self, shared, pipeline):
        self._shared = shared
        super().__init__(
            pipeline.take(shared.batches).apply(
                tf.data.experimental.assert_cardinality(shared.batches)
            )
        )

    def eager_iter(self):
        return EpochView(self._shared, self._base.element_spec)


def _epoch_pipeline(shared, pipeline):
    """`shared`'s `EpochPipeline` of `pipeline`, built once: a later call
    reading on from `shared` builds no dataset."""
    held = shared.epoch_pipelines.get(id(pipeline))
    if held is None or held[0] is not pipeline:
        held = (pipeline, EpochPipeline(shared, pipeline))
        shared.epoch_pipelines[id(pipeline)] = held
    return held[1]


def _get_next(iterator):
    return iterator.get_next()


def _end_of_sequence():
    return tf.errors.OutOfRangeError(None, None, "End of sequence")


def _empty_batch(spec):
    """A value of `spec` with no rows (a `None` dimension as 0); a
    composite spec stands for itself (Keras's peek reads shapes, dtypes)."""
    if not isinstance(spec, tf.TensorSpec):
        return spec
    shape = [0 if dim is None else dim for dim in spec.shape.as_list()]
    if spec.dtype == tf.string:
        return tf.fill(shape, "")
    return tf.zeros(shape, spec.dtype)


class DistributedEpochPipeline(tf.distribute.DistributedDataset):
    """One epoch of a long-lived distributed pipeline, as Keras sees it
    (wrapped by `_compat.distributed_dataset_adapter`): `EpochView`s."""

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
    """What Keras iterates of one role's stage in one call (`data`, its
    `StagedData`): a `DeferredIterator` per epoch (`plan` None), or
    `EpochView`s of one `LongLivedIterator` run as `plan` says."""

    def __init__(self, data, plan=None):
        self._data = data
        self.plan = plan
        self._shared = None  # its `LongLivedIterator`, made when read

    def eager_dataset(self):
        return self._per_epoch(self._data.staged)

    def compiled_dataset(self):
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
            return _epoch_pipeline(self._shared_iterator(pipeline), pipeline)
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

    def end_call(self):
        """Ends the call's iterators, or detaches one that runs on (its
        elements are the next call's); returns the thread tearing down the
        long-lived one, or None. Keras may leave an iterator alive (a
        traceback holds it): the gate keeps its late elements out of the
        stats the next call shares."""
        data, kept = self._data, self._data.kept
        if kept is not None and kept.carries():
            values = variable_values(data.split)
            if values is not None:
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


# How long a call waits for a kept stage's last iterator's teardown.
TEARDOWN_WAIT_SECONDS = 5.0


class KeptStage:
    """A stage a model keeps for its later calls on the same dataset, built
    for the call of `request` (a `StageRequest`): what it depends on is
    held, not only its id (a new object could take it)."""

    def __init__(
        self, request, batches, fn, long_lived, overrides, call_source
    ):
        r = request
        # The strategy only where several replicas distribute the stage.
        strategy = r.strategy if r.distributed else None
        self.objects = (r.layer, r.x, fn, r.stats, strategy)
        self.values = (
            r.phase,
            batches,
            repr(sorted(r.layer.stage_options.get_config().items())),
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
            if r.class_weight is None
            else repr(sorted(dict(r.class_weight).items())),
            repr(sorted(overrides.items())),
        )
        self.long_lived = long_lived  # its `LongLivedEpochs`, or None
        self.call_source = call_source  # one epoch, which a fed call feeds
        # Whether its one iterator outlives calls; that iterator, its
        # pipeline, and the staged layers' variables' values when the last
        # call ended (None: none to compare).
        self.spans_calls = long_lived is not None and long_lived.epochs is None
        self._shared = None
        self._shared_pipeline = None
        self._variables = None
        # The thread tearing down the last call's iterator, or None: a call
        # reusing the stage waits for it before it opens the gate.
        self.released = None
        self.staged = None
        self.in_use = False  # while a call runs it
        self._distributed = None  # `(pipeline, its distributed dataset)`

    def distributed(self, pipeline, distribute):
        """`pipeline` as `distribute(pipeline)` made it, for every call (made
        again, it would rewrite the pipeline for the replicas again)."""
        if self._distributed is None or self._distributed[0] is not pipeline:
            self._distributed = (pipeline, distribute(pipeline))
        return self._distributed[1]

    @property
    def feeds(self):
        """Whether each call feeds its passes to the stage (`FedSource`)."""
        return self.long_lived is not None and self.long_lived.feeds

    def same(self, other, split=None):
        """Whether `other`, wanted by a new call, is this stage (with a kept
        iterator, its buffer computed with the variables' values now)."""
        if self.values != other.values:
            return False
        objects, others = self.objects, other.objects
        if self.feeds:
            # Fed: another dataset of its structure, while it runs on.
            fed = self.long_lived.fed
            if (
                fed is None
                or not self.carries()
                or not fed.accepts(other.call_source)
            ):
                return False
            objects, others = objects[:1] + objects[2:], others[:1] + others[2:]
        if not all(a is b for a, b in zip(objects, others, strict=True)):
            return False
        if self._variables is None or not self.carries():
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

    def carries(self):
        """Whether a call reusing this stage reads on from its iterator (one
        is kept only where the stage spans calls)."""
        return self._shared is not None and self._shared.carries

    def end_call(self, values):
        """Ends a call whose iterator runs on; `values`: the staged layers'
        variables' values now."""
        self._shared.detach()
        self._variables = values
        self.in_use = False

    def drop_iterator(self, ends_source=True):
        """Drops the kept iterator, if any, and (`ends_source`) a fed source,
        whose queue a new iterator would read too."""
        shared, self._shared = self._shared, None
        self._shared_pipeline, self._variables = None, None
        if shared is not None and not shared.closed:
            self.released = shared.close()
        if ends_source and self.feeds and self.long_lived.fed is not None:
            self.long_lived.fed.close()

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
    """The kept stage a call of `role` may run again, or None: its role's;
    for an evaluate with none, a fit's fed validation stage (the same step)
    not in use."""
    earlier = kept.get(role)
    if earlier is None and role == "test":
        val = kept.get("val")
        if val is not None and not val.in_use and val.feeds:
            return val
    return earlier


def switched_data(kept, role, x):
    """Whether a call of `role` on `x` follows calls of its role on other
    datasets: the stage it may run again is fed, or built on another."""
    earlier = earlier_stage(kept, role)
    if earlier is None:
        return False
    return earlier.feeds or earlier.objects[1] is not x


def carries(kept, role, x):
    """Whether a call of `role` on `x` would read on from a kept iterator
    (`kept`: the model's kept stages, or None)."""
    entry = None if kept is None else kept.get(role)
    return (
        entry is not None
        and not entry.in_use
        and entry.objects[1] is x
        and entry.carries()
    )


def kept_stage(kept, role, wanted, split=None):
    """The kept stage a call of `role` runs: an earlier one, `wanted`, or
    None for a stage of its own (nested in the call running the role's
    stage, or its iterator still torn down). `kept`: by role, updated."""
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
