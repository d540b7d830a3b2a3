"""The private TensorFlow/Keras symbols in `keras_stage/_compat.py` still fit.

Each test fails with a message naming the symbol and the `_compat` function
to update when a new TensorFlow or Keras release moves or changes it.
"""

import importlib
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage import _compat
from keras_stage.data import stage
from keras_stage.models.model import _functional_init_arguments

UPDATE = "update keras_stage/_compat.py:{}"


def _private(module_name, attribute, compat_function):
    module = importlib.import_module(module_name)
    assert hasattr(module, attribute), (
        f"{module_name}.{attribute} is gone in Keras {keras.__version__} / "
        f"TensorFlow {tf.__version__}; " + UPDATE.format(compat_function)
    )
    return getattr(module, attribute)


def test_installed_versions_are_the_supported_ones():
    major = int(keras.__version__.split(".")[0])
    assert major == 3, (
        f"keras_stage targets Keras 3; found Keras {keras.__version__}."
    )
    tf_minor = tuple(int(p) for p in tf.__version__.split(".")[:2])
    assert (2, 16) <= tf_minor <= (2, 21), (
        f"keras_stage supports TensorFlow 2.16-2.21; found {tf.__version__}. "
        "Run this suite on the new release and widen the range in "
        "keras_stage/__init__.py and pyproject.toml."
    )
    assert keras.backend.backend() == "tensorflow"


def test_installed_keras_is_one_the_private_symbols_were_checked_with():
    assert keras.__version__.startswith(_compat.TESTED_KERAS), (
        f"Keras {keras.__version__} is not in _compat.TESTED_KERAS "
        f"{_compat.TESTED_KERAS}: run this file against it, then add it."
    )


def test_a_moved_private_keras_symbol_fails_with_a_clear_message():
    with pytest.raises(
        ImportError,
        match=(
            r"keras_stage needs the private Keras symbol "
            r"keras\.src\.no_such_module\.thing, which Keras "
            + keras.__version__.replace(".", r"\.")
            + r" does not have\. keras_stage is tested with Keras 3\.15"
        ),
    ):
        _compat._keras_private("keras.src.no_such_module", "thing")
    with pytest.raises(ImportError, match=r"keras\.src\.models\.nothing"):
        _compat._keras_private("keras.src.models", "nothing")


# -- dataset_variant -------------------------------------------------------


def test_dataset_variant_is_the_variant_tensor_a_dataset_is_built_from():
    dataset = tf.data.Dataset.range(3)
    assert hasattr(dataset, "_variant_tensor"), (
        "tf.data.Dataset._variant_tensor is gone in TensorFlow "
        f"{tf.__version__}; " + UPDATE.format("dataset_variant")
    )
    variant = _compat.dataset_variant(dataset)
    assert isinstance(variant, tf.Tensor)
    assert variant.dtype == tf.variant
    # What StagedDataset relies on: a Dataset subclass built on it works.
    staged = stage(dataset, capacity=1, num_threads=1, name="compat")
    assert [int(x) for x in staged] == [0, 1, 2]
    assert staged.close()


# -- get_data_adapter ----------------------------------------------------------


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return np.full((2, 1), index, "float32"), np.zeros((2, 1), "float32")


def _generator():
    for i in range(3):
        yield np.full((2, 1), i, "float32"), np.zeros((2, 1), "float32")


@pytest.mark.parametrize(
    "kwargs, num_batches",
    [
        (dict(x=np.ones((10, 1)), y=np.ones((10, 1)), batch_size=4), 3),
        (dict(x={"a": np.ones((6, 1))}, y=np.ones((6, 1)), batch_size=3), 2),
        (dict(x=tf.data.Dataset.range(5).batch(2)), 3),
        (dict(x=_Batches()), 2),
        (dict(x=_generator()), None),
    ],
    ids=["arrays", "dict", "dataset", "py_dataset", "generator"],
)
def test_get_data_adapter_gives_what_keras_stage_uses(kwargs, num_batches):
    _private(
        "keras.src.trainers.data_adapters",
        "get_data_adapter",
        "get_data_adapter",
    )
    adapter = _compat.get_data_adapter(
        **{
            "y": None,
            "sample_weight": None,
            "batch_size": None,
            "steps_per_epoch": None,
            "shuffle": False,
            "class_weight": None,
            **kwargs,
        }
    )
    # Everything models/data_adapters/staged_data.py and the PrefetchCallback
    # call on it.
    for name in ("get_tf_dataset", "on_epoch_begin", "on_epoch_end"):
        assert callable(getattr(adapter, name, None)), (
            f"Keras data adapters lost `{name}`; "
            + UPDATE.format("get_data_adapter")
        )
    assert adapter.num_batches == num_batches
    adapter.on_epoch_begin()
    dataset = adapter.get_tf_dataset()
    assert isinstance(dataset, tf.data.Dataset)
    assert len(list(dataset)) == (num_batches or 3)
    adapter.on_epoch_end()


def test_a_keras_warning_names_keras_not_keras_stage():
    # Keras warns for its caller (stacklevel=2): through the wrapper the
    # location would be keras_stage's own line.
    dataset = tf.data.Dataset.from_tensor_slices(np.zeros((4, 2))).batch(2)
    with pytest.warns(UserWarning, match="`shuffle=True` was passed") as got:
        _compat.get_data_adapter(
            x=dataset,
            y=None,
            sample_weight=None,
            batch_size=None,
            steps_per_epoch=None,
            shuffle=True,
            class_weight=None,
        )
    (warning,) = got
    assert "keras_stage" not in warning.filename, warning.filename
    assert warning.filename.endswith(
        os.path.join("keras", "src", "trainers", "data_adapters", "__init__.py")
    ), warning.filename


def test_a_staged_fit_gives_keras_s_shuffle_warning_from_keras():
    inputs = keras.Input((2,))
    x = keras_stage.layers.StagedInput()(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(loss="mse")
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((4, 2)), np.zeros((4, 1)))
    ).batch(2)
    with pytest.warns(UserWarning, match="`shuffle=True` was passed") as got:
        model.fit(data, verbose=0)  # fit's default shuffle=True, as plain's
    assert [w.filename for w in got if "keras_stage" in w.filename] == []


def test_get_data_adapter_shuffles_with_the_global_seed():
    # A staged fit and a plain one see the same order only if Keras's
    # shuffle draws from the seed set by keras.utils.set_random_seed.
    def order():
        keras.utils.set_random_seed(3)
        adapter = _compat.get_data_adapter(
            x=np.arange(16, dtype="float32").reshape(16, 1),
            y=None,
            sample_weight=None,
            batch_size=4,
            steps_per_epoch=None,
            shuffle=True,
            class_weight=None,
        )
        return np.concatenate([b[0] for b in adapter.get_tf_dataset()]).ravel()

    first, second = order(), order()
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first, np.arange(16))


def test_array_adapter_inputs_are_the_arrays_keras_batches():
    _private(
        "keras.src.trainers.data_adapters.array_data_adapter",
        "ArrayDataAdapter",
        "array_adapter_inputs",
    )
    _private(
        "keras.src.trainers.data_adapters.array_slicing",
        "convert_to_sliceable",
        "array_adapter_inputs",
    )
    x = {"a": np.arange(6, dtype="float64").reshape(3, 2)}
    y = np.array([0, 1, 1])
    adapter = _compat.get_data_adapter(
        x=x,
        y=y,
        sample_weight=None,
        batch_size=2,
        steps_per_epoch=None,
        shuffle=False,
        class_weight={0: 1.0, 1: 3.0},
    )
    inputs = _compat.array_adapter_inputs(adapter)
    assert inputs is not None, (
        "Keras's array adapter is no longer ArrayDataAdapter; "
        + UPDATE.format("array_adapter_inputs")
    )
    # Packed (x, y, sample_weight) with the class weights as sample
    # weights, floats cast to floatx: what Keras's own dataset yields.
    (batch,) = list(adapter.get_tf_dataset().take(1))
    first = keras.tree.map_structure(lambda t: np.asarray(t)[:2], inputs)
    keras.tree.assert_same_structure(keras.tree.lists_to_tuples(first), batch)
    for want, have in zip(
        keras.tree.flatten(batch), keras.tree.flatten(first), strict=True
    ):
        np.testing.assert_array_equal(want.numpy(), have)
    np.testing.assert_array_equal(first[2], [1.0, 3.0])
    assert first[0]["a"].dtype == np.float32
    dataset = tf.data.Dataset.range(3).batch(2)
    other = _compat.get_data_adapter(
        x=dataset,
        y=None,
        sample_weight=None,
        batch_size=None,
        steps_per_epoch=None,
        shuffle=False,
        class_weight=None,
    )
    assert _compat.array_adapter_inputs(other) is None


# -- train_validation_split ---------------------------------------------------


def test_train_validation_split_keeps_the_last_fraction_for_validation():
    _private(
        "keras.src.trainers.data_adapters.array_slicing",
        "train_validation_split",
        "train_validation_split",
    )
    x = np.arange(10).reshape(10, 1)
    y = np.arange(10)
    (train_x, train_y, train_w), (val_x, val_y, val_w) = (
        _compat.train_validation_split((x, y, None), 0.2)
    )
    np.testing.assert_array_equal(train_x.ravel(), np.arange(8))
    np.testing.assert_array_equal(val_y, [8, 9])
    assert train_w is None and val_w is None

    (train, _, _), (val, _, _) = _compat.train_validation_split(
        ({"a": x}, y, None), 0.5
    )
    assert set(train) == {"a"}
    assert len(train["a"]) == 5 and len(val["a"]) == 5


def test_train_validation_split_rejects_datasets_like_keras():
    with pytest.raises(ValueError, match="validation_split"):
        _compat.train_validation_split(
            (tf.data.Dataset.range(4), None, None), 0.5
        )


# -- keras_functional_class ----------------------------------------------------


def test_keras_functional_class_is_what_keras_model_inputs_outputs_builds():
    functional = _private(
        "keras.src.models.functional", "Functional", "keras_functional_class"
    )
    assert _compat.keras_functional_class() is functional
    assert issubclass(functional, keras.Model)
    inputs = keras.Input(shape=(2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert type(model) is functional, (
        "keras.Model(inputs, outputs) no longer builds "
        "keras.src.models.functional.Functional; "
        + UPDATE.format("keras_functional_class")
    )


# -- _functional_init_arguments --------------------------------------------


_A, _B, _C = object(), object(), object()

INIT_CASES = [
    ((), {}),
    ((_A,), {}),
    ((_A, _B), {}),
    ((_A, _B, _C), {}),
    ((_A,), {"outputs": _B}),
    ((_A,), {"inputs": _B}),
    ((), {"inputs": _A, "outputs": _B}),
    ((), {"inputs": _A}),
    ((), {"outputs": _B}),
    ((), {"name": "m"}),
    ((_A, _B), {"name": "m"}),
    ((), {"inputs": _A, "outputs": _B, "name": "m"}),
    ((_A,), {"outputs": _B, "trainable": False}),
]


@pytest.mark.parametrize("args, kwargs", INIT_CASES)
def test_functional_init_arguments_agrees_with_keras(args, kwargs):
    keras_test = _private(
        "keras.src.models.model",
        "functional_init_arguments",
        "(models/model.py) _functional_init_arguments",
    )
    assert _functional_init_arguments(args, kwargs) == keras_test(
        args, kwargs
    ), f"disagree on args={len(args)} kwargs={sorted(kwargs)}"


# -- functional_nodes / call_node / node_inputs / clear_layer_losses -------


def _small_functional():
    inputs = keras.Input(shape=(3,), name="x")
    scaled = keras.layers.Rescaling(2.0, name="scale")(inputs)
    outputs = keras.layers.Add(name="add")([scaled, inputs])
    return keras.Model(inputs, outputs), inputs, scaled, outputs


def test_functional_nodes_are_the_call_nodes_producers_first():
    model, _, _, _ = _small_functional()
    assert hasattr(model, "_nodes_by_depth"), (
        "Functional._nodes_by_depth is gone in Keras "
        f"{keras.__version__}; " + UPDATE.format("functional_nodes")
    )
    nodes = _compat.functional_nodes(model)
    assert [n.operation.name for n in nodes] == ["scale", "add"]


def test_node_inputs_and_call_node_replay_a_node():
    model, inputs, scaled, outputs = _small_functional()
    add = _compat.functional_nodes(model)[1]
    consumed, produced = _compat.node_inputs(add)
    assert [id(t) for t in consumed] == [id(scaled), id(inputs)], (
        "Node.input_tensors changed in Keras "
        f"{keras.__version__}; " + UPDATE.format("node_inputs")
    )
    assert [id(t) for t in produced] == [id(outputs)]
    values = {id(scaled): tf.ones((1, 3)), id(inputs): tf.ones((1, 3))}
    [result] = _compat.call_node(add, values)
    np.testing.assert_array_equal(result, np.full((1, 3), 2.0))


def test_node_call_kwargs_hold_the_training_flag_given():
    inputs = keras.Input(shape=(3,))
    outputs = keras.layers.Dropout(0.5)(inputs, training=True)
    model = keras.Model(inputs, outputs)
    [node] = _compat.functional_nodes(model)
    assert _compat.node_call_kwargs(node) == {"training": True}, (
        "Node.arguments.kwargs changed in Keras "
        f"{keras.__version__}; " + UPDATE.format("node_call_kwargs")
    )


def test_clear_layer_losses_drops_recorded_losses():
    layer = keras.layers.ActivityRegularization(l1=1.0)
    layer(tf.ones((1, 3)))
    assert layer.losses, "ActivityRegularization recorded no loss"
    _compat.clear_layer_losses(layer)
    assert layer.losses == [], (
        "Layer._clear_losses no longer clears losses in Keras "
        f"{keras.__version__}; " + UPDATE.format("clear_layer_losses")
    )


def test_builds_from_data_until_the_metrics_are_built():
    inputs = keras.Input(shape=(3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    for name in ("_compile_metrics", "_compile_loss", "_flatten_layers"):
        assert hasattr(model, name), (
            f"Trainer.{name} is gone in Keras {keras.__version__}; "
            + UPDATE.format("builds_from_data")
        )
    assert _compat.builds_from_data(model)
    assert _compat.layers_built(model)
    assert _compat.metrics_unbuilt(model)
    spec = (
        tf.TensorSpec((None, 3), tf.float32),
        tf.TensorSpec((None, 1), tf.float32),
    )
    _compat.symbolic_build(model, spec)
    assert not _compat.builds_from_data(model)
    assert not _compat.metrics_unbuilt(model)
    assert model.optimizer.built


def test_symbolic_build_builds_metrics_from_specs():
    inputs = keras.Input(shape=(3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    assert hasattr(model, "_symbolic_build"), (
        f"Trainer._symbolic_build is gone in Keras {keras.__version__}; "
        + UPDATE.format("symbolic_build")
    )
    spec = (
        tf.TensorSpec((None, 3), tf.float32),
        tf.TensorSpec((None, 1), tf.float32),
    )
    _compat.symbolic_build(model, spec)
    assert [m.name for m in model.metrics] == ["loss", "compile_metrics"]
    assert model.metrics[1].built


def test_keras_fit_still_validates_through_the_private_evaluate_keyword():
    import inspect

    trainer = _private(
        "keras.src.backend.tensorflow.trainer",
        "TensorFlowTrainer",
        "is_fit_validation",
    )
    assert f"{_compat.FIT_VALIDATION_KWARG}=True" in inspect.getsource(
        trainer.fit
    ), (
        f"Keras {keras.__version__}'s fit no longer passes "
        f"{_compat.FIT_VALIDATION_KWARG}=True to evaluate; "
        + UPDATE.format("is_fit_validation")
    )
    assert _compat.is_fit_validation({_compat.FIT_VALIDATION_KWARG: True})
    assert not _compat.is_fit_validation({})


def test_service_server_port_reads_a_worker_s_port():
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer()
    worker = service.WorkerServer(
        service.WorkerConfig(dispatcher_address=dispatcher.target[7:])
    )
    try:
        assert hasattr(worker, "_address"), (
            "tf.data.experimental.service.WorkerServer._address is gone in "
            f"TensorFlow {tf.__version__}; "
            + UPDATE.format("service_server_port")
        )
        assert _compat.service_server_port(worker) > 0
    finally:
        worker.stop()
        dispatcher.stop()


def test_backup_files_are_the_files_backup_and_restore_writes(tmp_path):
    backup = keras.callbacks.BackupAndRestore(
        str(tmp_path), save_freq=1, delete_checkpoint=False
    )
    assert hasattr(backup, "_weights_path") and hasattr(
        backup, "_training_metadata_path"
    ), (
        "keras.callbacks.BackupAndRestore no longer names its files in "
        f"_weights_path/_training_metadata_path in Keras {keras.__version__}; "
        + UPDATE.format("backup_files")
    )
    inputs = keras.Input((1,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((2, 1)), np.ones((2, 1)), epochs=1, callbacks=[backup])
    weights, metadata = _compat.backup_files(backup)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(weights), os.path.basename(metadata)]
    )
    with open(metadata) as f:
        assert json.load(f) == {"epoch": 0, "batch": 0}  # saved at batch 0


def test_dataset_seeded_tells_a_fixed_seed_from_none():
    # tf.data keeps the op seeds `random_seed.get_seed` chose on a drawing
    # dataset: both 0 when no seed was set, which the free passes across
    # calls rely on (see `source_passes.SourceFacts.free_passes`).
    tf.random.set_seed(None)  # the suite's own global seed
    base = tf.data.Dataset.range(8)
    assert not _compat.dataset_seeded(base.shuffle(8)), UPDATE.format(
        "dataset_seeded"
    )
    assert _compat.dataset_seeded(base.shuffle(8, seed=3))
    assert _compat.dataset_seeded(tf.data.Dataset.random(seed=1))
    assert not _compat.dataset_seeded(tf.data.Dataset.random())
    tf.random.set_seed(5)
    assert _compat.dataset_seeded(base.shuffle(8))  # the global seed
    assert _compat.dataset_seeded(object())  # cannot tell: seeded


def test_keras_takes_its_adapter_of_our_distributed_dataset_as_it_is():
    # Keras tells TensorFlow's distributed datasets by class name, so a
    # `DistributedEpochPipeline` reaches it in Keras's dataset adapter.
    _private(
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
        "TFDatasetAdapter",
        "distributed_dataset_adapter",
    )

    class Epoch(tf.distribute.DistributedDataset):
        element_spec = tf.TensorSpec((None,), tf.int64)

        def __iter__(self):
            return iter([])

        def cardinality(self):
            return 3

        def reduce(self, initial_state, reduce_func):
            raise TypeError

    epoch = Epoch()
    with pytest.raises(ValueError, match="Unrecognized data type"):
        _compat.get_data_adapter(x=epoch)
    adapter = _compat.distributed_dataset_adapter(epoch)
    assert _compat.get_data_adapter(x=adapter) is adapter, UPDATE.format(
        "distributed_dataset_adapter"
    )
    assert adapter.get_tf_dataset() is epoch
    assert adapter.num_batches == 3
