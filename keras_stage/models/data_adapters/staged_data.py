"""Turning the data of fit/evaluate/predict into a staged dataset.

`stage_data` takes what users pass to Keras (arrays, `tf.data` datasets,
generators, `keras.utils.PyDataset`) through Keras's own data adapter, so a
staged run sees plain Keras's batches in the same order, and stages them.
"""

import functools
import logging
import weakref

import keras
import tensorflow as tf

from keras_stage import _compat
from keras_stage.data import source_passes
from keras_stage.data.epochs import FedSource, LongLivedEpochs
from keras_stage.data.service import DISTRIBUTED_EPOCH
from keras_stage.data.staging import StagedDataset
from keras_stage.data.stats import op_determinism_enabled
from keras_stage.models import backends
from keras_stage.models.backends.tensorflow import default_strategy
from keras_stage.models.data_adapters import arrays, datasets, python_sources
from keras_stage.models.data_adapters.python_sources import (
    check_source,
    is_python_source,
)
from keras_stage.models.iterators.kept_iterators import (
    CallIterators,
    KeptStage,
    earlier_stage,
    kept_stage,
    switched_data,
)

logger = logging.getLogger("keras_stage")


_WARNED_ONE_SPLIT = weakref.WeakSet()


def _warn_one_split(layer, overrides):
    """Warns, once per layer, that arrays give the service one split.

    Keras's dataset of arrays starts from `Dataset.range(1)`: in
    `"distributed_epoch"` mode one worker computes the whole epoch.
    """
    mode = overrides.get("processing_mode", layer.stage_options.processing_mode)
    if mode != DISTRIBUTED_EPOCH or layer in _WARNED_ONE_SPLIT:
        return
    _WARNED_ONE_SPLIT.add(layer)
    logger.warning(
        "StagedInput '%s': with arrays, Keras's dataset is one tf.data "
        "service split per epoch, so in 'distributed_epoch' mode a single "
        "worker computes each whole epoch. To share an epoch among the "
        "workers, pass a tf.data.Dataset that starts from "
        "from_tensor_slices and shuffles after it, e.g. "
        "tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024).batch(32) "
        "(each worker shuffles its share in a buffer of 1024).",
        layer.name,
    )


def _service_overrides(layer, phase, python_source):
    """How a phase uses the tf.data service `layer` names.

    `predict` stages in this process (the service's order is the workers');
    evaluation reads each example once whatever the training mode.
    """
    options = layer.stage_options
    if phase == "predict":
        logger.info(
            "StagedInput '%s': predict stages in this process, not on the "
            "tf.data service at %s, so that predictions keep the order of "
            "the inputs.",
            layer.name,
            options.service,
        )
        return {"service": None}
    if python_source:
        raise ValueError(
            f"StagedInput '{layer.name}' stages on the tf.data service at "
            f"{options.service}, whose workers cannot run this process's "
            "Python: a generator or keras.utils.PyDataset cannot be sent "
            "there. Pass a tf.data.Dataset (e.g. built with "
            "tf.data.Dataset.from_tensor_slices or list_files) or arrays, "
            "or remove `service` from the StagedInput."
        )
    if phase != "train":
        return {"processing_mode": DISTRIBUTED_EPOCH}
    return {}


def _batch_size(adapter, dataset):
    """The batch size to restore after the service, or None if unknown.

    Each service worker batches its own share of an epoch, so the batch
    count varies between epochs, while Keras takes every epoch's count from
    the first: the trainer re-forms full batches (`Dataset.rebatch`).
    """
    size = adapter.batch_size
    if size is None:
        # Without a static batch size, the source's first batch says.
        for element in dataset.take(1):
            size = tf.nest.flatten(element)[0].shape[0]
    return None if size is None else int(size)


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


class StageCosts:
    """A call's record of what its stage costs (see `call.measure.staged_data`).

    Args:
        cost_phase: The phase the costs are noted for, or None.
        on_iterator: Told the seconds each iterator took to make, or None.
        step_clock: The list the step's host times go to, or None.
    """

    def __init__(self, cost_phase=None, on_iterator=None, step_clock=None):
        self.cost_phase = cost_phase
        self.on_iterator = on_iterator
        self.step_clock = step_clock

    def made(self, seconds):
        if self.on_iterator is not None:
            self.on_iterator(seconds)


class StagedData:
    """A staged dataset and the Keras adapter whose epochs feed it.

    Built whole by `stage_data`; what varies during the call is `iterators`
    (a `CallIterators`) and the record `costs`.
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
        # Built for this call (not the user's own staged dataset).
        self.owned = owned
        self.split = split  # the SmartStage split the stage runs, or None
        # The structure of the data before the stage (the model's inputs).
        self.element_spec = element_spec
        staged.runner.records_in_step = in_step
        # Whether Keras gets iterators made when first read (see
        # `DeferredPipeline`): only where a new iterator draws nothing.
        self.defers = defers
        self.kept = kept  # the model's `KeptStage` this runs, or None
        self._source = source  # see `source`
        # Why `stage_data(epochs=...)` kept an iterator per epoch, or None.
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
        return self.iterators.restartable

    def end_call(self):
        """Ends the call's iterators (see `CallIterators.end_call`)."""
        return self.iterators.end_call()

    def distribute(self, pipeline):
        """`pipeline` under the strategy, replicas buffering on devices."""
        return distribute_inputs(
            self.strategy, pipeline, self.staged.stage_options
        )


def _draws_per_iterator(dataset, spans_calls):
    """Whether a new iterator of `dataset` cannot start at any epoch."""
    facts = source_passes.inspect_source(dataset)
    return facts.iterator_draws and not (spans_calls and facts.free_passes)


def strategy_refusal(strategy, dataset=None):
    """Why Keras's iterators under `strategy` cannot be views of one.

    None under the default strategy, and under several replicas unless
    `dataset` (the stage's source, if known) draws from a seed per iterator
    (Keras's peek at each call's start would take a draw).
    """
    if default_strategy(strategy):
        return None
    if strategy.num_replicas_in_sync < 2:
        return (
            "Keras distributes the data with a tf.distribute strategy of one "
            "replica"
        )
    if not isinstance(dataset, tf.data.Dataset):
        return None
    facts = source_passes.inspect_source(dataset)
    if facts.iterator_draws and not facts.free_passes:
        return (
            "under a tf.distribute strategy Keras makes one more iterator a "
            "call, which takes one of the dataset's seeded draws (its "
            "shuffle's orders follow the iterators made)"
        )
    return None


def epochs_refusal(
    layer,
    phase,
    num_batches,
    steps,
    epochs,
    steps_per_execution,
    served,
    spans_calls=False,
):
    """Why Keras's reads of the call's epochs cannot share one iterator.

    None when Keras reads exactly `num_batches` batches from each iterator,
    in whole calls of the compiled step. `spans_calls`: whether the
    iterator may outlive the call (then one epoch is enough).
    """
    options = layer.stage_options
    if epochs < 2 and not spans_calls:
        return "the call reads one epoch"
    if phase == "predict" and not spans_calls:
        return "predict reads one epoch"
    if num_batches is None:
        return "the batch count of an epoch is not known"
    if served:
        return "the stage runs on the tf.data service"
    if options.ignored_exception_types:
        return "the stage can skip batches (ignored_exception_types)"
    if tuple(options.closed_exception_types) != (tf.errors.OutOfRangeError,):
        return "an error can end an epoch early (closed_exception_types)"
    if keras.config.max_steps_per_epoch():
        return "keras.config.max_steps_per_epoch caps the epochs"
    if num_batches % steps_per_execution:
        return (
            f"steps_per_execution={steps_per_execution} does not divide the "
            f"{num_batches} batches of an epoch"
        )
    if phase != "train" and steps is not None and steps < num_batches:
        return "each evaluation reads only part of the data (steps)"
    return None


def _long_lived_epochs(
    phase,
    epoch,
    dataset,
    num_batches,
    steps,
    epochs,
    steps_per_execution,
    alongside,
    unread_opens,
    spans_calls=False,
    first_alone=False,
    fed=False,
):
    """`(LongLivedEpochs, None)`, or `(None, why not)`, for a safe stage.

    `epoch`: the call's `EpochSource`. `spans_calls`: whether the iterator
    may outlive the call. `first_alone`: whether the first epoch reads an
    iterator of its own (a drawing dataset on an adaptive pool). `fed`:
    whether the source is fed each call's passes (`FedSource`).
    """
    if not epoch.long_lived:
        return None, "the data is not in-memory arrays or a tf.data.Dataset"
    arrays = epoch.arrays
    facts = source_passes.inspect_source(dataset)
    if facts.refusal is not None:
        return None, f"its source cannot be read ahead: {facts.refusal}"
    if spans_calls and fed and not facts.kernel_seeded:
        return _fed_epochs(
            dataset,
            facts,
            alongside,
            num_batches,
            steps_per_execution,
            unread_opens,
        )
    if spans_calls and facts.free_passes:
        # Any pass stands for a fresh iterator's.
        return LongLivedEpochs(
            None,
            num_batches,
            steps_per_execution,
            None,
            functools.partial(source_passes.long_lived_source, dataset, None),
        ), None
    if epochs < 2:
        return None, "the call reads one epoch"
    replay = False
    if facts.kernel_seeded:
        if arrays is None:
            return None, (
                "its source has a seeded stateful random op, which draws "
                "the same in every new iterator"
            )
        size = source_passes.nbytes(arrays)
        if size is None or size > source_passes.REPLAY_LIMIT_BYTES:
            return None, (
                "a seeded shuffle of arrays replays its first epoch, kept in "
                f"memory, and these arrays are over "
                f"{source_passes.REPLAY_LIMIT_BYTES // 2**20} MiB"
            )
        replay = True
    if arrays is None and _shares_a_dataset(facts, alongside):
        return None, _SHARED_DRAWS
    start = stop = None
    independent = arrays is not None or not facts.iterator_draws
    # Not under op determinism: a variable read in the pipeline would make
    # tf.data run all of it one element at a time.
    if independent and not op_determinism_enabled():
        # Epochs that depend on no earlier iterator: one can start at any.
        with tf.init_scope(), tf.device("/CPU:0"):
            start = tf.Variable(0, dtype=tf.int64, trainable=False)
    elif first_alone:
        with tf.init_scope(), tf.device("/CPU:0"):
            start = tf.Variable(0, dtype=tf.int64, trainable=False)
            stop = tf.Variable(1, dtype=tf.int64, trainable=False)
    opens = 0 if independent or (phase == "train" and steps) else unread_opens
    source = functools.partial(
        source_passes.long_lived_source,
        dataset,
        epochs,
        replay=replay,
        opens=opens,
        start=start,
        stop=stop,
    )
    plan = LongLivedEpochs(
        epochs,
        num_batches,
        steps_per_execution,
        start,
        source,
        stop=stop,
        opens=opens,
    )
    return plan, None


_SHARED_DRAWS = (
    "the call also reads another dataset built on the same datasets (their "
    "draws must keep their order)"
)


def _shares_a_dataset(facts, alongside):
    """Whether `facts`' source shares a dataset with one of `alongside`."""
    return any(
        isinstance(other, tf.data.Dataset)
        and facts.objects & source_passes.inspect_source(other).objects
        for other in alongside
    )


def _fed_epochs(
    dataset, facts, alongside, num_batches, steps_per_execution, unread_opens
):
    """`_long_lived_epochs`'s plan of a `FedSource`."""
    opens = 0
    if not facts.free_passes:
        if _shares_a_dataset(facts, alongside):
            return None, _SHARED_DRAWS
        opens = unread_opens  # spans_calls: no steps_per_epoch

    def fed_source():
        plan.fed = FedSource(dataset.element_spec, dataset.options())
        return plan.fed.dataset

    plan = LongLivedEpochs(
        None,
        num_batches,
        steps_per_execution,
        None,
        fed_source,
        opens=opens,
        feeds=True,
    )
    return plan, None


def _already_staged(layer, x, y, sample_weight, split, epochs, costs):
    """The `StagedData` of a dataset the user staged with
    `keras_stage.data.stage`: its own stage, run as it is."""
    if y is not None or sample_weight is not None:
        raise ValueError(
            "When `x` is a staged dataset, pass labels and sample "
            "weights inside it, not as `y`/`sample_weight`. Received: "
            f"y={type(y).__name__}, "
            f"sample_weight={type(sample_weight).__name__}"
        )
    if x.stage_options.get_config() != layer.stage_options.get_config():
        logger.info(
            "`x` is already staged by stage '%s'; its own options are "
            "used, not those of StagedInput '%s'.",
            x.name,
            layer.name,
        )
    if split is not None:
        logger.info(
            "`x` is already staged by stage '%s', so smart_stage cannot "
            "add the model's prefix to it: the whole model runs in the "
            "step for this call.",
            x.name,
        )
    return StagedData(
        x,
        None,
        owned=False,
        long_lived_refusal=None
        if epochs is None
        else "the data is a user's staged dataset",
        costs=costs,
    )


def _serve(layer, overrides, adapter, dataset, arrays, steps):
    """Adds what the tf.data service needs of the call's data to
    `overrides`; `arrays`: the `EpochSource`'s arrays, or None."""
    # Before `split.number`, whose ordinals a peek would consume.
    overrides["rebatch"] = _batch_size(adapter, dataset)
    if arrays is not None:
        if steps is None:
            # The examples of one pass, for the epoch's count of lost ones.
            overrides["per_copy"] = int(tf.nest.flatten(arrays[0])[0].shape[0])
        _warn_one_split(layer, overrides)


def stage_data(
    layer,
    phase,
    x,
    y=None,
    sample_weight=None,
    batch_size=None,
    steps=None,
    shuffle=False,
    class_weight=None,
    split=None,
    stats=None,
    strategy=None,
    epochs=None,
    steps_per_execution=1,
    alongside=(),
    kept=None,
    reads_in_python=False,
    pool_start=None,
    feedable=True,
    backend=None,
    role=None,
    costs=None,
):
    """Stages `x` (with `y`, `sample_weight`) for one call's `phase`.

    Each input type's adapter gives the call's `EpochSource`, which one
    build turns into the `StagedData` the call runs.

    Args:
        layer: The model's `StagedInput` (its options name the stage).
        phase: The compiled step that reads it: "train", "test", "predict".
        x, y, sample_weight, batch_size, steps, shuffle, class_weight: the
            call's, as Keras's data adapter takes them (`steps`: its
            `steps_per_epoch` or `steps`).
        split: The SmartStage split whose prefix the stage runs, or None.
        stats: The stats the compiled step records its fetches in, or None.
        strategy: Under several replicas, `StagedData.pipeline` is
            distributed with each replica's buffer on its device.
        epochs: The most times Keras iterates the pipeline in this call, or
            None. The stage then runs those epochs on one iterator where
            that keeps plain Keras's batches and orders;
            `StagedData.long_lived_refusal` says why not.
        steps_per_execution: The model's (it must divide an epoch's count).
        alongside: The call's other data (a fit's validation for its
            training, and back).
        kept: The model's kept stages by role (updated here), or None.
        reads_in_python: Whether Keras reads every batch in Python.
        pool_start: The threads a new adaptive pool starts with, or None
            for the backend's.
        feedable: Whether the stage may read a fed source (`FedSource`).
        backend: The model's `Backend`; defaults to the running backend's.
        role: The stage's name and key among the kept ("train", "val",
            "test", "predict"); defaults to `phase`.
        costs: The call's `StageCosts` record, or None.
    """
    backend = backends.get() if backend is None else backend
    role = phase if role is None else role
    if isinstance(x, StagedDataset):
        return _already_staged(layer, x, y, sample_weight, split, epochs, costs)
    overrides = {}
    if layer.stage_options.service is not None:
        overrides = _service_overrides(layer, phase, is_python_source(x))
    served = overrides.get("service", layer.stage_options.service) is not None
    adapter = _compat.get_data_adapter(
        x=check_source(x),
        y=y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        steps_per_epoch=steps,
        shuffle=shuffle,
        class_weight=class_weight,
    )
    if isinstance(x, tf.data.Dataset):
        epoch = datasets.epoch_source(adapter)
    elif is_python_source(x):
        epoch = python_sources.epoch_source(adapter)
    else:
        epoch = arrays.epoch_source(
            adapter,
            (x, y, sample_weight),
            shuffle,
            gathers=split is not None,
            served=served,
        )
    dataset = epoch.dataset
    num_batches = adapter.num_batches
    if num_batches is None:
        num_batches = backend.shard_batches(x)
    if (
        num_batches is not None
        and dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
        and not layer.stage_options.ignored_exception_types
        and not served
    ):
        # Keras knows the batch count but the dataset does not carry it;
        # asserted only where no batch can be skipped or served elsewhere.
        dataset = dataset.apply(
            tf.data.experimental.assert_cardinality(num_batches)
        )
    if served:
        _serve(layer, overrides, adapter, dataset, epoch.arrays, steps)
    distributed = strategy is not None and strategy.num_replicas_in_sync > 1
    source = dataset  # one epoch of what the stage stages
    keeps = kept is not None and epoch.keeps
    long_lived, refusal = None, None
    # Whether a kept stage's iterator may outlive the call: not with
    # `steps` (Keras's epochs end where the data does, not a repeat).
    spans_calls = epochs is not None and steps is None and keeps
    if epochs is not None:
        refusal = epochs_refusal(
            layer,
            phase,
            num_batches,
            steps,
            int(epochs),
            int(steps_per_execution),
            served,
            spans_calls=spans_calls,
        )
        if refusal is None:
            refusal = strategy_refusal(strategy, dataset)
        # A resized pool runs only in a new iterator, and a drawing
        # dataset's epochs cannot start one at any epoch: its first epoch
        # reads an iterator of its own and the rest one more, on the pool
        # sized after it. Only a training stage's pool is resized.
        first_alone = (
            refusal is None
            and phase == "train"
            and split is not None
            and layer.stage_options.adaptive_pool
            and epoch.arrays is None
            and _draws_per_iterator(dataset, spans_calls)
        )
        if first_alone and op_determinism_enabled():
            refusal = (
                "the stage's adaptive pool is resized between epochs, and "
                "under op determinism this dataset's epochs cannot move to "
                "a new pool mid-call (it draws from a seed generator per "
                "iterator)"
            )
        if refusal is None:
            # Fed across calls (`FedSource`) once a call of the role came on
            # another dataset object, and a fit's validation from its first
            # call; not a numbered split (its count runs per pipeline), nor
            # under op determinism (a stateful dequeue would make tf.data
            # run the pipeline one element at a time).
            feeds = (
                spans_calls
                and feedable
                and (
                    role == "val" or switched_data(earlier_stage(kept, role), x)
                )
                and not served
                and not distributed
                and not (split is not None and split.numbers(phase == "train"))
                and not op_determinism_enabled()
            )
            long_lived, refusal = _long_lived_epochs(
                phase,
                epoch,
                dataset,
                num_batches,
                steps,
                int(epochs),
                int(steps_per_execution),
                alongside,
                spans_calls=spans_calls,
                first_alone=first_alone,
                fed=feeds,
                unread_opens=backend.unread_opens,
            )
    gather = epoch.gather
    element_spec = (gather or dataset).element_spec
    numbered = split is not None and split.numbers(phase == "train")
    if numbered and long_lived is not None:
        # Its iterator reads ahead of Keras: it keeps the count itself.
        long_lived.ordinal = split.ordinal
    fn = None
    if split is not None:
        fn = split.stage_fn(training=phase == "train")
        if gather is not None:
            fn = gather.staged_fn(fn, numbered=numbered)
    if served:
        mode = overrides.get(
            "processing_mode", layer.stage_options.processing_mode
        )
        if (
            mode == DISTRIBUTED_EPOCH
            and num_batches is not None
            and not layer.stage_options.ignored_exception_types
        ):
            overrides["cardinality"] = num_batches
    call_plan = long_lived  # a kept stage's replaces it below
    entry = None
    if keeps:
        entry = kept_stage(
            kept,
            role,
            KeptStage(
                layer,
                phase,
                x,
                num_batches,
                fn,
                stats,
                long_lived,
                class_weight=class_weight,
                strategy=strategy if distributed else None,
                overrides=overrides,
                call_source=source,
            ),
            split,
        )
    carried = False
    if entry is not None and entry.staged is not None:
        staged = entry.staged
        staged.runner.open_gate()
        long_lived = entry.long_lived  # what `staged` was built on
        carried = entry.carries()
    else:
        if long_lived is not None:
            dataset = long_lived.source
        if numbered:
            # Only for a new stage: `number`'s scan is traced as it is made.
            dataset = split.number(dataset, writes=long_lived is None)
        staged = layer.stage(
            dataset,
            fn=fn,
            name=f"{layer.stage_options.name}_{role}",
            stats=stats,
            consumer_records=stats is not None or reads_in_python,
            # On JAX, Keras's trainer copies each batch to the device.
            distributed=distributed or not backend.uses_device_buffer,
            unpacks=True,
            reads_in_python=reads_in_python,
            pool_start=(
                backend.pool_start(layer.stage_options)
                if pool_start is None
                else min(pool_start, layer.stage_options.most_pool_size())
            ),
            **overrides,
        )
        if entry is not None:
            entry.staged = staged
            kept[role] = entry
    if long_lived is not None and long_lived.feeds:
        long_lived.fed.feed(source, epochs, call_plan.opens)
    if split is not None:
        staged.runner.staged_layers = tuple(split.plan.staged_layers)
    if epochs is not None:
        logger.debug(
            "%s: %s",
            staged.name,
            "its epochs on one iterator, run on across calls"
            if long_lived is not None and long_lived.epochs is None
            else f"{int(epochs)} epochs on one iterator"
            if long_lived is not None
            else f"an iterator per epoch: {refusal}",
        )
    if entry is not None:
        entry.in_use = True
    return StagedData(
        staged,
        adapter,
        split,
        element_spec,
        in_step=stats is not None,
        strategy=strategy if distributed else None,
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
        costs=costs,
    )
