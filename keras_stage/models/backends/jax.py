"""`JaxBackend`: Keras's jitted steps take each batch from Python.

Keras's JAX trainer fetches each batch in Python from the stage's eager
iterator (`StagedData.eager_dataset`), which applies the stage's policies
and counts the waits, and puts it on the device itself: the stage's buffer
stays on the host. The staged prefix is TensorFlow, run by tf.data; the
trunk is traced into the jitted step (`Backend.step`).
"""

import logging

import keras
import numpy as np
import tensorflow as tf

from keras_stage import _compat
from keras_stage.data.options import AUTO
from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.backends.base import Backend

logger = logging.getLogger("keras_stage")


class JaxBackend(Backend):
    """The JAX backend; see `Backend` and the module docstring."""

    # A string prefix cannot run unstaged: every call is staged.
    may_run_unstaged = False
    jit_by_default = True  # Keras's "auto" on JAX: jit what it can
    # Keras's trainer copies each batch to the device itself, one batch
    # ahead (`jax.device_put` is asynchronous): a TensorFlow device buffer
    # would only add a copy back to the host.
    uses_device_buffer = False
    pool_shrinks = False  # see `pool_start`
    # Keras's trainer makes its iterators as generators, which open the
    # dataset only when first read.
    unread_opens = 0

    def check_supported(self, model, layer):
        options = layer.stage_options
        if options.device in (AUTO, None, "cpu") and options.stream is None:
            return
        if getattr(layer, "_keras_stage_device_warned", False):
            return
        layer._keras_stage_device_warned = True
        logger.warning(
            "StagedInput '%s': on the JAX backend Keras's trainer puts each "
            "batch on the device itself, one batch ahead (jax.device_put), "
            "so the stage's buffer stays on the host and its `device` and "
            "`stream` options are not used.",
            layer.name,
        )

    def reads_in_graph(self, phase):
        return False

    def host_arrays(self, data):
        """`data` with NumPy string arrays as `tf.string` tensors.

        Keras's array adapter on JAX rejects object arrays; the stage runs
        in TensorFlow, whose tensors the adapter slices on any backend.
        """
        if data is None:
            return data

        def convert(leaf):
            if not isinstance(leaf, np.ndarray) or leaf.dtype.kind not in "OSU":
                return leaf
            first = leaf.flat[0] if leaf.size else ""
            if leaf.dtype.kind == "O" and not isinstance(first, (str, bytes)):
                return leaf  # not strings: Keras says what it cannot take
            return tf.constant(leaf)

        return keras.tree.map_structure(convert, data)

    def feed(self, data, phase):
        """The stage's eager dataset, as Keras's trainer is to read it.

        Across processes under a `keras.distribution`, Keras would shard
        any dataset again, reading the stage's graph around its iterators;
        the stage's source is this process's shard already, so it goes to
        Keras in an adapter Keras takes as it is, and Keras assembles the
        global batch from the processes' batches.
        """
        if not _across_processes():
            return data.eager_dataset
        return _compat.distributed_dataset_adapter(data.eager_dataset)

    def build(self, model, data, phase):
        """Builds the model's metrics from `data`'s specs, as Keras's fit would.

        Keras's JAX trainer reads a first batch of its own to build them;
        built from the stage's spec instead (the trunk called), no staged
        iterator starts for one batch. That read's draw from the source is
        made all the same, so the epochs see the hand-split orders.
        """
        if not _compat.builds_from_data(model):
            return
        if not data.defers and data.source is not None:
            next(iter(data.source), None)  # the draw of Keras's own read
        with tensorflow_steps.calling_trunk(model, phase):
            _compat.symbolic_build(model, data.staged.element_spec)

    def shard_batches(self, dataset):
        """The batches of this process's shard of `dataset`, or None.

        Across processes under an auto-sharding `keras.distribution`,
        Keras rebatches each global batch into the processes' shares, and
        tf.data knows no length after a rebatch: each shard of `C` batches
        has `C` (a last batch too short for every process would stall the
        process group, in plain Keras too). None when Keras does not shard
        `dataset` per process or its length is not known.
        """
        if not isinstance(dataset, tf.data.Dataset) or not _across_processes():
            return None
        if not keras.distribution.distribution().auto_shard_dataset:
            return None
        batches = int(dataset.cardinality())
        return batches if batches >= 0 else None

    def pool_start(self, options):
        """The threads a stage's adaptive pool starts with: the cores.

        Steps dispatched ahead make the verdict's waits swing between epochs,
        and each resize restarts the stage: the pool starts where tf.data's
        shared one does and only grows, after an epoch that kept the step
        waiting (docs/jax.md has the figures).
        """
        return options.smallest_pool_size()

    def narrows_int64(self):
        # Without `jax_enable_x64` JAX has no int64: Keras would truncate
        # them in every step, with a warning. The stage casts them instead.
        import jax  # only on this backend

        return not jax.config.jax_enable_x64


def _across_processes():
    """Whether a keras.distribution spans several JAX processes."""
    if keras.distribution.distribution() is None:
        return False
    import jax  # only on this backend

    return jax.process_count() > 1
