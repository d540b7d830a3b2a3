"""Errors of staged models: skipped, surfaced, timed out, or rejected early.

A failure inside the stage reaches `fit` with its original type and the
stage's name, or is skipped and counted when its type is ignored; a failure
of the model itself is never skipped nor blamed on the stage; a blocked
source ends in a `StageTimeoutError`; and every misuse of the Keras-facing
API is rejected with a message naming the argument.
"""

import logging
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.callbacks import PrefetchCallback
from keras_stage.data import StageTimeoutError
from keras_stage.layers import StagedInput
from tests.helpers import stage_threads

NUM_BATCHES = 10
BAD_BATCHES = (2, 7)
GOOD_BATCHES = NUM_BATCHES - len(BAD_BATCHES)
IGNORE_INVALID = (tf.errors.InvalidArgumentError,)
# Skipped batches end an epoch before Keras's batch count: Keras may say so.
RAN_OUT = "ignore:Your input ran out of data:UserWarning"


def _rows(bad_batches):
    # Two rows of two numeric strings per batch; a bad batch has "oops".
    rows = []
    for batch in range(NUM_BATCHES):
        bad = batch in bad_batches
        rows += [["oops" if bad else "1", str(batch)], ["2", "3"]]
    return rows


def _csv_dataset(bad_batches=BAD_BATCHES):
    """Batches of parsed numbers; the parse fails on the bad batches."""
    rows = tf.constant(_rows(bad_batches))
    labels = tf.ones((len(_rows(bad_batches)), 1))
    dataset = tf.data.Dataset.from_tensor_slices((rows, labels)).batch(2)
    return dataset.map(lambda s, y: (tf.strings.to_number(s), y))


def _good_batches_dataset():
    batches = list(_csv_dataset(bad_batches=()))
    good = [b for i, b in enumerate(batches) if i not in BAD_BATCHES]
    features = tf.concat([x for x, _ in good], axis=0)
    labels = tf.concat([y for _, y in good], axis=0)
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(2)


def _model(trunk=None, name="parse", **stage_kwargs):
    stage_kwargs.setdefault("capacity", 2)
    stage_kwargs.setdefault("num_threads", 2)
    inputs = keras.Input(shape=(2,))
    x = StagedInput(name=name, **stage_kwargs)(inputs)
    if trunk is not None:
        x = trunk(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


class _StepCounter(keras.callbacks.Callback):
    """Counts the training and evaluation steps Keras runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1

    def on_test_batch_end(self, batch, logs=None):
        self.count += 1


class _BatchCounter(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.per_epoch = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


# -- ignored_exception_types ------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(RAN_OUT)
def test_ignored_errors_train_on_exactly_the_good_batches():
    staged = _model(ignored_exception_types=IGNORE_INVALID)
    plain_inputs = keras.Input(shape=(2,))
    plain = keras.Model(plain_inputs, keras.layers.Dense(1)(plain_inputs))
    plain.set_weights(staged.get_weights())
    plain.compile(optimizer="sgd", loss="mse")
    counter = _BatchCounter()

    history = staged.fit(
        _csv_dataset(), epochs=2, verbose=0, shuffle=False, callbacks=[counter]
    ).history
    plain.fit(_good_batches_dataset(), epochs=2, verbose=0, shuffle=False)

    assert counter.per_epoch == [GOOD_BATCHES, GOOD_BATCHES]
    assert history["stage_skipped"] == [len(BAD_BATCHES)] * 2
    assert all(isinstance(n, int) for n in history["stage_skipped"])
    # Same weights as a model trained on the good batches alone: the bad
    # ones were skipped, the good ones all used, in order.
    for staged_w, plain_w in zip(
        staged.get_weights(), plain.get_weights(), strict=True
    ):
        np.testing.assert_allclose(staged_w, plain_w, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(RAN_OUT)
def test_skipped_batches_are_reported_with_a_warning(caplog):
    model = _model(ignored_exception_types=IGNORE_INVALID)
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        model.fit(_csv_dataset(), epochs=1, verbose=0, shuffle=False)

    warnings = [
        r
        for r in caplog.records
        if r.name == "keras_stage" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "Stage 'parse_train' skipped 2 element(s)" in message
    assert "InvalidArgumentError" in message
    assert "oops" in message  # the original error text


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(RAN_OUT)
def test_validation_skips_are_counted_per_epoch(caplog):
    # One bad validation batch per epoch: each epoch reports one skip, not
    # the running total.
    model = _model(ignored_exception_types=IGNORE_INVALID)
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        model.fit(
            _csv_dataset(bad_batches=()),
            validation_data=_csv_dataset(bad_batches=(4,)),
            epochs=3,
            verbose=0,
            shuffle=False,
        )

    val_messages = [
        r.getMessage()
        for r in caplog.records
        if r.name == "keras_stage" and "'parse_val'" in r.getMessage()
    ]
    assert len(val_messages) == 3
    for message in val_messages:
        assert "skipped 1 element(s)" in message, message


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings(RAN_OUT)
def test_evaluate_inside_fit_keeps_the_validation_stage_policies():
    # A callback evaluating other data between epochs (a common pattern)
    # must not switch off the skipping of the fit's validation stage.
    model = _model(ignored_exception_types=IGNORE_INVALID)

    class EvaluateOtherData(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.evaluate(_csv_dataset(bad_batches=()), verbose=0)

    history = model.fit(
        _csv_dataset(bad_batches=()),
        validation_data=_csv_dataset(bad_batches=(4,)),
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=[EvaluateOtherData()],
    ).history
    assert len(history["val_loss"]) == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_ignored_types_on_clean_arrays_add_no_keras_warning(method):
    # With nothing to skip, a staged run is as quiet as a plain Keras run
    # on the same arrays, and reads every batch. Recorded rather than left
    # to warnings-as-errors, so the test states what it checks.
    plain_inputs = keras.Input(shape=(2,))
    plain = keras.Model(plain_inputs, keras.layers.Dense(1)(plain_inputs))
    plain.compile(optimizer="sgd", loss="mse")
    model = _model(ignored_exception_types=IGNORE_INVALID)
    x = np.ones((8, 2), "float32")
    y = np.ones((8, 1), "float32")
    steps = _StepCounter()
    messages = {}
    for name, run in (("plain", plain), ("staged", model)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                result = getattr(run, method)(
                    x, y, batch_size=2, verbose=0, callbacks=[steps]
                )
        messages[name] = {str(w.message) for w in caught}
        losses = result.history["loss"] if method == "fit" else [result]
        assert len(losses) == 1 and np.isfinite(losses[0]), (name, result)
    assert messages["staged"] <= messages["plain"], messages
    # 4 batches per call, 2 calls of each model.
    assert steps.count == 4 * 2 * 2


# -- errors that reach the user ---------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "method, stage",
    [
        ("fit", "parse_train"),
        ("evaluate", "parse_test"),
        ("predict", "parse_predict"),
    ],
)
def test_stage_error_keeps_its_type_and_names_the_stage(method, stage):
    model = _model()
    before = stage_threads()
    kwargs = {"shuffle": False} if method == "fit" else {}
    data = _csv_dataset()
    if method == "predict":
        data = data.map(lambda x, y: x)

    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        getattr(model, method)(data, verbose=0, **kwargs)

    message = str(info.value)
    assert "could not correctly convert string: oops" in message
    assert f"raised inside stage '{stage}'" in message
    assert stage_threads() == before


@pytest.mark.timeout(30)
def test_stage_error_in_validation_names_the_validation_stage():
    model = _model()
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="raised inside stage 'parse_val'"
    ):
        model.fit(
            _csv_dataset(bad_batches=()),
            validation_data=_csv_dataset(),
            verbose=0,
            shuffle=False,
        )


def _fails_on_large_values(x):
    check = tf.debugging.assert_less(
        tf.reduce_max(x), 100.0, message="model saw a value too large"
    )
    with tf.control_dependencies([check]):
        return tf.identity(x)


@pytest.mark.timeout(30)
def test_model_error_is_neither_skipped_nor_blamed_on_the_stage():
    model = _model(
        trunk=keras.layers.Lambda(_fails_on_large_values),
        ignored_exception_types=IGNORE_INVALID,
    )
    x = np.ones((12, 2), "float32")
    x[7] = 1000.0
    y = np.ones((12, 1), "float32")
    before = stage_threads()

    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)

    message = str(info.value)
    assert "model saw a value too large" in message
    assert "raised inside stage" not in message
    assert "[keras_stage]" not in message
    assert stage_threads() == before


# -- timeout ---------------------------------------------------------------


def _hanging_dataset(release, hang_at=2, batches=6):
    def generate():
        for i in range(batches):
            if i == hang_at:
                # A source that stops answering (time.sleep(60)), but one
                # the test can let go so no thread outlives the session.
                release.wait(60)
            yield np.ones((2, 2), "float32"), np.ones((2, 1), "float32")

    spec = (
        tf.TensorSpec((None, 2), tf.float32),
        tf.TensorSpec((None, 1), tf.float32),
    )
    return tf.data.Dataset.from_generator(generate, output_signature=spec)


def _clean_dataset():
    return tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 2), "float32"), np.ones((8, 1), "float32"))
    ).batch(2)


@pytest.mark.timeout(60)
def test_blocked_source_raises_stage_timeout_error_and_next_fit_works(
    release,
):
    model = _model(name="hang", timeout=1.0, capacity=1, num_threads=1)

    with pytest.raises(
        StageTimeoutError, match="Stage 'hang_train' timed out"
    ) as info:
        model.fit(_hanging_dataset(release), verbose=0, shuffle=False)
    # Code that handles TensorFlow deadlines handles it too.
    assert isinstance(info.value, tf.errors.DeadlineExceededError)

    # The process is still usable: a new model trains on good data.
    history = (
        _model(name="fresh")
        .fit(_clean_dataset(), epochs=2, verbose=0, shuffle=False)
        .history
    )
    assert len(history["loss"]) == 2
    assert np.all(np.isfinite(history["loss"]))


# Fails by timeout rather than hanging the suite if the model's compiled step
# is still held by the call the timeout abandoned (TensorFlow runs calls of
# one tf.function one at a time).
@pytest.mark.timeout(20)
def test_same_model_fits_again_after_a_stage_timeout(release):
    model = _model(name="hang", timeout=1.0, capacity=1, num_threads=1)
    with pytest.raises(StageTimeoutError):
        model.fit(_hanging_dataset(release), verbose=0, shuffle=False)

    history = model.fit(
        _clean_dataset(), epochs=2, verbose=0, shuffle=False
    ).history
    assert len(history["loss"]) == 2
    assert np.all(np.isfinite(history["loss"]))


class _OwnTrainStep(keras_stage.Model):
    """A subclass with its own train step, which records no fetch."""

    def __init__(self, **stage_kwargs):
        super().__init__(name="own_train_step")
        self.stage = StagedInput(**stage_kwargs)
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.stage(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.timeout(60)
def test_a_subclass_step_that_records_nothing_still_times_out(release):
    # keras_stage's step counts each fetch; a subclass's own step does not,
    # so the stage's count of unconsumed batches only grows and must never
    # let a call skip the timeout's helper thread.
    model = _OwnTrainStep(
        name="own_step", timeout=1.0, capacity=1, num_threads=1
    )
    model.compile(optimizer="sgd", loss="mse")
    _assert_fit_times_out(
        model, release, "own_step_train", hang_at=5, batches=8
    )


def _assert_fit_times_out(model, release, match, hang_at, batches):
    """A fit over a source that hangs at `hang_at` times out, in time."""
    started = time.monotonic()
    with pytest.raises(StageTimeoutError, match=match):
        model.fit(
            _hanging_dataset(release, hang_at=hang_at, batches=batches),
            verbose=0,
            shuffle=False,
        )
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
def test_thread_left_by_a_timeout_ends_when_the_source_unblocks(release):
    model = _model(name="hang", timeout=1.0, capacity=1, num_threads=1)
    before = stage_threads()
    with pytest.raises(StageTimeoutError):
        model.fit(_hanging_dataset(release), verbose=0, shuffle=False)

    release.set()
    deadline = time.monotonic() + 15
    while stage_threads() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {t.name for t in stage_threads() - before} == set()


@pytest.mark.timeout(60)
def test_timeout_fires_once_the_buffered_batches_are_used(release):
    # Steps that find their batch buffered skip the timeout's hand-off; the
    # first step that may wait must still be watched.
    model = _model(name="hang", timeout=1.0, capacity=4, num_threads=1)
    _assert_fit_times_out(
        model, release, "Stage 'hang_train'", hang_at=8, batches=12
    )


# -- argument checks -------------------------------------------------------


def _tiny_data():
    return np.ones((4, 2), "float32"), np.ones((4, 1), "float32")


def _call(model, method):
    x, y = _tiny_data()
    if method == "predict":
        return model.predict(x, verbose=0)
    return getattr(model, method)(x, y, verbose=0)


METHODS = ["fit", "evaluate", "predict"]


@pytest.mark.parametrize("method", METHODS)
def test_two_staged_inputs_are_rejected(method):
    inputs = keras.Input(shape=(2,))
    x = StagedInput(name="first")(inputs)
    x = StagedInput(name="second")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        ValueError,
        match=r"has 2 StagedInput layers \(\['first', 'second'\]\)",
    ):
        _call(model, method)


def test_two_staged_inputs_in_sequential_are_rejected():
    model = keras_stage.Sequential(
        [keras.Input(shape=(2,)), StagedInput(), StagedInput()]
    )
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="has 2 StagedInput layers"):
        _call(model, "fit")


def test_a_sequential_grown_after_a_call_is_checked_again():
    # What a call found is kept until the model's layers change.
    model = keras_stage.Sequential(
        [
            keras.Input(shape=(2,)),
            StagedInput(name="first"),
            keras.layers.Dense(1),
        ],
        name="seq",
    )
    model.compile(optimizer="sgd", loss="mse")
    _call(model, "fit")
    model.add(StagedInput(name="second"))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        ValueError, match=r"has 2 StagedInput layers \(\['first', 'second'\]\)"
    ):
        _call(model, "fit")


@pytest.mark.parametrize("method", METHODS)
def test_staged_input_not_first_in_sequential_is_rejected(method):
    model = keras_stage.Sequential(
        [
            keras.Input(shape=(2,)),
            keras.layers.Dense(2),
            StagedInput(name="late"),
            keras.layers.Dense(1),
        ],
        name="seq",
    )
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        ValueError,
        match=(
            r"StagedInput 'late' must be the first layer of Sequential "
            r"model 'seq'; found it at position 1"
        ),
    ):
        _call(model, method)


@pytest.mark.parametrize("method", METHODS)
def test_staged_input_off_the_model_inputs_is_rejected(method):
    inputs = keras.Input(shape=(2,))
    x = keras.layers.Dense(2)(inputs)
    x = StagedInput(name="inner")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        ValueError,
        match=(
            r"StagedInput 'inner' must be applied to the model's "
            r"keras.Input tensors"
        ),
    ):
        _call(model, method)


@pytest.mark.parametrize("value", ["yes", "Longest", 1, None])
def test_smart_stage_must_be_a_bool_or_longest(value):
    model = _model()
    with pytest.raises(
        ValueError,
        match=(
            r"Invalid value for argument `smart_stage`. Expected True, "
            rf"False or \"longest\". Received: smart_stage={value!r}"
        ),
    ):
        model.compile(optimizer="sgd", loss="mse", smart_stage=value)


@pytest.mark.parametrize("method", METHODS)
def test_callback_list_is_rejected(method):
    model = _model()
    x, y = _tiny_data()
    callbacks = keras.callbacks.CallbackList([], model=model)
    args = (x,) if method == "predict" else (x, y)
    with pytest.raises(
        TypeError, match="needs `callbacks` as a list, not a CallbackList"
    ):
        getattr(model, method)(*args, verbose=0, callbacks=callbacks)


@pytest.mark.parametrize("method", METHODS)
def test_two_prefetch_callbacks_are_rejected(method):
    model = _model()
    x, y = _tiny_data()
    callbacks = [PrefetchCallback(), PrefetchCallback()]
    args = (x,) if method == "predict" else (x, y)
    with pytest.raises(
        ValueError, match="Pass at most one PrefetchCallback; received 2"
    ):
        getattr(model, method)(*args, verbose=0, callbacks=callbacks)


@pytest.mark.parametrize("verbose", [3, -1, "yes", None])
def test_prefetch_callback_verbose_must_be_0_or_1(verbose):
    with pytest.raises(
        ValueError,
        match=(
            r"Invalid value for argument `verbose`. Expected 0 or 1. "
            rf"Received: verbose={verbose!r}"
        ),
    ):
        PrefetchCallback(verbose=verbose)


@pytest.mark.parametrize(
    "y, sample_weight",
    [(np.ones((4, 1)), None), (None, np.ones((4,)))],
    ids=["y", "sample_weight"],
)
def test_staged_dataset_with_separate_labels_is_rejected(y, sample_weight):
    model = _model()
    staged = keras_stage.data.stage(
        tf.data.Dataset.from_tensor_slices(np.ones((4, 2), "float32")).batch(2)
    )
    with pytest.raises(
        ValueError,
        match=(
            r"When `x` is a staged dataset, pass labels and sample weights "
            r"inside it, not as `y`/`sample_weight`"
        ),
    ):
        model.fit(staged, y=y, sample_weight=sample_weight, verbose=0)
    staged.close()


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"capacity": 0}, ValueError, r"argument `capacity`.*capacity=0"),
        ({"capacity": "big"}, ValueError, r"`capacity`.*capacity='big'"),
        ({"num_threads": -2}, ValueError, r"`num_threads`.*num_threads=-2"),
        ({"num_threads": 1.5}, ValueError, r"`num_threads`.*num_threads=1.5"),
        ({"timeout": 0}, ValueError, r"`timeout`.*timeout=0"),
        ({"timeout": "1s"}, ValueError, r"`timeout`.*timeout='1s'"),
        (
            {"thread_pool_size": 0},
            ValueError,
            r"`thread_pool_size`.*thread_pool_size=0",
        ),
        (
            {"num_threads": 4, "thread_pool_size": 2},
            ValueError,
            r"`thread_pool_size`.*thread_pool_size >= 4",
        ),
        (
            {"deterministic": "yes"},
            ValueError,
            r"`deterministic`.*deterministic='yes'",
        ),
        (
            {"ignored_exception_types": 3},
            TypeError,
            r"`ignored_exception_types`.*ignored_exception_types=3",
        ),
        (
            {"closed_exception_types": (int,)},
            TypeError,
            r"`closed_exception_types`.*bad item: <class 'int'>",
        ),
        (
            {
                "closed_exception_types": (ValueError,),
                "ignored_exception_types": (ValueError,),
            },
            ValueError,
            r"both closed and ignored.*\['ValueError'\]",
        ),
    ],
)
def test_bad_staged_input_options_name_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        StagedInput(**kwargs)


class _ParseNumbers(keras.layers.Layer):
    """A staged layer (no weights) that fails on a non-numeric string."""

    def call(self, x):
        return tf.strings.to_number(x)


@pytest.mark.timeout(60)
def test_error_in_a_staged_layer_names_the_layer_and_the_fix():
    inputs = keras.Input((2,), dtype="string")
    x = StagedInput(name="csv", capacity=2, num_threads=1)(inputs)
    x = _ParseNumbers(name="parse_numbers")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    assert "parse_numbers" in model.get_stage_plan().staged_layers
    rows = tf.constant([["1", "2"]] * 4 + [["x", "2"]] * 2)
    data = tf.data.Dataset.from_tensor_slices((rows, tf.ones((6, 1))))
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        model.fit(data.batch(2), shuffle=False, verbose=0)
    message = info.value.message
    assert "could not correctly convert string: x" in message
    assert (
        "[keras_stage] raised inside stage 'csv_train': in its layer "
        "'parse_numbers'; to skip the batches that fail like this, add "
        "tf.errors.InvalidArgumentError to the stage's "
        "ignored_exception_types"
    ) in message


@pytest.mark.reliability
@pytest.mark.timeout(60)
def test_timeout_error_arrives_within_the_timeout_plus_a_few_seconds(
    release,
):
    # Measured from the moment the source stops answering, after the
    # first steps (whose tracing the stall must not overlap).
    stalled = {}

    def generate():
        for i in range(40):
            if i == 30:
                stalled["at"] = time.monotonic()
                release.wait(60)
            yield np.ones((2, 2), "float32"), np.ones((2, 1), "float32")

    spec = (
        tf.TensorSpec((None, 2), tf.float32),
        tf.TensorSpec((None, 1), tf.float32),
    )
    source = tf.data.Dataset.from_generator(generate, output_signature=spec)
    model = _model(name="stall", timeout=2.0, capacity=1, num_threads=1)
    with pytest.raises(StageTimeoutError, match="Stage 'stall_train'"):
        model.fit(source, verbose=0, shuffle=False)
    late = time.monotonic() - stalled["at"]
    # Four seconds of slack for a loaded machine, still short of the 5 s
    # (`close`'s default timeout) a wait for the stalled thread would add.
    assert late < 2.0 + 4.0, f"the error came {late:.1f} s after the stall"
