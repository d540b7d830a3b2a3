"""A user's `tf.data.Dataset`: its epoch source, and what it tells before
a call reads it.

A call on a dataset that only slices, batches and shuffles tensors held in
memory (`from_tensor_slices(...).shuffle(...).batch(...)`, as the keras.io
examples build them) reads nothing a stage could overlap: like in-memory
arrays, it gains only the staged computation of its batches, which
`decision/calls.py` weighs against the stage's set-up. A dataset that runs
functions of its own (a `map` that parses, an `interleave` that reads
files), reads files or cannot be inspected is always staged: the stage
overlaps that reading, whose cost is not measured.
"""

import tensorflow as tf

from keras_stage.data.staging import StagedDataset
from keras_stage.models.data_adapters import epoch_sources

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


def epoch_source(adapter):
    """The `EpochSource` of a user's `tf.data.Dataset`, as Keras iterates it.

    Its stage may be kept for the model's later calls on the same dataset
    (see `kept_iterators.KeptStage`).
    """
    return epoch_sources.EpochSource(
        adapter, adapter.get_tf_dataset(), keeps=True
    )


def reads_memory_only(dataset):
    """Whether every element of `dataset` comes from tensors in memory.

    Built only from `_IN_MEMORY_KINDS`, with no function of its own: its
    reading costs what slicing and batching cost, nothing to overlap.
    """
    facts = epoch_sources.inspect_source(dataset)
    return (
        facts.refusal is None
        and not facts.runs_functions
        and facts.kinds <= _IN_MEMORY_KINDS
    )


def batch_count(dataset, steps):
    """The batches a call reads from an in-memory `dataset`, or None.

    None when the dataset reads more than memory (see `reads_memory_only`),
    is a user's staged dataset, or has an unknown or infinite length
    without `steps`.
    """
    if isinstance(dataset, StagedDataset) or not reads_memory_only(dataset):
        return None
    count = cardinality(dataset)
    if count == tf.data.INFINITE_CARDINALITY:
        return steps
    if count < 0:  # unknown
        return None
    return count if steps is None else min(count, steps)


def cardinality(dataset):
    """`int(dataset.cardinality())`, kept per dataset object.

    A dataset's length does not change; asking runs an op, which a loop of
    short calls on one dataset would otherwise pay on every call.
    """
    facts = epoch_sources.inspect_source(dataset)
    if facts.cardinality is None:
        facts.cardinality = int(dataset.cardinality())
    return facts.cardinality
