"""`StagedInput`: an identity that carries the stage's options.

Outside a staged run the layer returns its inputs unchanged, for every
structure and tensor kind; symbolically it returns new KerasTensors of the
same kind. Its config holds every constructor argument and survives
`from_config` and a `.keras` save/load inside each keras_stage model style.
Trained by a model keras_stage does not run, it warns once that it stages
nothing; keras_stage's models, inference and export are not warned.
"""

import inspect
import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.data.options import OPTIONS
from keras_stage.layers import StagedInput
from tests.helpers import sweep


class CorruptRecordError(Exception):
    """A user-defined error type, as a custom reader would raise."""


class ReaderErrors:
    class Unavailable(Exception):
        """A user error type nested in a class (a dotted __qualname__)."""


# Every option away from its default, with all three kinds of exception
# type: TensorFlow's, a builtin and user-defined ones.
NON_DEFAULT_OPTIONS = dict(
    capacity=3,
    num_threads=2,
    closed_exception_types=(tf.errors.OutOfRangeError, StopIteration),
    ignored_exception_types=(
        tf.errors.InvalidArgumentError,
        ValueError,
        CorruptRecordError,
    ),
    timeout=12.5,
    thread_pool_size=4,
    deterministic=False,
    device="cpu",
    # Stream 0 is the step's own device: no warning on a machine without
    # a GPU (stream 1 warns; tests/models/device_test.py checks it).
    stream=0,
    pack_transfer=False,
)
# Every constructor argument off its default; a fit would need a tf.data
# service there (tests/models/service_fit_test.py runs one), so the models
# below are fit with NON_DEFAULT_OPTIONS.
EVERY_OPTION = dict(
    NON_DEFAULT_OPTIONS,
    service="grpc://10.0.0.9:5050",
    processing_mode="parallel_epochs",
    worker_timeout=4.5,
    adaptive=False,
)


def _dense():
    return tf.constant([[1.0, 2.0], [3.0, 4.0]])


def _ragged():
    return tf.ragged.constant([[1.0, 2.0], [3.0]])


def _sparse():
    return tf.sparse.SparseTensor(
        indices=[[0, 1], [1, 2]], values=[5.0, 6.0], dense_shape=[2, 3]
    )


def _assert_same_value(actual, expected):
    if isinstance(expected, tf.RaggedTensor):
        assert isinstance(actual, tf.RaggedTensor)
        assert actual.to_list() == expected.to_list()
    elif isinstance(expected, tf.SparseTensor):
        assert isinstance(actual, tf.SparseTensor)
        np.testing.assert_array_equal(actual.indices, expected.indices)
        np.testing.assert_array_equal(actual.values, expected.values)
        np.testing.assert_array_equal(actual.dense_shape, expected.dense_shape)
    else:
        np.testing.assert_array_equal(actual, expected)
    assert actual.dtype == expected.dtype


EAGER_INPUTS = {
    "tensor": _dense,
    "ragged": _ragged,
    "sparse": _sparse,
    "list": lambda: [_dense(), _ragged()],
    "dict": lambda: {"dense": _dense(), "sparse": _sparse()},
}


@pytest.mark.parametrize("kind", sorted(EAGER_INPUTS))
def test_eager_call_is_an_identity(kind):
    inputs = EAGER_INPUTS[kind]()
    outputs = StagedInput()(inputs)
    keras.tree.assert_same_structure(outputs, inputs)
    for actual, expected in zip(
        keras.tree.flatten(outputs), keras.tree.flatten(inputs), strict=True
    ):
        _assert_same_value(actual, expected)


def _symbolic_inputs(kind):
    return {
        "tensor": lambda: keras.Input(shape=(2,), dtype="float32"),
        "ragged": lambda: keras.Input(shape=(None,), ragged=True),
        "sparse": lambda: keras.Input(shape=(3,), sparse=True),
        "list": lambda: [
            keras.Input(shape=(2,)),
            keras.Input(shape=(None,), ragged=True),
        ],
        "dict": lambda: {
            "dense": keras.Input(shape=(2,), name="dense"),
            "sparse": keras.Input(shape=(3,), sparse=True, name="sparse"),
        },
    }[kind]()


@pytest.mark.parametrize("kind", sorted(EAGER_INPUTS))
@pytest.mark.parametrize(
    "model_class", [keras_stage.Model, keras.Model], ids=["staged", "keras"]
)
def test_call_inside_a_model_is_an_identity(kind, model_class):
    inputs = _symbolic_inputs(kind)
    model = model_class(inputs, StagedInput()(inputs))
    data = EAGER_INPUTS[kind]()
    outputs = model(data)
    for actual, expected in zip(
        keras.tree.flatten(outputs), keras.tree.flatten(data), strict=True
    ):
        _assert_same_value(actual, expected)


@pytest.mark.parametrize("kind", sorted(EAGER_INPUTS))
def test_symbolic_outputs_are_new_tensors_of_the_same_kind(kind):
    inputs = _symbolic_inputs(kind)
    outputs = StagedInput()(inputs)
    keras.tree.assert_same_structure(outputs, inputs)
    for out, inp in zip(
        keras.tree.flatten(outputs), keras.tree.flatten(inputs), strict=True
    ):
        assert isinstance(out, keras.KerasTensor)
        # New objects: returning the inputs would rewrite their history.
        assert out is not inp
        assert out.shape == inp.shape
        assert out.dtype == inp.dtype
        assert out.sparse == inp.sparse
        assert out.ragged == inp.ragged


def _constructor_arguments():
    parameters = inspect.signature(StagedInput.__init__).parameters
    return {
        name
        for name, p in parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def test_get_config_has_every_constructor_argument():
    config = StagedInput(name="reader", **EVERY_OPTION).get_config()
    assert _constructor_arguments() <= set(config)
    assert set(EVERY_OPTION) == _constructor_arguments()
    assert config["name"] == "reader"
    assert config["capacity"] == 3
    assert config["num_threads"] == 2
    assert config["timeout"] == 12.5
    assert config["thread_pool_size"] == 4
    assert config["deterministic"] is False
    assert config["device"] == "cpu"
    assert config["stream"] == 0
    assert config["pack_transfer"] is False
    assert config["service"] == "grpc://10.0.0.9:5050"
    assert config["processing_mode"] == "parallel_epochs"
    assert config["worker_timeout"] == 4.5
    assert config["adaptive"] is False


def test_get_config_of_defaults_matches_the_signature_defaults():
    config = StagedInput().get_config()
    parameters = inspect.signature(StagedInput.__init__).parameters
    for name in _constructor_arguments():
        default = parameters[name].default
        if name.endswith("exception_types"):
            rebuilt = StagedInput.from_config(config).stage_options
            assert getattr(rebuilt, name) == tuple(default), name
        else:
            assert config[name] == default, name


def test_get_config_covers_every_stage_option():
    # Drawn from the one table: a new option is saved without a change here.
    config = StagedInput(name="reader").get_config()
    options = StagedInput(name="reader").stage_options.get_config()
    for option in OPTIONS:
        assert option.name in config, option.name
        if option.name == "name":
            # The layer's name names the stage (as an identifier).
            assert options["name"] == "reader"
        elif not option.exception_classes:
            assert config[option.name] == options[option.name], option.name


def test_unknown_exception_class_name_in_a_config_rejected():
    # What loading a config saved where the class existed does (Keras's
    # `from_config` re-raises it as a TypeError quoting this message).
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid value for argument `ignored_exception_types`: cannot "
            "find the exception class 'no_such_package.CorruptError'. "
        )
        + ".*"
        + re.escape(
            "Received: ignored_exception_types containing "
            "'no_such_package.CorruptError'"
        ),
    ):
        StagedInput(ignored_exception_types=["no_such_package.CorruptError"])


def test_exception_types_are_stored_by_name():
    config = StagedInput(**NON_DEFAULT_OPTIONS).get_config()
    assert config["closed_exception_types"] == [
        "tf.errors.OutOfRangeError",
        "StopIteration",
    ]
    assert config["ignored_exception_types"] == [
        "tf.errors.InvalidArgumentError",
        "ValueError",
        f"{__name__}.CorruptRecordError",
    ]


@pytest.mark.parametrize(
    "options",
    [{}, EVERY_OPTION, {"capacity": "auto", "timeout": None}],
    ids=["defaults", "non_default", "auto_no_timeout"],
)
def test_from_config_round_trip_keeps_every_option(options):
    layer = StagedInput(name="reader", **options)
    rebuilt = StagedInput.from_config(layer.get_config())
    assert rebuilt.get_config() == layer.get_config()
    assert rebuilt.name == "reader"
    # The live options (classes, not names) are the ones passed.
    assert rebuilt.stage_options.get_config() == (
        layer.stage_options.get_config()
    )
    for name, value in options.items():
        expected = tuple(value) if isinstance(value, tuple) else value
        # `adaptive` is the Keras integration's, not the engine's.
        holder = rebuilt if name == "adaptive" else rebuilt.stage_options
        assert getattr(holder, name) == expected, name


def test_from_config_round_trip_keeps_a_nested_exception_class():
    layer = StagedInput(ignored_exception_types=(ReaderErrors.Unavailable,))
    rebuilt = StagedInput.from_config(layer.get_config())
    assert rebuilt.stage_options.ignored_exception_types == (
        ReaderErrors.Unavailable,
    )


def _staged_functional():
    inputs = keras.Input(shape=(3,))
    x = StagedInput(name="reader", **NON_DEFAULT_OPTIONS)(inputs)
    return keras_stage.Model(inputs, keras.layers.Dense(2)(x))


def _staged_sequential():
    return keras_stage.Sequential(
        [
            keras.Input(shape=(3,)),
            StagedInput(name="reader", **NON_DEFAULT_OPTIONS),
            keras.layers.Dense(2),
        ]
    )


@keras.saving.register_keras_serializable(package="keras_stage_tests")
class SubclassedStagedModel(keras_stage.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stage = StagedInput(name="reader", **NON_DEFAULT_OPTIONS)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(self.stage(x))


MODEL_STYLES = {
    "functional": (_staged_functional, keras_stage.Model),
    "sequential": (_staged_sequential, keras_stage.Sequential),
    "subclassed": (SubclassedStagedModel, SubclassedStagedModel),
}


@pytest.mark.timeout(120)
# NON_DEFAULT_OPTIONS ignores errors, so Keras may not know the batch count
# of a re-fit in advance; that warning is not what this test is about.
@pytest.mark.filterwarnings("ignore:Your input ran out of data:UserWarning")
# smart_stage cannot look inside the subclassed style and says so (tested in
# tests/models/smart_stage_test.py); here only the round trip matters.
@pytest.mark.filterwarnings("ignore:Model '.*' is a subclassed:UserWarning")
# The other styles' round trips in `make test-long`; their models' `fit`
# is in `make test` (staging_mixin_test, sequential_test).
@pytest.mark.parametrize(
    "style", sweep(sorted(MODEL_STYLES), kept=("functional",))
)
def test_keras_file_round_trip_keeps_the_stage_and_smart_stage(style, tmp_path):
    build, expected_class = MODEL_STYLES[style]
    x = np.linspace(-1.0, 1.0, 24, dtype="float32").reshape(8, 3)
    y = np.ones((8, 2), "float32")
    model = build()
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    before = model.predict(x, verbose=0)
    layer_config = model.get_layer("reader").get_config()
    path = tmp_path / f"{style}.keras"

    model.save(path)
    loaded = keras.saving.load_model(path)

    assert isinstance(loaded, expected_class)
    assert loaded.smart_stage is True
    assert loaded.get_layer("reader").get_config() == layer_config
    rebuilt_options = loaded.get_layer("reader").stage_options
    assert rebuilt_options.ignored_exception_types == (
        tf.errors.InvalidArgumentError,
        ValueError,
        CorruptRecordError,
    )
    np.testing.assert_allclose(loaded.predict(x, verbose=0), before)
    # Still a staged, compiled model: it trains again through its stage.
    history = loaded.fit(x, y, batch_size=4, epochs=2, verbose=0).history
    assert len(history["loss"]) == 2
    assert history["stage_skipped"] == [0, 0]


def test_keras_file_round_trip_without_smart_stage(tmp_path):
    model = _staged_functional()
    model.compile(optimizer="sgd", loss="mse")
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.smart_stage is False
    assert loaded.get_compile_config()["smart_stage"] is False


# -- trained where nothing stages it -------------------------------------------

NOT_STAGED = "stages nothing"


def _not_staged_warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "keras_stage"
        and r.levelno == logging.WARNING
        and NOT_STAGED in r.getMessage()
    ]


def _xy(batches):
    x = np.linspace(-1.0, 1.0, batches * 8, dtype="float32").reshape(-1, 2)
    return x, np.ones((batches * 4, 1), "float32")


def _functional(model_class, layer):
    inputs = keras.Input(shape=(2,))
    x = keras.layers.Rescaling(0.5)(layer(inputs))
    return model_class(inputs, keras.layers.Dense(1)(x))


def _sequential(model_class, layer):
    return model_class(
        [
            keras.Input(shape=(2,)),
            layer,
            keras.layers.Rescaling(0.5),
            keras.layers.Dense(1),
        ]
    )


BUILDERS = {"functional": _functional, "sequential": _sequential}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "style, model_class",
    [("functional", keras.Model), ("sequential", keras.Sequential)],
)
def test_training_in_a_plain_keras_model_warns_once_naming_the_fix(
    style, model_class, caplog
):
    model = BUILDERS[style](model_class, StagedInput(name="reader"))
    model.compile(optimizer="sgd", loss="mse")
    x, y = _xy(batches=4)
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        model.evaluate(x, y, batch_size=4, verbose=0)
    [message] = _not_staged_warnings(caplog)
    assert message.startswith("StagedInput 'reader' stages nothing: it is")
    assert "plain `keras.Model` or `keras.Sequential`" in message
    assert "`keras_stage.Model(inputs, outputs)`" in message
    assert "`keras_stage.Sequential([...])`" in message
    assert "`compile(..., smart_stage=True)`" in message


@pytest.mark.timeout(240)
# Each style and each smart_stage in `make test`; the other two pairs in
# `make test-long`.
@pytest.mark.parametrize(
    "style, model_class, smart_stage",
    [
        ("functional", keras_stage.Model, False),
        ("sequential", keras_stage.Sequential, True),
        pytest.param(
            "functional", keras_stage.Model, True, marks=pytest.mark.long
        ),
        pytest.param(
            "sequential", keras_stage.Sequential, False, marks=pytest.mark.long
        ),
    ],
)
def test_keras_stage_models_are_not_warned_staged_or_unstaged(
    style, model_class, smart_stage, caplog
):
    # A call of one batch cannot repay a stage: it runs the whole model,
    # StagedInput included, in Keras's own training step, unstaged.
    short = BUILDERS[style](model_class, StagedInput(name="short"))
    staged = BUILDERS[style](model_class, StagedInput(adaptive=False))
    x, y = _xy(batches=4)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        for model in (short, staged):
            model.compile(optimizer="sgd", loss="mse", smart_stage=smart_stage)
        short.fit(x[:4], y[:4], batch_size=4, verbose=0)
        short.evaluate(x[:4], y[:4], batch_size=4, verbose=0)
        short.predict(x[:4], batch_size=4, verbose=0)
        assert "unstaged" in caplog.text
        history = staged.fit(
            x, y, batch_size=4, epochs=2, validation_data=(x, y), verbose=0
        ).history
        staged.evaluate(x, y, batch_size=4, verbose=0)
        staged.predict(x, batch_size=4, verbose=0)
    assert len(history["stage_buffer_fill"]) == 2  # the fit was staged
    assert _not_staged_warnings(caplog) == []


@pytest.mark.timeout(120)
def test_inference_and_export_are_not_warned(caplog, tmp_path):
    x, _ = _xy(batches=2)
    plain = _functional(keras.Model, StagedInput(name="served"))
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        StagedInput(name="alone")(x)
        StagedInput(name="alone_inference")(x, training=False)
        plain(x)
        plain.predict(x, verbose=0)
        plain.export(tmp_path / "plain", verbose=False)
        staged = _functional(keras_stage.Model, StagedInput(name="exported"))
        staged(x)
        staged.export(tmp_path / "staged", verbose=False)
    assert _not_staged_warnings(caplog) == []
