"""The only place keras_stage touches private TensorFlow/Keras symbols.

Each function wraps one private attribute with a comment saying why it is
unavoidable. `_keras_private` turns a moved symbol into an error naming the
installed Keras and the versions keras_stage was tested with, and
`tests/_compat_test.py` fails loudly when a new release moves one. Keras is
imported inside the functions that need it, so the Keras-free engine
(`keras_stage.data`) can use this module too.
"""

import importlib
import warnings

# Keras releases whose private symbols below were checked.
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
    """The variant tensor of a `tf.data.Dataset`.

    `tf.data.Dataset.__init__` takes it to build a dataset subclass (what
    `StagedDataset` is), but TF exposes it only as `_variant_tensor`.
    """
    return dataset._variant_tensor


def private_map_dataset():
    """TensorFlow's private `_MapDataset` class, or None if it moved."""
    try:
        from tensorflow.python.data.ops import map_op
    except ImportError:
        return None
    return getattr(map_op, "_MapDataset", None)


def inline_map(dataset, fn, name):
    """`dataset.map(fn, name=name)` with `fn`'s ops run by the calling thread.

    For the stage's own tiny per-element functions, whose hand-offs to the
    inter-op pool would cost more than their ops. The switch
    (`use_inter_op_parallelism=False`) is only on TensorFlow's private
    `_MapDataset`; should it move, this is the public map and
    `tests/data/engine_boundary_test.py` fails. `fn` must hold no control
    flow (that executor rejects it): never a user's function.
    """
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
    """Keras's own converter of fit/evaluate/predict inputs to tf.data.

    keras_stage must turn numpy arrays, generators and PyDatasets into a
    dataset exactly as Keras does (same batching, same shuffling, same
    class weights) before staging it; Keras has no public API for this.
    """
    get = _keras_private("keras.src.trainers.data_adapters", "get_data_adapter")
    # Keras warns for its caller, this line: such a warning is given again
    # from the Keras function, so that it does not read as keras_stage's.
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
    """Keras's adapter of `dataset`, which Keras takes as it is.

    For the stage's own `tf.distribute.DistributedDataset` (Keras takes
    only TensorFlow's, by class name) and a dataset on JAX across processes
    (Keras would shard it again). `dataset` needs `cardinality()`.
    """
    adapter = _keras_private(
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
        "TFDatasetAdapter",
    )
    return adapter(dataset)


def array_adapter_inputs(adapter):
    """The arrays a Keras array adapter batches, or None for other adapters.

    `(x, y, sample_weight)` packed and converted as Keras does before it
    gathers batches; Keras keeps them only in `ArrayDataAdapter._inputs`.
    """
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
    """Keras's `Functional` model class.

    `keras_stage.Model(inputs, outputs)` must build a functional model of a
    keras_stage class without letting Keras rewrite `keras_stage.Model`'s
    bases (see `models/model.py`); Keras exports no public name for it.
    """
    return _keras_private("keras.src.models.functional", "Functional")


def functional_nodes(model):
    """The call nodes of a functional model, producers first.

    The planner must see which layer call feeds which; Keras keeps that
    only in `Function._nodes_by_depth` (a layer's own inbound-node list also
    holds nodes of other models built on it, so it cannot be used).
    Input nodes are left out.
    """
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
    """Calls a node's layer on computed values, as Keras's Functional does.

    `values` maps `id(KerasTensor)` to the value computed for it. Returns
    the node's outputs as a flat list, aligned with `node.outputs`. Keras's
    `Node` and `SymbolicArguments` classes are not exported.
    """
    import keras

    args, call_kwargs = node.arguments.fill_in(values)
    call_kwargs = {**call_kwargs, **kwargs}
    return keras.tree.flatten(node.operation(*args, **call_kwargs))


def node_inputs(node):
    """The KerasTensors a node consumes (flat) and those it produces."""
    return list(node.input_tensors), list(node.outputs)


def clear_layer_losses(layer):
    """Drops the losses a layer recorded in its last outermost call.

    The planner's trace calls layers in a graph of its own; Keras clears a
    layer's losses only at its next outermost call and has no public way
    to do it now.
    """
    layer._clear_losses()


def builds_from_data(model):
    """Whether Keras's next fit/evaluate builds the model from a batch.

    The condition of `Trainer._symbolic_build`, which on JAX reads a first
    batch from an iterator of its own before the epochs begin: the model
    or its compiled metrics or loss are not built yet.
    """
    loss = model._compile_loss
    return (
        not layers_built(model)
        or metrics_unbuilt(model)
        or (loss is not None and not loss.built)
    )


def metrics_unbuilt(model):
    """Whether `model` has compile metrics that are not built yet.

    Keras keeps them only in `Trainer._compile_metrics` (None without
    metrics); they are built on their first update, creating variables.
    """
    metrics = model._compile_metrics
    return metrics is not None and not metrics.built


def layers_built(model):
    """Whether every layer of `model`, nested ones too, is built.

    Keras lists a model's nested layers only through `_flatten_layers`.
    """
    return all(layer.built for layer in model._flatten_layers())


def symbolic_build(model, data_spec):
    """Builds the compile metrics, loss and optimizer from raw-data specs.

    Keras builds them in the first traced step (tracing it twice), or
    under a strategy from a batch of the data, which with SmartStage holds
    the cut tensors, not the model's inputs. Building first from the raw
    data's `element_spec` makes Keras's own build a no-op.
    """
    model._symbolic_build(data_batch=data_spec)


# The keyword Keras's fit passes to evaluate for its validation runs.
FIT_VALIDATION_KWARG = "_use_cached_eval_dataset"


def is_fit_validation(evaluate_kwargs):
    """Whether an `evaluate` call is the validation run of a `fit`.

    Such an evaluate must not stage again; Keras's private keyword is the
    only sign.
    """
    return bool(evaluate_kwargs.get(FIT_VALIDATION_KWARG))


def dataset_inputs(dataset):
    """The datasets `dataset` is built on (its inputs), or None if unknown.

    tf.data lists them only in `Dataset._inputs`.
    """
    try:
        return list(dataset._inputs())
    except (AttributeError, NotImplementedError, TypeError):
        return None


def dataset_functions(dataset):
    """The traced functions of `dataset`'s own transformation (maps, filters).

    tf.data keeps them only in `Dataset._functions()`, each a structured
    function wrapper whose `function` is the concrete function tf.data
    runs. None if they cannot be read.
    """
    try:
        return [wrapper.function for wrapper in dataset._functions()]
    except (AttributeError, NotImplementedError, TypeError):
        return None


def dataset_seeded(dataset):
    """Whether a drawing dataset (`shuffle`, `random`) has a fixed seed.

    tf.data keeps its op seeds only in `_seed` and `_seed2`, both 0 when
    unseeded. True when they cannot be read (the safe guess).
    """
    try:
        seeds = (dataset._seed, dataset._seed2)
    except AttributeError:
        return True
    try:
        return any(int(seed) != 0 for seed in seeds)
    except (TypeError, ValueError):
        return True


def service_server_port(server):
    """The port a tf.data service `DispatchServer` or `WorkerServer` took.

    A server started on port 0 says which it took only in `_address`.
    """
    return int(server._address.rsplit(":", 1)[1])


def backend_seed_generators(layer):
    """The SeedGenerators Keras made for `layer`'s calls on another backend.

    On JAX, a preprocessing layer called in tf.data keeps its TensorFlow
    SeedGenerators only in `DataLayer._backend_generators`; SmartStage
    seeds them per batch.
    """
    return list(vars(layer).get("_backend_generators", {}).values())


def backup_files(backup):
    """The weights and metadata files a `BackupAndRestore` writes and loads.

    Keras names them only in private attributes; `DataBackup` keeps a copy
    of both with each data position.
    """
    return backup._weights_path, backup._training_metadata_path
