"""`StagedInput`: the layer that marks a model's stage boundary.

The layer owns the stage's options and nothing else. In a staged run (`fit`,
`evaluate`, `predict` of a `keras_stage.Model`) the data reaching it comes
out of a stage built with those options; everywhere else (a plain call,
`export`, serving) it is an identity, so the saved model is a normal model.
"""

import builtins
import importlib
import re

import keras
import tensorflow as tf

from keras_stage.data.options import AUTO, StageOptions
from keras_stage.data.staging import build_stage, new_stats


def _exception_to_name(cls):
    if getattr(tf.errors, cls.__name__, None) is cls:
        return f"tf.errors.{cls.__name__}"
    if getattr(builtins, cls.__name__, None) is cls:
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def _exception_from_name(name, argument):
    """The exception class named `name` (as `get_config` stores it)."""
    if not isinstance(name, str):
        return name
    found = _find_exception(name)
    if found is None:
        raise ValueError(
            f"Invalid value for argument `{argument}`: cannot find the "
            f"exception class {name!r}. Use a class, or a name such as "
            '"tf.errors.DataLossError", "ValueError" or '
            '"my_package.errors.CorruptRecordError" (import the module that '
            f"defines it before loading). Received: {argument} containing "
            f"{name!r}"
        )
    return found


def _find_exception(name):
    if name.startswith("tf.errors."):
        return getattr(tf.errors, name[len("tf.errors.") :], None)
    if "." not in name:
        return getattr(builtins, name, None)
    # "package.module.Outer.Inner": the module is the longest importable
    # prefix, the rest is the class's __qualname__.
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute, None)
            if found is None:
                return None
        return found
    return None


def _stage_name(layer_name):
    # tf.data names must be identifiers; Keras layer names may not be.
    name = re.sub(r"\W", "_", layer_name)
    return name if name.isidentifier() else f"stage_{name}"


@keras.saving.register_keras_serializable(package="keras_stage")
class StagedInput(keras.layers.Layer):
    """Marks where the stage ends: everything before it runs ahead of training.

    Put it first in a `keras_stage.Model` or `keras_stage.Sequential`. During
    `fit`, `evaluate` and `predict` the model's data goes through a stage
    (`keras_stage.data.stage`) with these options: produced on `num_threads`
    parallel workers of a private thread pool and buffered up to `capacity`
    batches ahead of the training step. Outside a staged run the layer is an
    identity: `model(x)`, `export` and serving see a normal model.

    It accepts a tensor, a list or a dict (dense, ragged or sparse leaves)
    and returns the same structure. The layer's name names the stage in
    errors and logs.

    Args:
        capacity: Maximum number of finished batches waiting for the
            training step: a positive int or `"auto"` (tf.data autotuning;
            8 batches for a stage with nothing to compute). Defaults to
            `"auto"`.
        num_threads: Batches produced at once: a positive int or `"auto"`
            (tf.data autotuning, allowed to grow past the core count for
            stages that wait on IO). Defaults to `"auto"`.
        closed_exception_types: Errors that end the data gracefully.
            Defaults to `(tf.errors.OutOfRangeError,)`.
        ignored_exception_types: Errors whose batch is skipped, counted and
            reported per epoch; training goes on. Defaults to `()`.
        timeout: Seconds the training step may wait for one batch before a
            `keras_stage.data.StageTimeoutError`; `None` waits forever.
            Defaults to `300.0`.
        thread_pool_size: Size of the stage's private thread pool; `None`
            sizes it from `num_threads`, and with `num_threads="auto"`
            `PrefetchCallback` resizes it after each training epoch: 4 per
            core (at least 16) while the step waits for data, one per core
            once an epoch kept up with no more threads than that (see
            `keras_stage.data.pool`). Defaults to `None`.
        deterministic: Keep the batch order, so a staged run trains exactly
            like an unstaged one. Defaults to `True`.
        device: Where finished batches wait: `"auto"` (on the first GPU
            when there is one, copied ahead of the step so the copy
            overlaps compute; else on the host), `"cpu"` (the host), or a
            device such as `"/GPU:1"`. Staged layers always run on host
            threads. Under a `tf.distribute` strategy each replica's device
            holds its own buffer. Defaults to `"auto"`.
        stream: Stream `k` made by `keras_stage.configure_streams`: the
            copies into the device buffer run on that logical device's
            streams, beside the training step's. `None` uses the step's
            device. Without a GPU it warns once and does nothing. Defaults
            to `None`.
        pack_transfer: Pack a batch's many small tensors per dtype into one
            tensor each, so the copy to the device is a few large copies
            (unpacked on the device in the step): `"auto"` (when it copies
            fewer tensors), `True` or `False`. Defaults to `"auto"`.
        service: The address of a tf.data service dispatcher,
            `"grpc://host:port"`: the data and the staged layers run on the
            service's workers (other machines' CPUs), and finished batches
            come back into this process's buffer. Needs a tf.data source
            (a `tf.data.Dataset`, arrays or tensors), not a generator.
            `None` stages in this process. Defaults to `None`.
        processing_mode: How the service's workers share an epoch:
            `"distributed_epoch"` (each example once per epoch, split
            across the workers) or `"parallel_epochs"` (every worker runs
            the whole dataset). Defaults to `"distributed_epoch"`.
        adaptive: Stage a fit/evaluate/predict call on in-memory arrays
            only when it can pay: a call too short to repay its stage's
            set-up (one batch, or less staged work in all than the set-up
            measured on the model's earlier staged calls) runs the whole
            model in Keras's own step instead, with the same results.
            Within a SmartStage fit, an epoch whose step did not wait for
            input is followed by one run with the whole model in the step,
            and the faster of the two runs the remaining epochs (see
            `keras_stage.models.epoch_switch`). `False` stages every call
            and every epoch. Calls with exception policies
            (`ignored_exception_types`, other `closed_exception_types`) or
            a `service` are always staged, and so are calls on datasets,
            generators or PyDatasets (their epochs may be switched).
            Defaults to `True`.
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

    Threads: the stage's workers are tf.data threads, not Python threads;
    the only Python thread a staged run adds is the one that enforces
    `timeout` (none with `timeout=None`).
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
        adaptive=True,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(adaptive, bool):
            raise TypeError(
                "Invalid value for argument `adaptive`. Expected True or "
                f"False. Received: adaptive={adaptive!r}"
            )
        self.adaptive = adaptive
        if isinstance(closed_exception_types, (list, tuple)):
            closed_exception_types = tuple(
                _exception_from_name(t, "closed_exception_types")
                for t in closed_exception_types
            )
        if isinstance(ignored_exception_types, (list, tuple)):
            ignored_exception_types = tuple(
                _exception_from_name(t, "ignored_exception_types")
                for t in ignored_exception_types
            )
        self.stage_options = StageOptions(
            capacity=capacity,
            num_threads=num_threads,
            closed_exception_types=closed_exception_types,
            ignored_exception_types=ignored_exception_types,
            timeout=timeout,
            thread_pool_size=thread_pool_size,
            deterministic=deterministic,
            name=_stage_name(self.name),
            device=device,
            stream=stream,
            pack_transfer=pack_transfer,
            service=service,
            processing_mode=processing_mode,
        )
        self.supports_masking = True
        self.built = True

    def call(self, inputs):
        return inputs

    def compute_output_spec(self, inputs):
        # New tensors of the same kind: Keras's traced default drops the
        # ragged flag, and returning the inputs themselves would rewrite
        # their Keras history.
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
        **overrides,
    ):
        """Stages `dataset` with this layer's options.

        Args:
            dataset: A `tf.data.Dataset`.
            fn: The staged computation, or `None`. Defaults to `None`.
            name: Stage name; defaults to the layer's name.
            stats: The `keras_stage.data.StageStats` to count in, kept by
                a consumer across stages; `None` for new ones. Defaults to
                `None`.
            distributed: Whether a `tf.distribute` strategy with several
                replicas consumes it (each replica's device then holds its
                own buffer). Defaults to `False`.
            unpacks: Whether the consumer unpacks packed elements in its
                step (`StagedDataset.unpack`). Defaults to `False`.
            rebatch: With a `service`: the batch size to re-form after the
                workers (each batches its own share), or `None`. Defaults
                to `None`.
            cardinality: The number of batches each epoch of the stage
                yields, when known, or `None`. Defaults to `None`.
            consumer_records: Whether the consumer records its fetches in
                its own step with `stats` (and reads only
                `lean_pipeline`). Defaults to `False`.
            **overrides: Options that differ from the layer's for this
                stage (e.g. `service=None` to stage in this process).

        Returns:
            A `keras_stage.data.StagedDataset`.
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
        )

    def new_stats(self, name):
        """Fresh `StageStats` for a stage of this layer named `name`."""
        return new_stats(self.stage_options, name)

    def get_config(self):
        config = super().get_config()
        options = self.stage_options.get_config()
        options.pop("name")  # the layer's own name
        options["closed_exception_types"] = [
            _exception_to_name(t) for t in options["closed_exception_types"]
        ]
        options["ignored_exception_types"] = [
            _exception_to_name(t) for t in options["ignored_exception_types"]
        ]
        config.update(options)
        config["adaptive"] = self.adaptive
        return config
