"""`JaxBackend`: Keras's jitted steps, tracing the trunk, take each batch
from Python, and its trainer puts each on the device itself, one ahead: the
stage's buffer stays on the host."""

import logging

import keras
import numpy as np
import tensorflow as tf

from keras_stage import _compat
from keras_stage.data.options import AUTO
from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.backends.base import Backend
from keras_stage.models.model_state import keras_builds
from keras_stage.models.model_state import state as _state

logger = logging.getLogger("keras_stage")


class JaxBackend(Backend):
    """The JAX backend; see `Backend` and the module docstring."""

    # A string prefix cannot run unstaged: every call is staged.
    may_run_unstaged = False
    jit_by_default = True  # Keras's "auto" on JAX: jit what it can
    uses_device_buffer = False
    pool_shrinks = False  # see `pool_start`
    unread_opens = 0  # Keras's generators open the dataset when first read

    # Why the `device` and `stream` options are not used, logged once.
    device_note = (
        "on the JAX backend Keras's trainer puts each batch on the device "
        "itself, one batch ahead (jax.device_put), so the stage's buffer "
        "stays on the host"
    )

    def check_supported(self, model, layer):
        options = layer.stage_options
        if options.device in (AUTO, None, "cpu") and options.stream is None:
            return
        if getattr(layer, "_keras_stage_device_warned", False):
            return
        layer._keras_stage_device_warned = True
        logger.warning(
            "StagedInput '%s': %s, and its `device` and `stream` options "
            "are not used.",
            layer.name,
            self.device_note,
        )

    def reads_in_graph(self, phase):
        return False

    def host_arrays(self, data):
        """`data` with NumPy string arrays as `tf.string` tensors: Keras's
        array adapter on JAX rejects object arrays."""
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
        """The stage's eager dataset; across processes, this process's
        shard already, in an adapter Keras does not shard again."""
        if not _across_processes():
            return data.eager_dataset
        return _compat.distributed_dataset_adapter(data.eager_dataset)

    def build(self, model, data, phase):
        """Builds the model's metrics from the stage's specs, not a batch:
        no staged iterator starts for Keras's first read, whose draw from
        the source is made all the same (the epochs keep their orders)."""
        if not keras_builds(model):
            return
        _state(model).built_by_plan = False  # its first call builds it
        if not data.defers and data.source is not None:
            next(iter(data.source), None)  # the draw of Keras's own read
        with tensorflow_steps.calling_trunk(model, phase):
            _compat.symbolic_build(model, data.staged.element_spec)

    def shard_batches(self, dataset):
        """The batches of this process's shard of `dataset`, or None.

        Under an auto-sharding `keras.distribution` across processes, Keras
        rebatches each global batch and tf.data loses the length: a shard
        has the dataset's batch count.
        """
        if not isinstance(dataset, tf.data.Dataset) or not _across_processes():
            return None
        if not keras.distribution.distribution().auto_shard_dataset:
            return None
        batches = int(dataset.cardinality())
        return batches if batches >= 0 else None

    def pool_start(self, options):
        """The adaptive pool starts at the cores and only grows: steps
        dispatched ahead make the waits swing between epochs, and a resize
        restarts the stage (docs/jax.md)."""
        return options.smallest_pool_size()

    def narrows_int64(self):
        # Without `jax_enable_x64` Keras would truncate them in every step.
        import jax  # only on this backend

        return not jax.config.jax_enable_x64


def _across_processes():
    """Whether a keras.distribution spans several JAX processes."""
    if keras.distribution.distribution() is None:
        return False
    import jax  # only on this backend

    return jax.process_count() > 1
