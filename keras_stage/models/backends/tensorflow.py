"""`TensorFlowBackend`: Keras's compiled steps read the stage in their graph
(guarded and recorded by `tensorflow_steps.py`); predict's, in Python."""

import tensorflow as tf

from keras_stage import _compat
from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.backends.base import Backend
from keras_stage.models.model_state import FUNCTIONS


class TensorFlowBackend(Backend):
    """The TensorFlow backend; see `Backend` and the module docstring."""

    native_tf = True
    may_run_unstaged = True
    jit_by_default = False
    uses_device_buffer = True
    pool_shrinks = True
    # Keras makes an unread iterator after each epoch it reads (except
    # across epochs of training with steps_per_epoch).
    unread_opens = 1

    def check_supported(self, model, layer):
        pass

    def check_strategy(self, model):
        """Refuses a fit over several workers, which Keras 3 cannot train."""
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

    def check_exportable(self, model):
        pass

    def step(self, model, phase, keras_step, data):
        data = tensorflow_steps.unpacked(model, phase, data)
        with tensorflow_steps.calling_trunk(model, phase):
            return tensorflow_steps.recorded_step(
                model, phase, keras_step, data
            )

    def make_function(self, model, phase, make):
        if phase == "train":
            tensorflow_steps.build_optimizer(model)
        function = super().make_function(model, phase, make)
        if not tensorflow_steps.guarded(function):
            function = tensorflow_steps.guard(model, phase, function)
            setattr(model, FUNCTIONS[phase], function)
        return function

    def reads_in_graph(self, phase):
        return phase != "predict"

    def host_arrays(self, data):
        return data

    def feed(self, data, phase):
        if not self.reads_in_graph(phase):
            return data.eager_dataset
        pipeline = data.pipeline
        if data.strategy is not None and data.long_lived:
            # Views of one distributed iterator: Keras takes them as they are.
            return _compat.distributed_dataset_adapter(pipeline)
        return pipeline

    def build(self, model, data, phase):
        """Builds what the first step's trace would create variables for,
        which would trace it twice. Under a strategy Keras builds from a
        batch, which with SmartStage holds the cut tensors: from specs."""
        if data.element_spec is None:
            return
        strategy = model.distribute_strategy
        if not default_strategy(strategy):
            if data.split is not None:
                with strategy.scope():
                    _build_from_specs(model, data, phase)
            return
        if not _compat.layers_built(model) or _compat.metrics_unbuilt(model):
            _build_from_specs(model, data, phase)

    def shard_batches(self, dataset):
        return None

    def pool_start(self, options):
        return None  # at its largest; resized between epochs both ways

    def variable_reader(self, variables):
        # One traced call reads them all, not a few eager ops each.
        if not variables:
            return super().variable_reader(variables)
        read_all = tf.function(
            lambda: [tf.identity(v.value) for v in variables], autograph=False
        )
        return lambda: tuple(value.numpy() for value in read_all())


def _build_from_specs(model, data, phase):
    """`_compat.symbolic_build` from the cheapest specs that build it all:
    with every layer built and a split's cut dense and unpacked, the cut
    tensors through the trunk (the staged layers are not traced again),
    else the raw data's through the whole model."""
    staged_spec = data.staged.element_spec
    if (
        data.split is not None
        and not data.staged.packed
        and _compat.layers_built(model)
        and all(
            isinstance(spec, tf.TensorSpec)
            for spec in tf.nest.flatten(staged_spec)
        )
    ):
        with tensorflow_steps.calling_trunk(model, phase):
            _compat.symbolic_build(model, staged_spec)
        return
    _compat.symbolic_build(model, data.element_spec)


def default_strategy(strategy):
    """Whether Keras iterates with the default strategy (no distribution);
    under any other, it makes iterators from the graph, not `__iter__`."""
    return strategy is None or (
        not tf.distribute.has_strategy()
        and strategy is tf.distribute.get_strategy()
    )


def worker_count(strategy):
    """The workers (chief included) of `strategy`'s cluster; 1 if none."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec()
    count = sum(
        spec.num_tasks(job) for job in ("chief", "worker") if job in spec.jobs
    )
    return max(count, 1)
