"""Turning the data of fit/evaluate/predict into a staged dataset.

This module owns the step from what users pass to Keras (arrays and dicts
of arrays with `batch_size`/`shuffle`/`class_weight`, `tf.data` datasets,
generators, `keras.utils.PyDataset`) to a `StagedDataset`: Keras's own data
adapter batches and shuffles exactly as plain Keras would, so labels and
sample weights stay aligned with their inputs and a staged run sees the
same batches in the same order.
"""

import logging

import tensorflow as tf

from keras_stage import _compat
from keras_stage.data.service import DISTRIBUTED_EPOCH
from keras_stage.data.staging import StagedDataset
from keras_stage.models.call_costs import in_memory
from keras_stage.models.iterators import DeferredPipeline
from keras_stage.models.sources import check_source, is_python_source

logger = logging.getLogger("keras_stage")


def _service_overrides(layer, phase, python_source):
    """How a phase uses the tf.data service `layer` names.

    `predict` stages in this process: the service returns elements in the
    order the workers finish them, and predictions must follow the inputs.
    Evaluation reads each example once whatever the training mode.
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

    Each service worker batches its own share of an epoch, so an epoch
    ends with up to one partial batch per worker and the batch count
    varies between epochs. Keras takes every epoch's count from the first,
    so a later, longer epoch would lose its last batches: the trainer
    re-forms full batches (`Dataset.rebatch`) to keep the count fixed.
    """
    size = adapter.batch_size
    if size is None:
        # A dataset without a static batch size: its first batch says.
        # Only the source runs (here, once); the staged work is not done.
        for element in dataset.take(1):
            size = tf.nest.flatten(element)[0].shape[0]
    return None if size is None else int(size)


def distribute_inputs(strategy, pipeline, options):
    """`pipeline` distributed by `strategy`; replicas buffer on their devices.

    TF's own per-replica prefetch does the copy: `experimental_fetch_to_device`
    with `capacity` elements per replica (TF's default of 1 for `"auto"`);
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


class StagedData:
    """A staged dataset and the Keras adapter whose epochs feed it."""

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
    ):
        self.staged = staged
        self.adapter = adapter
        # The strategy that distributes the pipeline, or None.
        self.strategy = strategy
        # Built for this call (not the user's own staged dataset).
        self.owned = owned
        # The SmartStage split whose prefix the stage runs, or None.
        self.split = split
        # The structure of the data before the stage (the model's inputs).
        self.element_spec = element_spec
        staged.runner.records_in_step = in_step
        # Whether Keras gets iterators made when first read (see
        # `DeferredPipeline`): only over Keras's own dataset of in-memory
        # arrays, built for this call and drawing its shuffle per
        # iterator. Making an iterator of a user's dataset can change what
        # the next one draws (a seeded `shuffle` shares its seed generator
        # between iterators), so those are made when Keras makes them.
        self.defers = defers
        # Told the seconds each iterator of `pipeline` took to make.
        self.on_iterator = None
        # Set by a consumer that notes the stage's costs (see CallCosts):
        # the phase they are noted for, and the work counters at the start.
        self.cost_phase = None
        self.work_before = None

    @property
    def in_step(self):
        """Whether the compiled step records the fetches (see StageStats)."""
        return self.staged.runner.records_in_step

    @property
    def eager_dataset(self):
        """What Keras reads in Python (predict): the stage's own dataset.

        Its eager iterators apply the stage's policies (`StageIterator`).
        """
        return DeferredPipeline(self.staged, self._made, defer=self.defers)

    def _made(self, seconds):
        if self.on_iterator is not None:
            self.on_iterator(seconds)

    def end_call(self):
        """Drops what iterators of a stage built for the ended call still make.

        Keras may leave such an iterator alive (a traceback holds it); its
        late elements must not count in the stats the next call shares.
        A user's own staged dataset stays usable.
        """
        if self.owned:
            self.staged.runner.close_gate()

    @property
    def pipeline(self):
        """What the compiled step iterates."""
        pipeline = (
            self.staged.lean_pipeline if self.in_step else self.staged.pipeline
        )
        if self.strategy is None:
            return DeferredPipeline(pipeline, self._made, defer=self.defers)
        return distribute_inputs(
            self.strategy, pipeline, self.staged.stage_options
        )


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
):
    """Stages the data of one phase ("train", "val", "test", "predict").

    With a SmartStage `split`, the stage also runs the split's prefix of
    the model (in training mode for "train"). With `stats`, the stage counts
    in them and the compiled step records its fetches there (its pipeline
    is then the stage's lean one). Under a `strategy` with several
    replicas, `StagedData.pipeline` is distributed with each replica's
    buffer on its device.
    """
    if isinstance(x, StagedDataset):
        # Already staged by the user with keras_stage.data.stage.
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
        return StagedData(x, None, owned=False)
    overrides, python_source = {}, is_python_source(x)
    if layer.stage_options.service is not None:
        overrides = _service_overrides(layer, phase, python_source)
    # A failing generator or PyDataset names itself and the batch.
    x = check_source(x)
    adapter = _compat.get_data_adapter(
        x=x,
        y=y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        steps_per_epoch=steps,
        shuffle=shuffle,
        class_weight=class_weight,
    )
    dataset = adapter.get_tf_dataset()
    num_batches = adapter.num_batches
    served = overrides.get("service", layer.stage_options.service) is not None
    if (
        num_batches is not None
        and dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
        and not layer.stage_options.ignored_exception_types
        and not served
    ):
        # Keras knows the batch count of arrays but its dataset does not
        # carry it; without it the progress bar and the epoch end would
        # be guessed. Skipped batches would make the count wrong, so it is
        # asserted only when nothing can be skipped; and not on the
        # tf.data service, whose workers each see a share of the epoch.
        dataset = dataset.apply(
            tf.data.experimental.assert_cardinality(num_batches)
        )
    if served:
        # Before `split.number`, whose ordinals a peek would consume.
        overrides["rebatch"] = _batch_size(adapter, dataset)
    fn = None
    element_spec = dataset.element_spec
    if split is not None:
        dataset = split.number(dataset)
        fn = split.stage_fn(training=phase == "train")
    if served:
        mode = overrides.get(
            "processing_mode", layer.stage_options.processing_mode
        )
        if (
            mode == DISTRIBUTED_EPOCH
            and num_batches is not None
            and not layer.stage_options.ignored_exception_types
        ):
            # Each batch once, in full batches again: the count is known.
            overrides["cardinality"] = num_batches
    distributed = strategy is not None and strategy.num_replicas_in_sync > 1
    staged = layer.stage(
        dataset,
        fn=fn,
        name=f"{layer.stage_options.name}_{phase}",
        stats=stats,
        consumer_records=stats is not None,
        distributed=distributed,
        unpacks=True,
        **overrides,
    )
    if split is not None:
        staged.runner.staged_layers = tuple(split.plan.staged_layers)
    return StagedData(
        staged,
        adapter,
        split,
        element_spec,
        in_step=stats is not None,
        strategy=strategy if distributed else None,
        defers=in_memory(x),
    )
