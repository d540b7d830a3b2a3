"""Pins the public API of keras_stage: an API change is a visible diff.

The public modules are the package and every module named in a public
module's `__all__`; their public names are their `__all__`. Internals stay
importable from their modules (and a few from their package, for the tests
and examples that use them) but are in no `__all__`. The stage options are
defined once (`keras_stage.data.options.OPTIONS`); the entry points that
take them must agree with that table.
"""

import importlib
import inspect

import keras_stage
from keras_stage.data.options import OPTIONS

# Every public module and its `__all__`, sorted.
PUBLIC = {
    "keras_stage": [
        "Model",
        "Sequential",
        "StagePlan",
        "callbacks",
        "configure_streams",
        "data",
        "layers",
    ],
    "keras_stage.callbacks": ["PrefetchCallback"],
    "keras_stage.data": [
        "AUTO",
        "StageOptions",
        "StageTimeoutError",
        "StagedDataset",
        "service",
        "stage",
        "tfio_support",
    ],
    "keras_stage.data.service": [
        "DISTRIBUTED_EPOCH",
        "LocalService",
        "PARALLEL_EPOCHS",
        "check_dispatcher",
    ],
    "keras_stage.data.tfio_support": [
        "WORKING_PAIRING",
        "explain_tfio_error",
        "read_hdf5",
        "read_parquet",
        "require_tensorflow_io",
    ],
    "keras_stage.layers": ["StagedInput"],
}


def _public_modules():
    """`{module name: sorted __all__}` for every public module."""
    found = {}
    pending = [keras_stage]
    while pending:
        module = pending.pop()
        found[module.__name__] = sorted(module.__all__)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.ismodule(value):
                pending.append(value)
    return found


def test_public_names():
    assert _public_modules() == PUBLIC


def test_every_exported_name_resolves():
    for module_name, names in PUBLIC.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert getattr(module, name) is not None, f"{module_name}.{name}"


def test_internals_stay_importable_but_not_public():
    from keras_stage.data import Packer, live_stages, resolve_device
    from keras_stage.data.pool import StagePool
    from keras_stage.data.staging import StageIterator
    from keras_stage.data.stats import StageStats
    from keras_stage.planner.stage_plan import BoundaryTensor

    internals = [
        Packer,
        live_stages,
        resolve_device,
        StagePool,
        StageIterator,
        StageStats,
        BoundaryTensor,
    ]
    public = {name for names in PUBLIC.values() for name in names}
    for internal in internals:
        assert internal.__name__ not in public, internal.__name__


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
_SERVICE_OPTIONS = ["service", "processing_mode", "worker_timeout"]


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
    assert params["worker_timeout"].default == 10.0
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
    # No `name`: the layer's own name (a base layer argument) names the stage.
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


def test_stage_options_signature():
    params = inspect.signature(keras_stage.data.StageOptions).parameters
    assert list(params) == [
        *_STAGE_OPTIONS,
        "name",
        *_DEVICE_OPTIONS,
        *_SERVICE_OPTIONS,
    ]


# -- the one table of stage options and the entry points that take them ----

_ENTRY_POINTS = {
    # entry point: (its arguments before the options, after them)
    "stage": (["dataset", "fn"], []),
    "StageOptions": ([], []),
    "StagedInput": ([], ["adaptive", "kwargs"]),
}


def _entry_point(name):
    if name == "StagedInput":
        return keras_stage.layers.StagedInput
    return getattr(keras_stage.data, name)


def _table(entry_point):
    # StagedInput takes every option but `name` (its layer name).
    skip = {"name"} if entry_point == "StagedInput" else set()
    return [o for o in OPTIONS if o.name not in skip]


def test_entry_points_take_exactly_the_table_options():
    for entry_point, (before, after) in _ENTRY_POINTS.items():
        params = inspect.signature(_entry_point(entry_point)).parameters
        options = [o.name for o in _table(entry_point)]
        assert list(params) == [*before, *options, *after], entry_point
        for option in _table(entry_point):
            default = params[option.name].default
            # repr: `300` is not `300.0`, nor `1` `True`.
            assert repr(default) == repr(option.default), (
                f"{entry_point}({option.name}=...) defaults to {default!r}; "
                f"the table (keras_stage/data/options.py) says "
                f"{option.default!r}"
            )


def test_entry_points_document_the_options_from_the_table():
    for entry_point in _ENTRY_POINTS:
        doc = " ".join(inspect.getdoc(_entry_point(entry_point)).split())
        for option in _table(entry_point):
            entry = " ".join(option.docstring_entry("").split())
            assert doc.count(f" {option.name}: ") == 1, (entry_point, option)
            assert entry in doc, (entry_point, option.name)
        assert "{stage_options}" not in doc


def test_the_table_documents_every_default_keras_style():
    for option in OPTIONS:
        assert option.doc, option.name
        assert "Defaults to" not in option.doc, option.name
        assert option.docstring_entry("").rstrip().endswith("`."), option.name


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
    from keras_stage.data.devices import configure_streams

    assert keras_stage.configure_streams is configure_streams


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
    from keras_stage.planner.stage_plan import BoundaryTensor

    # What `plan.boundary` holds: read by users, not made by them.
    tensor = BoundaryTensor("t", "float32", (None, 2))
    for name in ("name", "dtype", "shape", "bytes_per_example"):
        assert hasattr(tensor, name), name
