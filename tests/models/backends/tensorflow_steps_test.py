"""Steps whose batch is buffered run without recording their fetch.

keras_stage's train/test step records each fetch (`_recorded_step`); once
a guarded step has reported enough fetches, a call whose batch the stage
knows to be buffered runs the step's unrecorded twin instead
(`_UnrecordedStep`), and its fetch is counted in Python. These tests lower
that threshold so that a short fit uses the twin, and check that it trains
exactly like plain Keras, counts every batch, keeps the report out of the
logs, and does not weaken the timeout.
"""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.callbacks import PrefetchCallback
from keras_stage.data import StageTimeoutError
from keras_stage.data import runner as runner_module
from keras_stage.layers import StagedInput
from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.call import facts
from keras_stage.models.decision import calls
from keras_stage.models.model_state import state as model_state
from tests.helpers import wait_until

BATCHES = 24
BATCH_SIZE = 4

_rng = np.random.default_rng(3)
X = _rng.normal(size=(BATCHES * BATCH_SIZE, 4)).astype("float32")
Y = _rng.normal(size=(BATCHES * BATCH_SIZE, 1)).astype("float32")


@pytest.fixture
def twin_calls(monkeypatch):
    """Makes guarded steps use their twin after 2 reports; counts its calls.

    Returns `{phase: calls}` of the twins made.
    """
    monkeypatch.setattr(tensorflow_steps, "UNRECORDED_AFTER", 2)
    # Whatever the first call's trace cost.
    monkeypatch.setattr(tensorflow_steps, "RECORDING_SECONDS", float("inf"))
    calls = {}
    make = tensorflow_steps.make_unrecorded

    def counting(model, phase):
        function = make(model, phase)
        calls.setdefault(phase, 0)

        def counted(iterator):
            calls[phase] += 1
            return function(iterator)

        return counted

    monkeypatch.setattr(tensorflow_steps, "make_unrecorded", counting)
    return calls


def _model(staged, **stage_kwargs):
    inputs = keras.Input(shape=(4,))
    x = StagedInput(**stage_kwargs)(inputs) if staged else inputs
    x = keras.layers.Dense(8, activation="relu")(x)
    model_class = keras_stage.Model if staged else keras.Model
    return model_class(inputs, keras.layers.Dense(1)(x))


def _dataset():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH_SIZE)


@pytest.mark.timeout(120)
def test_unrecorded_steps_train_like_keras_and_count_every_batch(twin_calls):
    plain, staged = _model(staged=False), _model(staged=True, name="twin")
    staged.set_weights(plain.get_weights())
    for model in (plain, staged):
        model.compile(optimizer="sgd", loss="mse")
    fit = dict(
        x=_dataset(),
        validation_data=_dataset(),
        epochs=2,
        verbose=0,
        shuffle=False,
    )
    plain_history = plain.fit(**fit).history
    staged_history = staged.fit(
        callbacks=[PrefetchCallback(verbose=0)], **fit
    ).history

    # Both phases ran most of their steps on the twin.
    assert twin_calls["train"] > BATCHES
    assert twin_calls["test"] > BATCHES
    for key, values in plain_history.items():
        np.testing.assert_allclose(
            staged_history[key], values, rtol=1e-6, atol=1e-6, err_msg=key
        )
    for plain_w, staged_w in zip(
        plain.get_weights(), staged.get_weights(), strict=True
    ):
        np.testing.assert_allclose(staged_w, plain_w, rtol=1e-6, atol=1e-6)
    assert not any(key.startswith("_keras_stage") for key in staged_history)
    # Every batch counted, recorded or not; the twins' fetches did not wait.
    for phase in ("train", "test"):
        stats = model_state(staged).steps.step_stats[phase]
        assert stats.snapshot()["consumed"] == 2 * BATCHES, phase
    assert all(0.0 <= r <= 1.0 for r in staged_history["stage_wait_ratio"])


@pytest.mark.timeout(120)
def test_a_short_fit_does_not_trace_a_twin_it_cannot_repay(
    twin_calls, monkeypatch
):
    # The twin saves each step the recording (RECORDING_SECONDS) and costs
    # a trace, about what the step's first call took: it is made only after
    # as many recorded steps as would cost that trace.
    monkeypatch.setattr(tensorflow_steps, "RECORDING_SECONDS", 50e-6)
    model = _model(staged=True, name="short")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(
        _dataset(),
        validation_data=_dataset(),
        epochs=2,
        verbose=0,
        shuffle=False,
    )
    assert twin_calls == {}
    # The threshold follows the first call's time.
    step = tensorflow_steps.UnrecordedStep(model, "train")
    step.note_first_call(1.0)
    assert step.first_call_noted
    assert step._after == 20_000
    step.note_first_call(0.0)
    assert step._after == tensorflow_steps.UNRECORDED_AFTER


@pytest.mark.timeout(60)
def test_timeout_fires_after_steps_ran_unrecorded(twin_calls, release):
    hang_at = 3 * BATCHES // 4
    produced = [0]

    def generate():
        for i in range(BATCHES):
            if i == hang_at:
                release.wait(60)  # a source that stops answering
            produced[0] += 1
            yield X[:BATCH_SIZE], Y[:BATCH_SIZE]

    spec = (
        tf.TensorSpec((None, 4), tf.float32),
        tf.TensorSpec((None, 1), tf.float32),
    )
    data = tf.data.Dataset.from_generator(generate, output_signature=spec)
    # A timeout a loaded machine's slow batches never reach before the hang.
    model = _model(staged=True, name="twin_hang", timeout=3.0)
    model.compile(optimizer="sgd", loss="mse")

    class SlowSteps(keras.callbacks.Callback):
        # Steps slower than the source: the stage's buffer holds the next
        # batch, which the twin then runs on (on a loaded machine the
        # generator could otherwise lag every step and never be buffered).
        # A fixed sleep is not enough when other processes take the cores:
        # each step waits until the generator is two batches ahead (or has
        # reached the batch where it hangs), then for them to be counted.
        def on_train_batch_end(self, batch, logs=None):
            wait_until(
                lambda: produced[0] >= min(batch + 3, hang_at), interval=0.005
            )
            time.sleep(0.03)

    started = time.monotonic()
    with pytest.raises(StageTimeoutError, match="twin_hang_train"):
        model.fit(data, verbose=0, shuffle=False, callbacks=[SlowSteps()])
    assert time.monotonic() - started < 30
    assert twin_calls["train"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_the_twin_steps_like_keras_and_ends_with_the_data(run_eagerly):
    # The twin is keras_stage's own compiled step, without Keras's
    # end-of-data Optional: it trains like Keras's step, and at the end of
    # the data raises the end of sequence the runner ends the epoch on.
    plain, staged = _model(staged=False), _model(staged=True, name="own")
    staged.set_weights(plain.get_weights())
    for model in (plain, staged):
        model.compile(optimizer="sgd", loss="mse", run_eagerly=run_eagerly)
    twin = tensorflow_steps.make_unrecorded(staged, "train")
    data = _dataset().take(3)
    plain_iterator, twin_iterator = iter(data), iter(data)
    plain.make_train_function()
    for _ in range(3):
        expected = plain.train_function(plain_iterator)
        logs = twin(twin_iterator)
        assert set(logs) == set(expected)
        np.testing.assert_allclose(
            float(logs["loss"]), float(expected["loss"]), rtol=1e-6
        )
    for plain_w, staged_w in zip(
        plain.get_weights(), staged.get_weights(), strict=True
    ):
        np.testing.assert_allclose(staged_w, plain_w, rtol=1e-6, atol=1e-6)
    with pytest.raises(tf.errors.OutOfRangeError) as info:
        twin(twin_iterator)
    assert runner_module._is_end_of_data(info.value)


def test_a_resumed_epoch_ends_when_its_restored_batches_are_read():
    # DataBackup's restore leaves the epoch's batches after the saved one;
    # Keras still counts the whole epoch's steps. The guard ends the epoch
    # instead of calling a step on data that has ended.
    class State:
        def __init__(self):
            self.pending_restores = {}
            self.resumed_left = {}
            self.iterators = {}

    state, restored, reopened = State(), [], []
    iterator = iter(tf.data.Dataset.range(10))
    reopen = lambda: reopened.append(True)  # noqa: E731
    state.pending_restores["train"] = (restored.append, 5, reopen)
    tensorflow_steps.track_iterator(state, "train", iterator)
    assert restored == [iterator]
    ended = [
        tensorflow_steps.resumed_epoch_ended(state, "train", iterator, 2)
        for _ in range(4)
    ]
    assert ended == [False, False, False, True]  # 2 + 2 + 1 batches
    # Keras's iterator after an epoch it stepped through, made once.
    assert reopened == [True]
    assert "train" not in state.resumed_left
    # Another iterator (the next epoch's) is not counted down.
    state.resumed_left["train"] = [lambda: iterator, 0, reopen]
    other = iter(tf.data.Dataset.range(3))
    assert not tensorflow_steps.resumed_epoch_ended(state, "train", other, 1)
    assert reopened == [True]
    assert "train" not in state.resumed_left
    # Unknown epoch length: nothing to count.
    state.pending_restores["train"] = (restored.append, None, reopen)
    tensorflow_steps.track_iterator(state, "train", other)
    assert not tensorflow_steps.resumed_epoch_ended(state, "train", other, 1)
    assert reopened == [True]


@pytest.mark.timeout(120)
def test_a_call_times_at_most_a_bounded_number_of_steps(monkeypatch):
    # The host times a SmartStage call's steps for `decision.calls`, which
    # keeps their median: a long fit holds no more than TIMED_STEPS_KEPT.
    monkeypatch.setattr(tensorflow_steps, "TIMED_STEPS_KEPT", 5)
    noted = []
    note_steps = calls.CallCosts.note_steps

    def recording(self, phase, seconds, staged):
        noted.append((phase, len(seconds), staged))
        return note_steps(self, phase, seconds, staged)

    monkeypatch.setattr(calls.CallCosts, "note_steps", recording)
    words = np.array(
        [f"w{i % 5}" for i in range(BATCHES * BATCH_SIZE)], dtype=object
    )
    inputs = keras.Input(shape=(), dtype="string")
    x = StagedInput(adaptive=False, name="timed")(inputs)
    x = keras.layers.StringLookup(vocabulary=["w0", "w1", "w2"])(x)
    x = keras.layers.Embedding(4, 2)(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    model.fit(words, Y, batch_size=BATCH_SIZE, epochs=2, verbose=0)
    assert noted == [("train", 5, True)]
    assert facts.costs(model).phase("train").staged_step_seconds > 0
