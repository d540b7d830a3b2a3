"""A user's `tf.data.Dataset`: its epoch source, and what it tells before
a call reads it.

A dataset that only slices, batches and shuffles tensors in memory reads
nothing a stage could overlap: like arrays, it gains only the staged
computation, which `decision/calls.py` weighs against the stage's set-up.
"""

import tensorflow as tf

from keras_stage.data.source_passes import inspect_source
from keras_stage.data.staging import StagedDataset
from keras_stage.models.data_adapters.epoch_sources import EpochSource

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
    """The `EpochSource` of a user's `tf.data.Dataset`, as Keras iterates it
    (its stage may be kept for later calls on it)."""
    return EpochSource(adapter.get_tf_dataset(), keeps=True)


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
