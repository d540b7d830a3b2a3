"""What a staged call does differently on each Keras backend.

The one place that asks which backend runs the model's steps:

- TensorFlow: Keras's compiled steps read the stage's pipeline inside a
  `tf.function`; `tensorflow_steps.py` guards them with the stage's
  runner and makes them record the fetches (`graph_steps()` is True).
- JAX: Keras's steps are pure functions of the data, jitted, and its
  trainer fetches each batch in Python, from the iterator of the dataset
  it is given. The stage's eager iterator (`StagedData.eager_dataset`)
  applies the exception policies and the timeout there and counts the
  waits; Keras's JAX trainer puts each batch on the device one batch ahead
  (`jax.device_put`), so the stage's buffer stays on the host. Under a
  `keras.distribution` it lays each batch out over the devices as it does
  any dataset's; across processes each stages its own shard
  (`eager_feed`). The staged prefix is TensorFlow, run by tf.data as
  Keras's preprocessing layers are on any backend; the trunk is traced
  into the JAX step (`jax_step`), and the model is built from the
  stage's specs (`build_as_keras_would`).
- Other backends (torch, numpy, openvino): a staged call raises
  `check_supported`'s error.

Example (the JAX step of `StagingMixin.train_step`):

    if not backend.graph_steps():
        return backend.jax_step(model, "train", keras_train_step, *args)
"""

import logging

import keras
import numpy as np
import tensorflow as tf

from keras_stage import _compat
from keras_stage.data.options import AUTO
from keras_stage.models.backends import tensorflow_steps

SUPPORTED = ("tensorflow", "jax")

logger = logging.getLogger("keras_stage")


def graph_steps():
    """Whether the model's steps are TensorFlow graphs (the TF backend)."""
    return keras.backend.backend() == "tensorflow"


def check_supported(model, layer, backend=None):
    """Raises a clear error for a staged call this backend cannot run.

    Args:
        model: The keras_stage model called.
        layer: Its `StagedInput` (or the default one of a SmartStage model).
        backend: The Keras backend's name; defaults to the one running.
    """
    backend = keras.backend.backend() if backend is None else backend
    if backend not in SUPPORTED:
        raise NotImplementedError(
            f"keras_stage stages fit/evaluate/predict on the TensorFlow and "
            f"JAX backends; model '{model.name}' runs on the '{backend}' "
            "backend. Set KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow "
            "before importing Keras, or use a plain keras.Model (or remove "
            "the StagedInput and smart_stage) on this backend."
        )
    if backend == "tensorflow":
        return
    options = layer.stage_options
    if options.device not in (AUTO, None, "cpu") or options.stream is not None:
        _warn_device_once(layer)


def eager_feed(dataset):
    """What Keras's trainer is given to read `dataset` in Python.

    `dataset`, except across processes (`jax.distributed`) under a
    `keras.distribution`: there Keras shards any dataset it is given per
    process (rebatched, then sharded), which would read the stage's graph
    around its iterators (their policies, timeout and statistics). The
    stage's source is that shard already (Keras's adapter made it, see
    `stage_data`), so the staged dataset goes to Keras in an adapter of
    its own, which Keras takes as it is. Each process then stages its own
    share of every epoch, and Keras's trainer assembles the global batch
    from the processes' batches (`jax.make_array_from_process_local_data`).
    """
    if graph_steps() or not _across_processes():
        return dataset
    return _compat.distributed_dataset_adapter(dataset)


def shard_batches(dataset):
    """The batches of this process's shard of `dataset`, or None.

    Across processes (`jax.distributed`) under a `keras.distribution` that
    auto-shards, Keras's adapter re-forms each global batch into the
    processes' shares (`Dataset.rebatch`), then shards them, and tf.data
    knows no length after a rebatch; plain Keras then finds each epoch's
    end by running out. A global batch that fills every process's share
    gives each process exactly one batch, so every shard of a dataset of
    `C` batches has `C`; a last batch too short to reach the last
    processes would leave them a step short of the first, which no
    process group can train on (plain Keras's processes would wait on
    each other). None when Keras does not shard `dataset` per process
    or its length is not known.
    """
    if not isinstance(dataset, tf.data.Dataset) or not _across_processes():
        return None
    if not keras.distribution.distribution().auto_shard_dataset:
        return None
    batches = int(dataset.cardinality())
    return batches if batches >= 0 else None


def _across_processes():
    """Whether a keras.distribution spans several JAX processes."""
    if keras.distribution.distribution() is None:
        return False
    import jax  # only on the JAX backend

    return jax.process_count() > 1


def _warn_device_once(layer):
    if getattr(layer, "_keras_stage_device_warned", False):
        return
    layer._keras_stage_device_warned = True
    logger.warning(
        "StagedInput '%s': on the JAX backend Keras's trainer puts each "
        "batch on the device itself, one batch ahead (jax.device_put), so "
        "the stage's buffer stays on the host and its `device` and "
        "`stream` options are not used.",
        layer.name,
    )


def check_exportable(model):
    """Raises a clear error for an export this backend cannot make.

    Keras exports a JAX model through jax2tf, which takes numeric arrays
    only: a model with string inputs fails deep inside it.
    """
    if graph_steps():
        return
    strings = [
        t.name
        for t in keras.tree.flatten(getattr(model, "inputs", None) or [])
        if t.dtype == "string"
    ]
    if strings:
        raise ValueError(
            f"Model '{model.name}' has string inputs ({strings}), which "
            f"Keras cannot export on the {keras.backend.backend()} backend "
            "(jax2tf takes numeric arrays only). Save it with "
            "`model.save('model.keras')`, load it with "
            "KERAS_BACKEND=tensorflow (`keras.saving.load_model`) and call "
            "`export` there: the exported model then serves raw strings."
        )


def check_strategy(model):
    """Raises a clear error for a fit under a strategy Keras cannot train.

    Keras 3's fit does not run under `MultiWorkerMirroredStrategy` with
    more than one worker (keras-team/keras#20585: even a plain
    `keras.Model` of Dense layers fails with `Attempt to convert a value
    (PerReplica...)`). Said at the
    start of the call, with what works instead.
    """
    if not graph_steps():
        return
    workers = worker_count(model.distribute_strategy)
    if workers > 1:
        raise NotImplementedError(
            f"Model '{model.name}' would fit under "
            f"{type(model.distribute_strategy).__name__} with {workers} "
            "workers, which Keras 3's fit does not support "
            "(keras-team/keras#20585: it fails in the first step with "
            "'Attempt to convert a value (PerReplica...)', for a plain "
            "keras.Model too). What works: MirroredStrategy over one "
            "machine's devices, one trainer whose StagedInput reads from "
            "tf.data service workers on other machines (service=...), or "
            "on the JAX backend keras.distribution across processes "
            "(jax.distributed)."
        )


def worker_count(strategy):
    """The workers (chief included) of `strategy`'s cluster; 1 if none."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec()
    jobs = spec.jobs
    count = sum(
        spec.num_tasks(job) for job in ("chief", "worker") if job in jobs
    )
    return max(count, 1)


def host_arrays(data):
    """`data` with NumPy string arrays as `tf.string` tensors, on JAX.

    Keras's array adapter on JAX rejects object arrays (`Invalid dtype:
    object`): strings are what its JAX steps cannot take. The stage runs
    in TensorFlow, whose tensors the adapter slices on any backend.
    Identity on TensorFlow.
    """
    if graph_steps() or data is None:
        return data

    def convert(leaf):
        if not isinstance(leaf, np.ndarray) or leaf.dtype.kind not in "OSU":
            return leaf
        first = leaf.flat[0] if leaf.size else ""
        if leaf.dtype.kind == "O" and not isinstance(first, (str, bytes)):
            return leaf  # not strings: Keras says what it cannot take
        return tf.constant(leaf)

    return keras.tree.map_structure(convert, data)


def uses_device_buffer():
    """Whether the stage may keep its buffer on an accelerator.

    On JAX, Keras's trainer copies each batch to the device itself, one
    batch ahead (`jax.device_put` is asynchronous): a TensorFlow device
    buffer would only add a copy back to the host.
    """
    return graph_steps()


def pool_start(options):
    """The threads a stage's adaptive pool starts with (None: its largest).

    On TensorFlow the pool starts at its largest and the verdict resizes
    it between epochs both ways. On JAX, whose steps are dispatched ahead
    and whose fetches go through Python, the verdict's waits swing between
    epochs (a pool shrunk to one thread, then grown back), and each resize
    restarts the stage.
    So there it starts at the cores, the pool tf.data's shared one has and
    the hand-split `map(...).prefetch(...)` runs on, and only grows, after
    an epoch that kept the step waiting (`pool_shrinks`). A pool larger
    than the cores, whose autotuner budgets as many cores as threads, runs
    the staged work on more threads than there are cores, beside the step
    (docs/jax.md has the figures).
    """
    return None if graph_steps() else options.smallest_pool_size()


def pool_shrinks():
    """Whether an epoch that kept up may shrink the pool (see `pool_start`)."""
    return graph_steps()


def jax_step(model, phase, keras_step, state, data):
    """Keras's JAX `phase` step, running the SmartStage trunk.

    The step is traced by `jax.jit` with the model's `call` redirected to
    the trunk (see `StagingMixin.call`): the data holds the cut tensors.
    """
    with tensorflow_steps.calling_trunk(model, phase):
        return keras_step(state, data)


def build_as_keras_would(model, data, phase):
    """Builds the model's metrics from `data`'s specs, as Keras's JAX fit would.

    Keras's JAX trainer builds an unbuilt model (its compile metrics and
    loss) by reading a first batch from an iterator of its own. Here it
    is built from the stage's element spec instead (with the trunk called,
    for a SmartStage split): no staged iterator is started for one batch,
    and the epochs can share one (`StagedData.epochs`). What that read
    draws from the source is drawn all the same (one batch of the source,
    unstaged), so the epochs see the orders the hand-split pipeline sees.
    """
    if not _compat.builds_from_data(model):
        return
    if not data.defers and data.source is not None:
        next(iter(data.source), None)  # the draw of Keras's own read
    with tensorflow_steps.calling_trunk(model, phase):
        _compat.symbolic_build(model, data.staged.element_spec)
