"""The only place keras_stage touches private TensorFlow/Keras symbols.

Each function wraps one private attribute and says why it is unavoidable;
`tests/_compat_test.py` fails when a release moves one. Keras is imported
inside the functions, so the Keras-free `keras_stage.data` can use this.
"""

import importlib
import warnings

# Keras releases whose private symbols were checked.
TESTED_KERAS = ("3.15",)


def _keras_private(module, name):
    import keras

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"keras_stage needs the private Keras symbol {module}.{name}, "
            f"which Keras {keras.__version__} does not have. keras_stage is "
            f"tested with Keras {', '.join(TESTED_KERAS)}: install one of "
            "those (pip install 'keras==3.15.*') or upgrade keras_stage."
        ) from e


def dataset_variant(dataset):
    """A dataset's variant tensor, which subclasses wrap (`_variant_tensor`)."""
    return dataset._variant_tensor


def private_map_dataset():
    """TensorFlow's private `_MapDataset` class, or None if it moved."""
    try:
        from tensorflow.python.data.ops import map_op
    except ImportError:
        return None
    return getattr(map_op, "_MapDataset", None)


def inline_map(dataset, fn, name):
    """`dataset.map(fn, name=name)` with `fn`'s ops on the calling thread (only
    the private `_MapDataset` can), for tiny maps without control flow."""
    import tensorflow as tf

    fn = tf.autograph.experimental.do_not_convert(fn)
    map_dataset = private_map_dataset()
    if map_dataset is None:
        return dataset.map(fn, name=name)
    return map_dataset(
        dataset,
        fn,
        use_inter_op_parallelism=False,
        preserve_cardinality=True,
        name=name,
    )


# What `get_data_adapter` warned again, for the warnings filters' "once".
_REWARNED = {}


def get_data_adapter(**kwargs):
    """Keras's converter of fit/evaluate/predict inputs to tf.data: inputs
    must become a dataset exactly as Keras makes it, which is not public."""
    get = _keras_private("keras.src.trainers.data_adapters", "get_data_adapter")
    # A warning Keras gives for this line is given again from Keras's own.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapter = get(**kwargs)
    for caught_warning in caught:
        if caught_warning.filename == __file__:
            where = get.__code__.co_filename, get.__code__.co_firstlineno
        else:
            where = caught_warning.filename, caught_warning.lineno
        warnings.warn_explicit(
            caught_warning.message,
            caught_warning.category,
            *where,
            registry=_REWARNED,  # the "once per location" of a plain warn
        )
    return adapter


def distributed_dataset_adapter(dataset):
    """Keras's adapter of `dataset`, taken as it is (a stage's own
    `DistributedDataset`, or one Keras would shard again on JAX)."""
    adapter = _keras_private(
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
        "TFDatasetAdapter",
    )
    return adapter(dataset)


def array_adapter_inputs(adapter):
    """The arrays an `ArrayDataAdapter` batches (in `_inputs`), or None."""
    adapter_class = _keras_private(
        "keras.src.trainers.data_adapters.array_data_adapter",
        "ArrayDataAdapter",
    )
    if type(adapter) is not adapter_class:
        return None
    convert = _keras_private(
        "keras.src.trainers.data_adapters.array_slicing",
        "convert_to_sliceable",
    )
    return convert(adapter._inputs, target_backend="tensorflow")


def train_validation_split(arrays, validation_split):
    """Keras's split of arrays for `validation_split` (last fraction)."""
    split = _keras_private(
        "keras.src.trainers.data_adapters.array_slicing",
        "train_validation_split",
    )
    return split(arrays, validation_split=validation_split)


def keras_functional_class():
    """Keras's `Functional` model class, which has no public name."""
    return _keras_private("keras.src.models.functional", "Functional")


def functional_nodes(model):
    """The call nodes of a functional model, producers first, inputs left
    out (only in `_nodes_by_depth`: a layer's inbound nodes hold others')."""
    by_depth = model._nodes_by_depth
    nodes = []
    for depth in sorted(by_depth, reverse=True):
        nodes.extend(
            node
            for node in by_depth[depth]
            if node.operation is not None and not node.is_input
        )
    return nodes


def call_node(node, values, **kwargs):
    """Calls a node's layer on `values` (by `id(KerasTensor)`) as Functional
    does (`Node` is not exported); returns the outputs as a flat list."""
    import keras

    args, call_kwargs = node_arguments(node, values)
    call_kwargs = {**call_kwargs, **kwargs}
    return keras.tree.flatten(node.operation(*args, **call_kwargs))


def node_arguments(node, values):
    """A node's call arguments `(args, kwargs)`, its KerasTensors replaced by
    `values` (by `id(KerasTensor)`)."""
    return node.arguments.fill_in(values)


def node_call_kwargs(node):
    """The keyword arguments a node's call was given (`training=` too)."""
    return node.arguments.kwargs


def node_inputs(node):
    """The KerasTensors a node consumes (flat) and those it produces."""
    return list(node.input_tensors), list(node.outputs)


def clear_layer_losses(layer):
    """Drops a layer's losses of its last outermost call (no public way)."""
    layer._clear_losses()


def builds_from_data(model):
    """Whether Keras's next fit/evaluate builds the model from a batch (as
    `Trainer._symbolic_build` does: model, metrics or loss not built)."""
    loss = model._compile_loss
    return (
        not layers_built(model)
        or metrics_unbuilt(model)
        or (loss is not None and not loss.built)
    )


def metrics_unbuilt(model):
    """Whether `_compile_metrics` (Keras's only record) are not built yet."""
    metrics = model._compile_metrics
    return metrics is not None and not metrics.built


def layers_built(model):
    """Whether `model`'s layers, nested too (`_flatten_layers`), are built."""
    return all(layer.built for layer in model._flatten_layers())


def symbolic_build(model, data_spec):
    """Builds the compile metrics, loss and optimizer from raw-data specs, so
    Keras's build (from a SmartStage batch of cut tensors) is a no-op."""
    model._symbolic_build(data_batch=data_spec)


# The keyword Keras's fit passes to evaluate for its validation runs.
FIT_VALIDATION_KWARG = "_use_cached_eval_dataset"


def is_fit_validation(evaluate_kwargs):
    """Whether an evaluate is fit's validation: only a private kwarg says."""
    return bool(evaluate_kwargs.get(FIT_VALIDATION_KWARG))


def dataset_inputs(dataset):
    """The datasets `dataset` is built on (`Dataset._inputs`), or None."""
    try:
        return list(dataset._inputs())
    except (AttributeError, NotImplementedError, TypeError):
        return None


def dataset_functions(dataset):
    """The traced functions of `dataset`'s own transformation (maps,
    filters), only in `Dataset._functions()`; None if unreadable."""
    try:
        return [wrapper.function for wrapper in dataset._functions()]
    except (AttributeError, NotImplementedError, TypeError):
        return None


def dataset_seeded(dataset):
    """Whether a drawing dataset (`shuffle`, `random`) has a fixed seed, from
    `_seed` and `_seed2` (the only record); True when they cannot be read."""
    try:
        seeds = (dataset._seed, dataset._seed2)
    except AttributeError:
        return True
    try:
        return any(int(seed) != 0 for seed in seeds)
    except (TypeError, ValueError):
        return True


def service_server_port(server):
    """The port a tf.data service server took (only in `_address`)."""
    return int(server._address.rsplit(":", 1)[1])


def backend_seed_generators(layer):
    """The SeedGenerators Keras made for `layer`'s calls on another backend
    (only in `DataLayer._backend_generators`), which SmartStage seeds."""
    return list(vars(layer).get("_backend_generators", {}).values())


def backup_files(backup):
    """The weights and metadata paths of a `BackupAndRestore` (private)."""
    return backup._weights_path, backup._training_metadata_path
