"""The batches of in-memory arrays, in Keras's order, at a gather's cost.

Keras's array adapter passes the whole arrays through its map's function at
every batch, which for string columns costs more than the gather itself. A
stage over arrays reads Keras's index batches, in Keras's order, gathered
from the arrays its function holds.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from keras_stage import _compat
from keras_stage.data.staging import graph_ready
from keras_stage.models.data_adapters.staged_data import EpochSource, build

# Keras's batch size when fit/evaluate/predict get arrays and none is given.
_KERAS_DEFAULT_BATCH_SIZE = 32


def batch_count(x, batch_size, steps):
    """The batch count of a call on in-memory arrays, or None."""
    if not in_memory(x):
        return None
    if steps is not None:
        return steps
    rows = len(_leaves(x)[0])
    return math.ceil(rows / (batch_size or _KERAS_DEFAULT_BATCH_SIZE))


def _leaves(x):
    if isinstance(x, dict):
        return [leaf for value in x.values() for leaf in _leaves(value)]
    if isinstance(x, (list, tuple)):
        return [leaf for value in x for leaf in _leaves(value)]
    return [x]


def in_memory(x):
    """Whether `x` is arrays (NumPy, tensors of any backend) or nested
    lists/dicts of them (a tf.data.Dataset has no shape nor dtype)."""
    leaves = _leaves(x)
    return bool(leaves) and all(
        hasattr(leaf, "shape") and hasattr(leaf, "dtype") for leaf in leaves
    )


class ArrayBatches:
    """Keras's batches of in-memory arrays: `indices.map(gather)`.

    A stage with work of its own runs `gather` in its own map, on the index
    batches (one map and one buffer fewer).

    Attributes:
        indices: The row indices of each batch, in the order Keras's
            adapter draws them, with the options Keras sets on its dataset.
        element_spec: The spec of a gathered batch (`dataset()`'s).
    """

    def __init__(self, indices, inputs):
        self.indices = indices
        self._inputs = inputs
        self.element_spec = keras.tree.map_structure(
            lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]), t.dtype),
            inputs,
        )

    def gather(self, batch):
        """The rows `batch` (an index batch) of every array."""
        return keras.tree.map_structure(
            lambda tensor: tf.gather(tensor, batch, axis=0), self._inputs
        )

    def dataset(self, indices=None):
        """The gathered batches of `indices` (defaults to `self.indices`)."""
        indices = self.indices if indices is None else indices
        dataset = indices.map(self.gather, num_parallel_calls=tf.data.AUTOTUNE)
        return dataset.prefetch(tf.data.AUTOTUNE)

    def staged_fn(self, fn, numbered=False):
        """`fn` of the gathered batch, for a stage over the index batches.
        `numbered`: each index batch comes as `(ordinal, (indices,))`
        (`StageSplit.number`), and `fn` takes `(ordinal, batch)`."""

        def gathered(element):
            if not numbered:
                return fn(self.gather(element))
            ordinal, (indices,) = element
            batch = self.gather(indices)
            # `number` passes a tuple element whole, anything else in one.
            return fn(
                (ordinal, batch if isinstance(batch, tuple) else (batch,))
            )

        # The gather holds no control flow (see `staging.graph_ready`).
        gathered.keras_stage_graph_ready = graph_ready(fn)
        return gathered


def array_batches(adapter, shuffle):
    """The `ArrayBatches` of `adapter`'s arrays (the elements of
    `adapter.get_tf_dataset()` in its order, with the options Keras sets),
    or None where keras_stage reads Keras's own dataset: adapters of
    anything but arrays, and sparse or ragged arrays (Keras slices those
    its own way). `shuffle`: the call's (False, True or "batch").
    """
    inputs = _compat.array_adapter_inputs(adapter)
    if inputs is None:
        return None
    inputs = keras.tree.lists_to_tuples(inputs)
    leaves = keras.tree.flatten(inputs)
    if not leaves or not all(_is_dense(leaf) for leaf in leaves):
        return None
    # A captured eager tensor is passed by reference, not copied into the
    # graph as a NumPy array would be.
    inputs = keras.tree.map_structure(tf.convert_to_tensor, inputs)
    count = int(keras.tree.flatten(inputs)[0].shape[0])
    return ArrayBatches(_index_batches(adapter, shuffle, count), inputs)


def stage(request):
    """The `StagedData` of a call on arrays (and whatever else Keras's
    adapter takes, e.g. a DataFrame).

    A SmartStage stage gathers the rows in its own map; on the tf.data
    service the stage reads Keras's own dataset.
    """
    adapter = request.keras_adapter()
    batches = None
    if not request.served:
        batches = array_batches(adapter, request.shuffle)
    gather = None if request.split is None else batches
    if batches is None:
        dataset = adapter.get_tf_dataset()
    elif gather is not None:
        dataset = gather.indices
    else:
        dataset = batches.dataset()
    held = in_memory(request.x)
    epoch = EpochSource(
        dataset,
        arrays=(request.x, request.y, request.sample_weight) if held else None,
        gather=gather,
        # What else Keras's adapter takes (e.g. a DataFrame) runs per epoch.
        long_lived=held,
    )
    return build(request, adapter, epoch)


def _is_dense(leaf):
    return isinstance(leaf, (np.ndarray, tf.Tensor))


def _index_batches(adapter, shuffle, count):
    """The row indices of each batch, in the order Keras's adapter draws."""
    if shuffle:
        # Keras's own shuffle, on the indices only (same ops, same seeds).
        order = _compat.get_data_adapter(
            x=np.arange(count, dtype=np.int64),
            y=None,
            sample_weight=None,
            batch_size=adapter.batch_size,
            steps_per_epoch=None,
            shuffle=shuffle,
            class_weight=None,
        )
        return order.get_tf_dataset()  # with the options Keras sets
    indices = tf.data.Dataset.range(count).batch(adapter.batch_size)
    options = tf.data.Options()
    # What Keras sets on its array datasets.
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return indices.with_options(options)
