"""`StagedInput`: the layer that marks a model's stage boundary."""

import logging
import re

import keras
import tensorflow as tf

from keras_stage.data.options import (
    AUTO,
    OPTIONS,
    StageOptions,
    document_options,
)
from keras_stage.data.staging import build_stage, new_stats

logger = logging.getLogger("keras_stage")

# The options the layer takes: all but `name`, which is the layer's own.
_LAYER_OPTIONS = tuple(o for o in OPTIONS if o.name != "name")


def _stage_name(layer_name):
    # tf.data names must be identifiers; Keras layer names may not be.
    name = re.sub(r"\W", "_", layer_name)
    return name if name.isidentifier() else f"stage_{name}"


def warn_not_staged(layer, where):
    """Logs once per layer that nothing stages `layer` (`where` says why): a
    Python warning would point into Keras's step."""
    if getattr(layer, "_not_staged_warned", False):
        return
    layer._not_staged_warned = True
    logger.warning(
        "StagedInput '%s' stages nothing: %s, and there it passes its data "
        "through unchanged. Build the model with "
        "`keras_stage.Model(inputs, outputs)` or "
        "`keras_stage.Sequential([...])` instead of Keras's and train it "
        "with `fit` (those models also take `compile(..., "
        "smart_stage=True)`, which Keras's reject).",
        layer.name,
        where,
    )


@keras.saving.register_keras_serializable(package="keras_stage")
@document_options
class StagedInput(keras.layers.Layer):
    """Marks where the stage ends: everything before it runs ahead of training.

    Put it first in a `keras_stage.Model` or `keras_stage.Sequential`. During
    `fit`, `evaluate` and `predict` the model's data goes through a stage
    (`keras_stage.data.stage`) with these options. Outside a staged run the
    layer is an identity: `model(x)`, `export` and serving see a normal
    model. It takes a tensor, a list or a dict (dense, ragged or sparse
    leaves); its name names the stage in errors and logs.

    Args:
        {stage_options}
        adaptive: Stage a call on in-memory data, and a SmartStage fit's
            epochs, only where staging pays (same results either way).
            `False` stages every call and every epoch; calls with exception
            policies or a `service` are always staged. Defaults to `True`.
        **kwargs: Base layer arguments (`name`, ...).

    Example:

    >>> import keras
    >>> import keras_stage
    >>> inputs = keras.Input(shape=(4,))
    >>> x = keras_stage.layers.StagedInput(capacity=4, num_threads=2)(inputs)
    >>> outputs = keras.layers.Dense(1)(x)
    >>> model = keras_stage.Model(inputs, outputs)
    >>> model.layers[1].get_config()["capacity"]
    4
    """

    def __init__(
        self,
        capacity=AUTO,
        num_threads=AUTO,
        closed_exception_types=(tf.errors.OutOfRangeError,),
        ignored_exception_types=(),
        timeout=300.0,
        thread_pool_size=None,
        deterministic=True,
        device=AUTO,
        stream=None,
        pack_transfer=AUTO,
        service=None,
        processing_mode="distributed_epoch",
        worker_timeout=10.0,
        adaptive=True,
        **kwargs,
    ):
        # The arguments by name, for the table of stage options.
        given = locals()
        super().__init__(**kwargs)
        if not isinstance(adaptive, bool):
            raise TypeError(
                "Invalid value for argument `adaptive`. Expected True or "
                f"False. Received: adaptive={adaptive!r}"
            )
        self.adaptive = adaptive
        # A config from `get_config` names exception classes; resolve them.
        options = {
            option.name: option.from_config(given[option.name])
            for option in _LAYER_OPTIONS
        }
        self.stage_options = StageOptions(
            name=_stage_name(self.name), **options
        )
        self.supports_masking = True
        self.built = True

    staged_by_model = False  # set by the keras_stage model that stages it

    def call(self, inputs, training=None):
        # Only training is warned: inference and export are meant to pass.
        if training is True and not self.staged_by_model:
            warn_not_staged(
                self,
                "it is trained by a model that keras_stage does not run (a "
                "plain `keras.Model` or `keras.Sequential`, or a custom "
                "training loop)",
            )
        return inputs

    def compute_output_spec(self, inputs, training=None):
        # New tensors of the same kind: Keras's default drops the ragged
        # flag, and the inputs themselves would get a new Keras history.
        return keras.tree.map_structure(
            lambda t: keras.KerasTensor(
                t.shape, dtype=t.dtype, sparse=t.sparse, ragged=t.ragged
            ),
            inputs,
        )

    def stage(
        self,
        dataset,
        fn=None,
        name=None,
        stats=None,
        distributed=False,
        unpacks=False,
        rebatch=None,
        cardinality=None,
        consumer_records=False,
        per_copy=None,
        reads_in_python=False,
        pool_start=None,
        **overrides,
    ):
        """Stages `dataset` with this layer's options; returns the
        `StagedDataset`. `name` defaults to the layer's; `overrides` are
        options that differ for this stage (`service=None` stages in this
        process); the rest are `keras_stage.data.staging.build_stage`'s.
        """
        config = self.stage_options.get_config()
        config["name"] = name or self.stage_options.name
        config.update(overrides)
        return build_stage(
            dataset,
            fn,
            StageOptions(**config),
            stats,
            distributed=distributed,
            unpacks=unpacks,
            rebatch=rebatch,
            cardinality=cardinality,
            consumer_records=consumer_records,
            per_copy=per_copy,
            reads_in_python=reads_in_python,
            pool_start=pool_start,
        )

    def new_stats(self, name):
        """Fresh `StageStats` for a stage of this layer named `name`."""
        return new_stats(self.stage_options, name)

    def get_config(self):
        config = super().get_config()
        for option in _LAYER_OPTIONS:
            value = getattr(self.stage_options, option.name)
            config[option.name] = option.to_config(value)
        config["adaptive"] = self.adaptive
        return config
