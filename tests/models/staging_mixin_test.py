"""A staged fit trains exactly like a plain Keras fit.

Each test builds the same deterministic model twice, once as a plain Keras
model and once as a keras_stage model with a `StagedInput` right after the
inputs, copies the initial weights, seeds the same way right before each
`fit`, and checks that losses and final weights agree, for every kind of
data Keras accepts. Staging may change where batches come from, never which
batches or in which order.
"""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.callbacks import PrefetchCallback
from keras_stage.data.runner import StageRunner
from keras_stage.layers import StagedInput
from keras_stage.models.model_state import state as model_state
from tests.helpers import sweep, twin_optimizer

FIT_SEED = 7
NUM_SAMPLES = 40
BATCH_SIZE = 8
STEPS = NUM_SAMPLES // BATCH_SIZE
EPOCHS = 3
STAGE_KEYS = ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped")

_rng = np.random.default_rng(0)
X = _rng.normal(size=(NUM_SAMPLES, 4)).astype("float32")
Y = _rng.normal(size=(NUM_SAMPLES, 1)).astype("float32")
Y_CLASS = (_rng.random(size=(NUM_SAMPLES, 1)) > 0.5).astype("float32")
SAMPLE_WEIGHT = _rng.random(size=(NUM_SAMPLES,)).astype("float32")
X_DICT = {"a": X[:, :2], "b": X[:, 2:]}


def _staged_input():
    # Every call staged: these tests check the stage itself (calls that
    # skip it: tests/models/model_state_test.py).
    return StagedInput(capacity=2, num_threads=2, adaptive=False)


def _trunk(x):
    x = keras.layers.Dense(8, activation="relu")(x)
    return keras.layers.Dense(1)(x)


def _build_functional(staged):
    inputs = keras.Input(shape=(4,))
    x = _staged_input()(inputs) if staged else inputs
    model_class = keras_stage.Model if staged else keras.Model
    return model_class(inputs, _trunk(x))


def _build_dict_functional(staged):
    inputs = {
        "a": keras.Input(shape=(2,), name="a"),
        "b": keras.Input(shape=(2,), name="b"),
    }
    x = _staged_input()(inputs) if staged else inputs
    x = keras.layers.Concatenate()([x["a"], x["b"]])
    model_class = keras_stage.Model if staged else keras.Model
    return model_class(inputs, _trunk(x))


def _build_sequential(staged):
    layers = [keras.Input(shape=(4,))]
    if staged:
        layers.append(_staged_input())
    layers += [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    model_class = keras_stage.Sequential if staged else keras.Sequential
    return model_class(layers)


class PlainSubclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


class StagedSubclassed(keras_stage.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stage = _staged_input()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(self.stage(x)))


def _build_subclassed(staged):
    model = StagedSubclassed() if staged else PlainSubclassed()
    model(X[:1])  # builds the weights, so they can be copied
    return model


def _twins(build, **compile_kwargs):
    """A plain and a staged model with the same initial weights."""
    plain = build(staged=False)
    staged = build(staged=True)
    staged.set_weights(plain.get_weights())
    for model in (plain, staged):
        model.compile(
            optimizer=twin_optimizer(),
            loss="mse",
            **compile_kwargs,
        )
    return plain, staged


def _sync(plain, staged):
    """Gives `staged` the weights and optimizer state of `plain`."""
    staged.set_weights(plain.get_weights())
    for target, source in zip(
        staged.optimizer.variables, plain.optimizer.variables, strict=True
    ):
        target.assign(source)


# Twins shared by the tests of one module: tracing the compiled steps is
# most of the cost of a tiny fit, and every test re-synchronises the pair
# first, so each still starts from equal models.
@pytest.fixture(scope="module")
def functional_twins():
    return _twins(_build_functional)


@pytest.fixture(scope="module")
def dict_twins():
    return _twins(_build_dict_functional)


def _fit(model, fit_kwargs, seed=FIT_SEED):
    # Keras's shuffling draws from the global seed: the same seed right
    # before each fit gives both models the same batch order.
    keras.utils.set_random_seed(seed)
    return model.fit(verbose=0, **fit_kwargs()).history


def _assert_same_training(plain, staged, plain_history, staged_history):
    for key in STAGE_KEYS:
        # The stage really ran (the PrefetchCallback reported it).
        assert key in staged_history, key
    for key, values in plain_history.items():
        np.testing.assert_allclose(
            staged_history[key], values, rtol=1e-6, atol=1e-6, err_msg=key
        )
    assert len(plain_history["loss"]) > 0
    for plain_w, staged_w in zip(
        plain.get_weights(), staged.get_weights(), strict=True
    ):
        np.testing.assert_allclose(staged_w, plain_w, rtol=1e-6, atol=1e-6)


def _dataset():
    return (
        tf.data.Dataset.from_tensor_slices((X, Y))
        .shuffle(NUM_SAMPLES, seed=3)
        .batch(BATCH_SIZE)
    )


def _generator():
    # Finite: exactly the batches of EPOCHS epochs of STEPS steps.
    for _ in range(EPOCHS):
        for i in range(0, NUM_SAMPLES, BATCH_SIZE):
            yield X[i : i + BATCH_SIZE], Y[i : i + BATCH_SIZE]


class _PyDataset(keras.utils.PyDataset):
    def __init__(self, x, y=None, **kwargs):
        super().__init__(**kwargs)
        self.x = x
        self.y = y

    def __len__(self):
        return STEPS

    def __getitem__(self, index):
        batch = slice(index * BATCH_SIZE, (index + 1) * BATCH_SIZE)
        if self.y is None:
            return self.x[batch]
        return self.x[batch], self.y[batch]


# (twins fixture, fit arguments): a function, so each fit gets fresh data.
SOURCES = {
    "numpy_shuffled": (
        "functional_twins",
        lambda: dict(x=X, y=Y, batch_size=BATCH_SIZE, shuffle=True),
    ),
    "dict_of_numpy": (
        "dict_twins",
        lambda: dict(x=X_DICT, y=Y, batch_size=BATCH_SIZE, shuffle=True),
    ),
    "tf_dataset": (
        "functional_twins",
        lambda: dict(x=_dataset(), shuffle=False),
    ),
    "generator": (
        "functional_twins",
        lambda: dict(x=_generator(), steps_per_epoch=STEPS, shuffle=False),
    ),
    "py_dataset": (
        "functional_twins",
        lambda: dict(x=_PyDataset(X, Y), shuffle=True),
    ),
    "validation_split": (
        "functional_twins",
        lambda: dict(x=X, y=Y, batch_size=BATCH_SIZE, validation_split=0.25),
    ),
    "validation_data_tuple": (
        "functional_twins",
        lambda: dict(
            x=X,
            y=Y,
            batch_size=BATCH_SIZE,
            validation_data=(X[:16], Y[:16]),
        ),
    ),
    "validation_data_dataset": (
        "functional_twins",
        lambda: dict(
            x=X,
            y=Y,
            batch_size=BATCH_SIZE,
            validation_data=tf.data.Dataset.from_tensor_slices(
                (X[:16], Y[:16])
            ).batch(4),
        ),
    ),
    "validation_freq_and_batch_size": (
        "functional_twins",
        lambda: dict(
            x=X,
            y=Y,
            batch_size=BATCH_SIZE,
            validation_split=0.2,
            validation_freq=2,
            validation_batch_size=3,
        ),
    ),
    "sample_weight": (
        "functional_twins",
        lambda: dict(
            x=X, y=Y, batch_size=BATCH_SIZE, sample_weight=SAMPLE_WEIGHT
        ),
    ),
    "class_weight": (
        "functional_twins",
        lambda: dict(
            x=X,
            y=Y_CLASS,
            batch_size=BATCH_SIZE,
            class_weight={0: 1.0, 1: 3.0},
        ),
    ),
}


# In `make test` elsewhere too: PyDatasets in python_sources_test, a
# dataset's validation in epoch_plans_test, class weights' batches in
# arrays_test, dict inputs in smart_stage_test.
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "source",
    sweep(
        sorted(SOURCES),
        kept=(
            "numpy_shuffled",
            "tf_dataset",
            "generator",
            "validation_data_tuple",
            "sample_weight",
        ),
    ),
)
def test_staged_fit_matches_plain_fit(source, request):
    twins, fit_kwargs = SOURCES[source]
    plain, staged = request.getfixturevalue(twins)
    _sync(plain, staged)

    def with_epochs():
        return dict(epochs=EPOCHS, **fit_kwargs())

    plain_history = _fit(plain, with_epochs)
    staged_history = _fit(staged, with_epochs)

    _assert_same_training(plain, staged, plain_history, staged_history)
    assert len(staged_history["loss"]) == EPOCHS


@pytest.mark.timeout(120)
# Plain Keras warns when steps_per_epoch cuts an epoch of arrays short; the
# staged run must behave the same, warning included.
@pytest.mark.filterwarnings("ignore:Your input ran out of data:UserWarning")
def test_staged_fit_matches_plain_fit_with_steps_per_epoch_on_arrays(
    functional_twins,
):
    plain, staged = functional_twins
    _sync(plain, staged)

    def fit_kwargs():
        # 5 batches per pass, 2 per epoch: epochs end mid-pass, and Keras
        # carries its iterator (and shuffled order) across them.
        return dict(
            x=X, y=Y, batch_size=BATCH_SIZE, steps_per_epoch=2, epochs=4
        )

    plain_history = _fit(plain, fit_kwargs)
    staged_history = _fit(staged, fit_kwargs)
    _assert_same_training(plain, staged, plain_history, staged_history)


@pytest.mark.timeout(120)
def test_shuffled_numpy_comparison_is_order_sensitive(functional_twins):
    # Guards the comparison above: a different seed gives a different batch
    # order and different losses, so equal losses mean equal order.
    _, fit_kwargs = SOURCES["numpy_shuffled"]
    first, second = functional_twins
    _sync(first, second)
    first_history = _fit(first, fit_kwargs, seed=FIT_SEED)
    second_history = _fit(second, fit_kwargs, seed=FIT_SEED + 1)
    assert first_history["loss"] != second_history["loss"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "compile_kwargs",
    [
        # Each in `make test` too: steps_per_execution in epochs_test and
        # determinism_test, jit_compile in smart_stage_test.
        pytest.param(
            {"steps_per_execution": 3},
            id="steps_per_execution_3",
            marks=pytest.mark.long,
        ),
        pytest.param(
            {"jit_compile": True}, id="jit_compile", marks=pytest.mark.long
        ),
        pytest.param({"run_eagerly": True}, id="run_eagerly"),
    ],
)
def test_staged_fit_matches_plain_fit_with_compile_options(compile_kwargs):
    plain, staged = _twins(_build_functional, **compile_kwargs)

    def fit_kwargs():
        return dict(
            x=X,
            y=Y,
            batch_size=BATCH_SIZE,
            epochs=2,
            validation_data=(X[:16], Y[:16]),
        )

    plain_history = _fit(plain, fit_kwargs)
    staged_history = _fit(staged, fit_kwargs)
    _assert_same_training(plain, staged, plain_history, staged_history)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "build",
    [_build_sequential, _build_subclassed],
    ids=["sequential", "subclassed"],
)
def test_staged_fit_matches_plain_fit_for_other_model_styles(build):
    plain, staged = _twins(build)

    def fit_kwargs():
        return dict(
            x=X,
            y=Y,
            batch_size=BATCH_SIZE,
            epochs=EPOCHS,
            shuffle=True,
            validation_split=0.25,
        )

    plain_history = _fit(plain, fit_kwargs)
    staged_history = _fit(staged, fit_kwargs)
    _assert_same_training(plain, staged, plain_history, staged_history)
    assert isinstance(staged, keras_stage.Model | keras_stage.Sequential)


@pytest.mark.timeout(120)
def test_fit_on_a_dataset_staged_by_the_user_matches_plain_fit(
    functional_twins,
):
    plain, staged = functional_twins
    _sync(plain, staged)

    plain_history = _fit(
        plain, lambda: dict(x=_dataset(), epochs=EPOCHS, shuffle=False)
    )
    staged_history = _fit(
        staged,
        lambda: dict(
            x=keras_stage.data.stage(
                _dataset(), capacity=2, num_threads=2, name="user_stage"
            ),
            epochs=EPOCHS,
        ),
    )
    _assert_same_training(plain, staged, plain_history, staged_history)


class _RecordingPrefetch(PrefetchCallback):
    """Records which phases were staged, to prove staging happened."""

    def __init__(self):
        super().__init__()
        self.phases = []

    def attach(self, phase, staged, adapter=None, **kwargs):
        self.phases.append(phase)
        super().attach(phase, staged, adapter, **kwargs)


# (twins fixture, evaluate arguments, predict arguments)
EVAL_SOURCES = {
    "numpy": (
        "functional_twins",
        lambda: dict(x=X, y=Y, batch_size=BATCH_SIZE),
        lambda: dict(x=X, batch_size=BATCH_SIZE),
    ),
    "dict_of_numpy": (
        "dict_twins",
        lambda: dict(x=X_DICT, y=Y, batch_size=BATCH_SIZE),
        lambda: dict(x=X_DICT, batch_size=BATCH_SIZE),
    ),
    "tf_dataset": (
        "functional_twins",
        lambda: dict(
            x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH_SIZE)
        ),
        lambda: dict(x=tf.data.Dataset.from_tensor_slices(X).batch(5)),
    ),
    "py_dataset": (
        "functional_twins",
        lambda: dict(x=_PyDataset(X, Y)),
        lambda: dict(x=_PyDataset(X)),
    ),
    "sample_weight": (
        "functional_twins",
        lambda: dict(
            x=X, y=Y, batch_size=BATCH_SIZE, sample_weight=SAMPLE_WEIGHT
        ),
        lambda: dict(x=X[:13], batch_size=4),
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "source",
    sweep(sorted(EVAL_SOURCES), kept=("numpy", "tf_dataset", "py_dataset")),
)
def test_staged_evaluate_and_predict_match_plain_model(source, request):
    twins, eval_kwargs, predict_kwargs = EVAL_SOURCES[source]
    plain, staged = request.getfixturevalue(twins)
    _sync(plain, staged)

    recorder = _RecordingPrefetch()
    staged_loss = staged.evaluate(
        verbose=0, callbacks=[recorder], **eval_kwargs()
    )
    plain_loss = plain.evaluate(verbose=0, **eval_kwargs())
    np.testing.assert_allclose(staged_loss, plain_loss, rtol=1e-6)

    staged_pred = staged.predict(
        verbose=0, callbacks=[recorder], **predict_kwargs()
    )
    plain_pred = plain.predict(verbose=0, **predict_kwargs())
    assert staged_pred.shape == plain_pred.shape
    np.testing.assert_allclose(staged_pred, plain_pred, rtol=1e-6, atol=1e-6)

    assert recorder.phases == ["test", "predict"]


@pytest.mark.timeout(120)
def test_staged_evaluate_return_dict_matches_plain_model():
    plain, staged = _twins(_build_functional, metrics=["mae"])
    kwargs = dict(x=X, y=Y, batch_size=BATCH_SIZE, verbose=0)
    staged_logs = staged.evaluate(return_dict=True, **kwargs)
    plain_logs = plain.evaluate(return_dict=True, **kwargs)
    assert staged_logs.keys() == plain_logs.keys()
    for key, value in plain_logs.items():
        assert staged_logs[key] == pytest.approx(value, rel=1e-6)


class _NoJitDense(keras.layers.Dense):
    """A trainable layer Keras knows XLA cannot compile."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.supports_jit = False


class SideEffectSubclassed(StagedSubclassed):
    def call(self, x):
        self.seen = True  # a side effect: its call is not planned
        return super().call(x)


def _unplanned():
    # A subclass whose call cannot be planned: its stage plan has a note.
    model = SideEffectSubclassed()
    model(X[:1])
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    return model


def _no_jit_trunk():
    inputs = keras.Input(shape=(4,))
    x = keras.layers.Rescaling(0.5)(_staged_input()(inputs))
    model = keras_stage.Model(inputs, _NoJitDense(1)(x))
    model.compile(
        optimizer="sgd", loss="mse", smart_stage=True, jit_compile=True
    )
    return model


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
@pytest.mark.parametrize(
    ("build", "message"),
    [(_unplanned, "Subclassed model"), (_no_jit_trunk, "XLA cannot compile")],
)
def test_staging_warnings_point_at_the_users_call(method, build, message):
    model = build()
    data = (X,) if method == "predict" else (X, Y)
    with pytest.warns(UserWarning, match=message) as caught:
        getattr(model, method)(*data, batch_size=BATCH_SIZE, verbose=0)
    ours = [w.filename for w in caught if message in str(w.message)]
    assert ours == [__file__]


def test_staged_input_is_an_identity_in_a_plain_keras_model():
    # Outside keras_stage models the layer changes nothing, so a plain Keras
    # model with it trains like one without it.
    inputs = keras.Input(shape=(4,))
    with_layer = keras.Model(inputs, _trunk(_staged_input()(inputs)))
    without = _build_functional(staged=False)
    without.set_weights(with_layer.get_weights())
    np.testing.assert_allclose(
        with_layer.predict(X, verbose=0), without.predict(X, verbose=0)
    )


class _Unhurried(keras.callbacks.Callback):
    """Waits a little before each step, so the stage fills its buffer.

    The steps of a tiny model on busy cores (the suite's other workers)
    can outrun the stage: then no batch is ever buffered, and what the
    test checks (a buffered step skips the helper thread) never arises.
    """

    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(0.01)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_steps_whose_batches_are_buffered_skip_the_helper_thread(
    functional_twins, monkeypatch, steps_per_execution
):
    # The timeout's helper thread costs two thread wake-ups per step; a
    # step whose batches are buffered cannot wait, so it runs in the
    # caller's thread. Only the first call of an iterator (its start) must
    # take the helper: the fit's epochs run on one iterator (long-lived),
    # and training is unchanged.
    handed_off = []
    original = StageRunner._call_with_timeout

    def counting(self, fn, args, started, *rest):
        handed_off.append(self.name)
        return original(self, fn, args, started, *rest)

    monkeypatch.setattr(StageRunner, "_call_with_timeout", counting)
    plain, staged = functional_twins
    _sync(plain, staged)
    for model in (plain, staged):
        model.steps_per_execution = steps_per_execution
        # Keras reads it as it traces its step: a step an earlier test
        # traced would keep the old value.
        model.make_train_function(force=True)

    def fit_kwargs():
        data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(2)
        return {
            "x": data,
            "epochs": EPOCHS,
            "shuffle": False,
            "callbacks": [_Unhurried()],
        }

    try:
        plain_history = _fit(plain, fit_kwargs)
        staged_history = _fit(staged, fit_kwargs)
    finally:
        for model in (plain, staged):
            model.steps_per_execution = 1
            model.make_train_function(force=True)
    _assert_same_training(plain, staged, plain_history, staged_history)
    calls = EPOCHS * NUM_SAMPLES // 2 // steps_per_execution
    assert 1 <= len(handed_off) <= calls // 3, (len(handed_off), calls)


class _LogKeys(keras.callbacks.Callback):
    """Every key of every log a callback sees."""

    def on_train_begin(self, logs=None):
        self.keys = set()

    def _note(self, logs):
        self.keys |= set(logs or {})

    def on_train_batch_end(self, batch, logs=None):
        self._note(logs)

    def on_test_batch_end(self, batch, logs=None):
        self._note(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._note(logs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_step_reports_reach_the_stage_and_never_the_logs(
    functional_twins, monkeypatch, steps_per_execution
):
    # keras_stage's step returns its stage's report (the fetch's clock and
    # counters) in its logs; the guard takes it out before Keras's loop,
    # callbacks or History see it, once per call.
    reports = []
    original = StageRunner.take_report

    def counting(self, iterator, values, called=None):
        reports.append((self.name, len(values)))
        return original(self, iterator, values, called)

    monkeypatch.setattr(StageRunner, "take_report", counting)
    staged = functional_twins[1]
    staged.steps_per_execution = steps_per_execution
    # Keras reads `steps_per_execution` as it traces its step functions:
    # functions an earlier test traced would keep the old value.
    staged.make_train_function(force=True)
    staged.make_test_function(force=True)
    keys = _LogKeys()
    prefetch = PrefetchCallback(verbose=0)
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(2)
    counted = _step_stats(staged, "train")
    consumed = counted.snapshot()["consumed"] if counted else 0
    try:
        history = staged.fit(
            data,
            validation_data=data,
            epochs=2,
            verbose=0,
            shuffle=False,
            callbacks=[keys, prefetch],
        ).history
    finally:
        staged.steps_per_execution = 1
        staged.make_train_function(force=True)
        staged.make_test_function(force=True)
    seen = keys.keys | set(history)
    assert not any(key.startswith("_keras_stage") for key in seen), seen
    calls = 2 * (NUM_SAMPLES // 2) // steps_per_execution
    train = [size for name, size in reports if name.endswith("_train")]
    test = [size for name, size in reports if name.endswith("_val")]
    assert len(train) == calls and len(test) == calls, sorted(set(reports))
    # One batch per call: the fetch's facts go to Python; several: the step
    # counted them in the graph and reports its count only.
    # (The counter vector has 9 slots; a fetch's report adds its mark,
    # arrival time and the counters at its arrival.)
    assert set(train) == set(test) == {20 if steps_per_execution == 1 else 9}
    # Either way every fetch is counted.
    snapshot = _step_stats(staged, "train").snapshot()
    assert snapshot["consumed"] - consumed == 2 * NUM_SAMPLES // 2


def _step_stats(model, phase):
    """The stats `model`'s compiled `phase` step records in, or None."""
    return model_state(model).steps.step_stats.get(phase)
