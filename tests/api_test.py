"""Pins the public names of keras_stage: an API change is a visible diff."""

import inspect

import keras_stage


def _public(module):
    return sorted(module.__all__)


def test_top_level_names():
    assert _public(keras_stage) == [
        "BoundaryTensor",
        "Model",
        "Sequential",
        "StagePlan",
        "callbacks",
        "configure_streams",
        "data",
        "layers",
    ]


def test_submodule_names():
    assert _public(keras_stage.layers) == ["StagedInput"]
    assert _public(keras_stage.callbacks) == ["PrefetchCallback"]
    assert _public(keras_stage.planner) == [
        "BoundaryTensor",
        "StagePlan",
        "StageSplit",
        "plan_model",
    ]
    assert _public(keras_stage.data) == [
        "AUTO",
        "Packer",
        "StageIterator",
        "StageOptions",
        "StagePool",
        "StageStats",
        "StageTimeoutError",
        "StagedDataset",
        "configure_streams",
        "live_stages",
        "resolve_device",
        "service",
        "stage",
        "tfio_support",
    ]
    assert _public(keras_stage.data.service) == [
        "DISTRIBUTED_EPOCH",
        "LocalService",
        "PARALLEL_EPOCHS",
        "check_dispatcher",
    ]
    assert _public(keras_stage.data.tfio_support) == [
        "WORKING_PAIRING",
        "explain_tfio_error",
        "read_hdf5",
        "read_parquet",
        "require_tensorflow_io",
    ]


def test_every_exported_name_resolves():
    for module in (
        keras_stage,
        keras_stage.layers,
        keras_stage.callbacks,
        keras_stage.data,
        keras_stage.data.service,
        keras_stage.data.tfio_support,
        keras_stage.planner,
    ):
        for name in module.__all__:
            assert getattr(module, name) is not None, name


_STAGE_OPTIONS = [
    "capacity",
    "num_threads",
    "closed_exception_types",
    "ignored_exception_types",
    "timeout",
    "thread_pool_size",
    "deterministic",
]
_DEVICE_OPTIONS = ["device", "stream", "pack_transfer"]
_SERVICE_OPTIONS = ["service", "processing_mode"]


def test_stage_signature():
    params = inspect.signature(keras_stage.data.stage).parameters
    assert list(params) == [
        "dataset",
        "fn",
        *_STAGE_OPTIONS,
        "name",
        *_DEVICE_OPTIONS,
        *_SERVICE_OPTIONS,
    ]
    assert params["service"].default is None
    assert params["processing_mode"].default == "distributed_epoch"
    assert params["device"].default == "auto"
    assert params["stream"].default is None
    assert params["pack_transfer"].default == "auto"
    assert params["capacity"].default == "auto"
    assert params["num_threads"].default == "auto"
    assert params["timeout"].default == 300.0
    assert params["ignored_exception_types"].default == ()
    assert params["deterministic"].default is True
    assert params["thread_pool_size"].default is None


def test_staged_input_signature():
    params = inspect.signature(keras_stage.layers.StagedInput).parameters
    assert list(params) == [
        *_STAGE_OPTIONS,
        *_DEVICE_OPTIONS,
        *_SERVICE_OPTIONS,
        "adaptive",
        "kwargs",
    ]
    assert params["adaptive"].default is True
    assert params["service"].default is None
    assert params["processing_mode"].default == "distributed_epoch"


def test_callback_signature_and_log_keys():
    params = inspect.signature(keras_stage.callbacks.PrefetchCallback)
    assert list(params.parameters) == ["verbose", "log_dir"]
    doc = keras_stage.callbacks.PrefetchCallback.__doc__
    for key in ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped"):
        assert key in doc


def test_compile_takes_smart_stage():
    for cls in (keras_stage.Model, keras_stage.Sequential):
        params = inspect.signature(cls.compile).parameters
        assert params["smart_stage"].default is False


def test_configure_streams_signature():
    params = inspect.signature(keras_stage.configure_streams).parameters
    assert list(params) == ["num_streams", "memory_limit_mb"]
    assert keras_stage.configure_streams is keras_stage.data.configure_streams


def test_models_are_keras_models():
    import keras

    assert issubclass(keras_stage.Model, keras.Model)
    assert issubclass(keras_stage.Sequential, keras.Sequential)


def test_stage_plan_api():
    for cls in (keras_stage.Model, keras_stage.Sequential):
        assert list(inspect.signature(cls.get_stage_plan).parameters) == [
            "self"
        ]
        assert list(inspect.signature(cls.stage_summary).parameters) == [
            "self",
            "print_fn",
            "line_length",
        ]
    plan = keras_stage.StagePlan("m", [], [], {}, [])
    for name in ("staged_layers", "trunk_layers", "reasons", "boundary"):
        assert hasattr(plan, name), name
    tensor = keras_stage.BoundaryTensor("t", "float32", (None, 2))
    for name in ("name", "dtype", "shape", "bytes_per_example"):
        assert hasattr(tensor, name), name
