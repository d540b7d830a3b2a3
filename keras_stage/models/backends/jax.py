"""`JaxBackend`: Keras's jitted steps take each batch from Python.

Keras's JAX steps are pure functions of the data, jitted, and its trainer
fetches each batch in Python, from the iterator of the dataset it is given.
The stage's eager iterator (`StagedData.eager_dataset`) applies the
exception policies and the timeout there and counts the waits; Keras's JAX
trainer puts each batch on the device one batch ahead (`jax.device_put`),
so the stage's buffer stays on the host. Under a `keras.distribution` it
lays each batch out over the devices as it does any dataset's; across
processes each stages its own shard (`feed`). The staged prefix is
TensorFlow, run by tf.data as Keras's preprocessing layers are on any
backend; the trunk is traced into the JAX step (`Backend.step`), and the
model is built from the stage's specs (`build`).
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

    # A string prefix cannot run unstaged: calls and epochs are staged.
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

        Keras's array adapter on JAX rejects object arrays (`Invalid dtype:
        object`): strings are what its JAX steps cannot take. The stage runs
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

        Across processes (`jax.distributed`) under a `keras.distribution`,
        Keras shards any dataset it is given per process (rebatched, then
        sharded), which would read the stage's graph around its iterators
        (their policies, timeout and statistics). The stage's source is
        that shard already (Keras's adapter made it, see `stage_data`), so
        the staged dataset goes to Keras in an adapter of its own, which
        Keras takes as it is. Each process then stages its own share of
        every epoch, and Keras's trainer assembles the global batch from
        the processes' batches (`jax.make_array_from_process_local_data`).
        """
        if not _across_processes():
            return data.eager_dataset
        return _compat.distributed_dataset_adapter(data.eager_dataset)

    def build(self, model, data, phase):
        """Builds the model's metrics from `data`'s specs, as Keras's fit would.

        Keras's JAX trainer builds an unbuilt model (its compile metrics and
        loss) by reading a first batch from an iterator of its own. Here it
        is built from the stage's element spec instead (with the trunk
        called, for a SmartStage split): no staged iterator is started for
        one batch, and the epochs can share one (`StagedData.epochs`). What
        that read draws from the source is drawn all the same (one batch of
        the source, unstaged), so the epochs see the orders the hand-split
        pipeline sees.
        """
        if not _compat.builds_from_data(model):
            return
        if not data.defers and data.source is not None:
            next(iter(data.source), None)  # the draw of Keras's own read
        with tensorflow_steps.calling_trunk(model, phase):
            _compat.symbolic_build(model, data.staged.element_spec)

    def shard_batches(self, dataset):
        """The batches of this process's shard of `dataset`, or None.

        Across processes (`jax.distributed`) under a `keras.distribution`
        that auto-shards, Keras's adapter re-forms each global batch into
        the processes' shares (`Dataset.rebatch`), then shards them, and
        tf.data knows no length after a rebatch; plain Keras then finds each
        epoch's end by running out. A global batch that fills every
        process's share gives each process exactly one batch, so every
        shard of a dataset of `C` batches has `C`; a last batch too short to
        reach the last processes would leave them a step short of the
        first, which no process group can train on (plain Keras's processes
        would wait on each other). None when Keras does not shard `dataset`
        per process or its length is not known.
        """
        if not isinstance(dataset, tf.data.Dataset) or not _across_processes():
            return None
        if not keras.distribution.distribution().auto_shard_dataset:
            return None
        batches = int(dataset.cardinality())
        return batches if batches >= 0 else None

    def pool_start(self, options):
        """The threads a stage's adaptive pool starts with: the cores.

        The steps are dispatched ahead and the fetches go through Python,
        so the verdict's waits swing between epochs (a pool shrunk to one
        thread, then grown back), and each resize restarts the stage. So
        the pool starts at the cores, the pool tf.data's shared one has and
        the hand-split `map(...).prefetch(...)` runs on, and only grows,
        after an epoch that kept the step waiting (`pool_shrinks`). A pool
        larger than the cores, whose autotuner budgets as many cores as
        threads, runs the staged work on more threads than there are cores,
        beside the step (docs/jax.md has the figures).
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
