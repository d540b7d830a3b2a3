"""A call's staged data: what it asks (`StageRequest`), and the `StagedData`
`build` stages from the `EpochSource` its input type's adapter made through
Keras's own data adapter (a staged run sees plain Keras's batches, in order).
"""

import dataclasses
import functools
import logging

import tensorflow as tf

from keras_stage import _compat
from keras_stage.data import source_passes
from keras_stage.models.data_adapters import epoch_plans, served
from keras_stage.models.iterators.kept_iterators import (
    CallIterators,
    KeptStage,
    kept_stage,
)

logger = logging.getLogger("keras_stage")


@dataclasses.dataclass(frozen=True)
class StageRequest:
    """What one call asks of its stage (see `data_adapters.stage_data`).

    Attributes:
        layer, phase: The model's `StagedInput`; the compiled step that
            reads the stage ("train", "test", "predict").
        x, y, sample_weight, batch_size, steps, shuffle, class_weight: the
            call's, as Keras's data adapter takes them (`steps`: its
            `steps_per_epoch` or `steps`).
        split: The SmartStage split whose prefix the stage runs, or None.
        stats: The stats the compiled step records its fetches in, or None.
        strategy: Under several replicas, the pipeline is distributed.
        epochs: The most times Keras iterates the pipeline in this call, or
            None; see `epoch_plans.plan`.
        steps_per_execution: The model's.
        alongside: The call's other data (a fit's validation, and back).
        kept: The model's kept stages by role (updated), or None.
        reads_in_python: Whether Keras reads every batch in Python.
        pool_start: The threads a new adaptive pool starts with, or None
            for the backend's.
        feedable: Whether the stage may read a fed source (`FedSource`).
        backend, role, costs: The model's `Backend`; the stage's name and
            key among the kept ("train", "val", "test", "predict"); the
            call's `StageCosts`, or None.
        overrides: What the tf.data service changes of the stage's options
            for the phase (`served.phase_overrides`).
    """

    layer: object
    phase: str
    x: object
    y: object = None
    sample_weight: object = None
    batch_size: object = None
    steps: object = None
    shuffle: object = False
    class_weight: object = None
    split: object = None
    stats: object = None
    strategy: object = None
    epochs: object = None
    steps_per_execution: int = 1
    alongside: tuple = ()
    kept: object = None
    reads_in_python: bool = False
    pool_start: object = None
    feedable: bool = True
    backend: object = None
    role: object = None
    costs: object = None
    overrides: dict = dataclasses.field(default_factory=dict)

    @property
    def served(self):
        """Whether the stage runs on the tf.data service."""
        service = self.layer.stage_options.service
        return self.overrides.get("service", service) is not None

    @property
    def distributed(self):
        """Whether a strategy of several replicas distributes the stage."""
        strategy = self.strategy
        return strategy is not None and strategy.num_replicas_in_sync > 1

    def keras_adapter(self, x=None):
        """Keras's own data adapter of the call's data (`x` if given)."""
        return _compat.get_data_adapter(
            x=self.x if x is None else x,
            y=self.y,
            sample_weight=self.sample_weight,
            batch_size=self.batch_size,
            steps_per_epoch=self.steps,
            shuffle=self.shuffle,
            class_weight=self.class_weight,
        )


@dataclasses.dataclass(eq=False)
class EpochSource:
    """One epoch of a call's data, as its input type's adapter gives it.

    Attributes:
        dataset: One epoch as Keras would iterate it, or its row-index
            batches where `gather` (an `ArrayBatches`) is given.
        arrays: `(x, y, sample_weight)` of in-memory arrays, else None.
        keeps: Whether the model may keep its stage for later calls.
        long_lived: Whether its epochs may run on one iterator.
    """

    dataset: object
    arrays: object = None
    gather: object = None
    keeps: bool = False
    long_lived: bool = True


def distribute_inputs(strategy, pipeline, options):
    """`pipeline` distributed by `strategy`; replicas buffer on their devices.

    TF's per-replica prefetch holds `capacity` elements (1 for `"auto"`);
    `device="cpu"` keeps the replicas' inputs on the host.
    """
    on_device = options.device != "cpu"
    input_options = tf.distribute.InputOptions(
        experimental_fetch_to_device=on_device,
        experimental_per_replica_buffer_size=(
            options.capacity if isinstance(options.capacity, int) else 1
        ),
    )
    return strategy.experimental_distribute_dataset(pipeline, input_options)


@dataclasses.dataclass(eq=False)
class StageCosts:
    """A call's record of what its stage costs (see `call.measure.staged_data`).

    Attributes:
        cost_phase: The phase the costs are noted for, or None.
        on_iterator: Told the seconds each iterator took to make, or None.
        step_clock: The list the step's host times go to, or None.
    """

    cost_phase: object = None
    on_iterator: object = None
    step_clock: object = None

    def made(self, seconds):
        if self.on_iterator is not None:
            self.on_iterator(seconds)


class StagedData:
    """A staged dataset and the Keras adapter whose epochs feed it.

    Built whole by an adapter (`build`); what varies during the call is
    `iterators` (a `CallIterators`) and the record `costs`.
    """

    def __init__(
        self,
        staged,
        adapter,
        split=None,
        element_spec=None,
        in_step=False,
        owned=True,
        strategy=None,
        defers=False,
        epochs=None,
        kept=None,
        carried=False,
        long_lived_refusal=None,
        source=None,
        costs=None,
    ):
        self.staged = staged
        self.adapter = adapter
        self.strategy = strategy  # the one distributing the pipeline
        self.owned = owned  # built for this call, not a user's staged dataset
        self.split = split  # the SmartStage split the stage runs, or None
        self.element_spec = element_spec  # the model's inputs' structure
        staged.runner.records_in_step = in_step
        # Whether Keras gets iterators made when first read (see
        # `DeferredPipeline`): only where a new iterator draws nothing.
        self.defers = defers
        self.kept = kept  # the model's `KeptStage` this runs, or None
        self._source = source  # see `source`
        # Why the call's epochs do not share one iterator, or None.
        self.long_lived_refusal = long_lived_refusal
        # Whether the call reads on from the iterator an earlier call left:
        # what the stage holds when the call begins is its first epoch's.
        self.carried = carried
        self.costs = StageCosts() if costs is None else costs
        self.cost_phase = self.costs.cost_phase
        self.step_clock = self.costs.step_clock
        snapshot = staged.stats.snapshot()
        self.work_before = (snapshot["busy_seconds"], snapshot["produced"])
        # `epochs`: the `LongLivedEpochs` of the call's epochs, or None.
        self.iterators = CallIterators(self, epochs)

    @property
    def source(self):
        """One epoch of the source, as Keras would iterate it, or None
        (given as a dataset, or a function building it when first read)."""
        if callable(self._source):
            self._source = self._source()
        return self._source

    @property
    def in_step(self):
        """Whether the compiled step records the fetches (see StageStats)."""
        return self.staged.runner.records_in_step

    @property
    def epochs(self):
        """The epochs the stage runs on one iterator, or None."""
        plan = self.iterators.plan
        return None if plan is None else plan.epochs

    @property
    def long_lived(self):
        """Whether the stage runs the call's epochs on one iterator."""
        return self.iterators.plan is not None

    def _made(self, seconds):
        self.costs.made(seconds)

    @property
    def pipeline(self):
        """What the compiled step iterates (see `CallIterators`)."""
        return self.iterators.compiled_dataset()

    @property
    def eager_dataset(self):
        """What Keras reads in Python (predict; every phase on JAX)."""
        return self.iterators.eager_dataset()

    @property
    def epochs_restartable(self):
        """Whether any epoch can start on a new iterator."""
        plan = self.iterators.plan
        return plan is None or plan.restartable

    def end_call(self):
        """Ends the call's iterators (see `CallIterators.end_call`)."""
        return self.iterators.end_call()

    def distribute(self, pipeline):
        """`pipeline` under the strategy, replicas buffering on devices."""
        return distribute_inputs(
            self.strategy, pipeline, self.staged.stage_options
        )


def _counted(request, dataset, num_batches):
    """`dataset` asserting Keras's batch count where it does not carry it:
    only where no batch can be skipped or served elsewhere."""
    if (
        num_batches is None
        or dataset.cardinality() != tf.data.UNKNOWN_CARDINALITY
        or request.layer.stage_options.ignored_exception_types
        or request.served
    ):
        return dataset
    return dataset.apply(tf.data.experimental.assert_cardinality(num_batches))


def _staged_fn(request, gather, numbered):
    """The function the stage maps: the split's prefix (after the gather of
    array rows, if any), or None."""
    split = request.split
    if split is None:
        return None
    fn = split.stage_fn(training=request.phase == "train")
    if gather is not None:
        fn = gather.staged_fn(fn, numbered=numbered)
    return fn


def _new_stage(request, source, long_lived, fn, numbered, overrides):
    """A new stage of the call: over `long_lived`'s source, or else
    `source` (one epoch)."""
    r, options = request, request.layer.stage_options
    dataset = source if long_lived is None else long_lived.source
    if numbered:
        # Only for a new stage: `number`'s scan is traced as it is made.
        dataset = r.split.number(dataset, writes=long_lived is None)
    return r.layer.stage(
        dataset,
        fn=fn,
        name=f"{options.name}_{r.role}",
        stats=r.stats,
        consumer_records=r.stats is not None or r.reads_in_python,
        # On JAX, Keras's trainer copies each batch to the device.
        distributed=r.distributed or not r.backend.uses_device_buffer,
        unpacks=True,
        reads_in_python=r.reads_in_python,
        pool_start=(
            r.backend.pool_start(options)
            if r.pool_start is None
            else min(r.pool_start, options.most_pool_size())
        ),
        **overrides,
    )


def build(request, adapter, epoch):
    """The `StagedData` of `request`'s call, from its Keras `adapter` and
    the `EpochSource` its input type's adapter made."""
    r = request
    overrides = dict(r.overrides)
    num_batches = adapter.num_batches
    if num_batches is None:
        num_batches = r.backend.shard_batches(r.x)
    source = _counted(r, epoch.dataset, num_batches)  # one epoch, to stage
    if r.served:
        served.note_data(
            r, overrides, adapter, source, epoch.arrays, num_batches
        )
    keeps = r.kept is not None and epoch.keeps
    # Whether a kept stage's iterator may outlive the call: not with
    # `steps` (Keras's epochs end where the data does, not a repeat).
    spans_calls = r.epochs is not None and r.steps is None and keeps
    long_lived, refusal = None, None
    if r.epochs is not None:
        long_lived, refusal = epoch_plans.plan(
            r, epoch, source, num_batches, spans_calls
        )
    gather = epoch.gather
    numbered = r.split is not None and r.split.numbers(r.phase == "train")
    if numbered and long_lived is not None:
        # Its iterator reads ahead of Keras: it keeps the count itself.
        long_lived.ordinal = r.split.ordinal
    fn = _staged_fn(r, gather, numbered)
    call_plan = long_lived  # a kept stage's replaces it below
    entry = None
    if keeps:
        wanted = KeptStage(r, num_batches, fn, long_lived, overrides, source)
        entry = kept_stage(r.kept, r.role, wanted, r.split)
    carried = False
    if entry is not None and entry.staged is not None:
        staged = entry.staged
        staged.runner.open_gate()
        long_lived = entry.long_lived  # what `staged` was built on
        carried = entry.carries()
    else:
        staged = _new_stage(r, source, long_lived, fn, numbered, overrides)
        if entry is not None:
            entry.staged = staged
            r.kept[r.role] = entry
    if long_lived is not None and long_lived.feeds:
        long_lived.fed.feed(source, r.epochs, call_plan.opens)
    if r.split is not None:
        staged.runner.staged_layers = tuple(r.split.plan.staged_layers)
    if r.epochs is not None:
        logger.debug(
            "%s: %s",
            staged.name,
            "its epochs on one iterator, run on across calls"
            if long_lived is not None and long_lived.epochs is None
            else f"{int(r.epochs)} epochs on one iterator"
            if long_lived is not None
            else f"an iterator per epoch: {refusal}",
        )
    if entry is not None:
        entry.in_use = True
    return StagedData(
        staged,
        adapter,
        r.split,
        (gather or source).element_spec,  # before the stage
        in_step=r.stats is not None,
        strategy=r.strategy if r.distributed else None,
        defers=epoch.arrays is not None
        or (
            epoch.keeps
            and not source_passes.inspect_source(source).iterator_draws
        ),
        epochs=long_lived,
        kept=entry,
        carried=carried,
        long_lived_refusal=refusal,
        # Index batches when gathered: the gathered ones are built if read.
        source=source
        if gather is None
        else functools.partial(gather.dataset, source),
        costs=r.costs,
    )
