"""A user's `tf.data.Dataset`: its stage, and what it tells before a call
reads it.

A dataset that only slices, batches and shuffles tensors in memory reads
nothing a stage could overlap: like arrays, it gains only the staged
computation, which `decision/calls.py` weighs against the stage's set-up.
"""

import logging

import tensorflow as tf

from keras_stage.data.source_passes import inspect_source
from keras_stage.data.staging import StagedDataset
from keras_stage.models.data_adapters.staged_data import (
    EpochSource,
    StagedData,
    build,
)

logger = logging.getLogger("keras_stage")

# Datasets that only hold, slice, batch, reorder or cut elements in memory
# (`cache` is left out: it may read and write a file).
_IN_MEMORY_KINDS = frozenset(
    {
        "_TensorSliceDataset",
        "_TensorDataset",
        "_RangeDataset",
        "_BatchDataset",
        "_PaddedBatchDataset",
        "_UnbatchDataset",
        "_ShuffleDataset",
        "_RepeatDataset",
        "_TakeDataset",
        "_SkipDataset",
        "_ShardDataset",
        "_PrefetchDataset",
        "_OptionsDataset",
        "_ZipDataset",
        "_ConcatenateDataset",
    }
)


def stage(request):
    """The `StagedData` of a call on a user's `tf.data.Dataset`, as Keras
    iterates it (its stage may be kept for later calls on it)."""
    adapter = request.keras_adapter()
    epoch = EpochSource(adapter.get_tf_dataset(), keeps=True)
    return build(request, adapter, epoch)


def stage_staged(request):
    """The `StagedData` of a dataset the user staged with
    `keras_stage.data.stage`: its own stage, run as it is."""
    x, layer = request.x, request.layer
    if request.y is not None or request.sample_weight is not None:
        raise ValueError(
            "When `x` is a staged dataset, pass labels and sample "
            "weights inside it, not as `y`/`sample_weight`. Received: "
            f"y={type(request.y).__name__}, "
            f"sample_weight={type(request.sample_weight).__name__}"
        )
    if x.stage_options.get_config() != layer.stage_options.get_config():
        logger.info(
            "`x` is already staged by stage '%s'; its own options are "
            "used, not those of StagedInput '%s'.",
            x.name,
            layer.name,
        )
    if request.split is not None:
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
        if request.epochs is None
        else "the data is a user's staged dataset",
        costs=request.costs,
    )


def reads_memory_only(dataset):
    """Whether every element of `dataset` comes from tensors in memory
    (built only from `_IN_MEMORY_KINDS`, with no function of its own)."""
    facts = inspect_source(dataset)
    return (
        facts.refusal is None
        and not facts.runs_functions
        and facts.kinds <= _IN_MEMORY_KINDS
    )


def batch_count(dataset, steps):
    """The batches a call reads from an in-memory `dataset`, or None (it
    reads more than memory, is staged, or its length is not known)."""
    if isinstance(dataset, StagedDataset) or not reads_memory_only(dataset):
        return None
    count = cardinality(dataset)
    if count == tf.data.INFINITE_CARDINALITY:
        return steps
    if count < 0:  # unknown
        return None
    return count if steps is None else min(count, steps)


def cardinality(dataset):
    """`int(dataset.cardinality())`, kept per dataset object (asking runs
    an op, which a loop of short calls would pay on every call)."""
    facts = inspect_source(dataset)
    if facts.cardinality is None:
        facts.cardinality = int(dataset.cardinality())
    return facts.cardinality
