"""Staged fit/evaluate/predict start and stop their threads cleanly.

However a call ends (normally, by `stop_training`, or by an error in a
user callback), the stage's helper thread is gone when it returns, the
PrefetchCallback is wired in first, and the next call works.
"""

import gc
import threading
import time

import keras
import numpy as np
import psutil
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.callbacks import PrefetchCallback
from keras_stage.data.epochs import RELEASE_THREAD
from keras_stage.layers import StagedInput
from keras_stage.models.model_state import state as model_state
from tests.helpers import stage_threads, wait_until

STAGE_KEYS = ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped")
# TF and Keras may park a worker or two between calls; a leak of one thread
# per call would exceed this after 15 cycles.
MAX_EXTRA_OS_THREADS = 4

X = np.linspace(0.0, 1.0, 32, dtype="float32").reshape(16, 2)
Y = X.sum(axis=1, keepdims=True)


def _staged_model():
    inputs = keras.Input(shape=(2,))
    # The default timeout runs each step on a keras_stage helper thread,
    # which is the thread these tests watch; every call is staged.
    x = StagedInput(capacity=2, num_threads=2, name="life", adaptive=False)(
        inputs
    )
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


class _ThreadSpy(keras.callbacks.Callback):
    """Records the keras_stage threads alive while a step has run."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def on_train_batch_end(self, batch, logs=None):
        self.seen |= {t.name for t in stage_threads()}


class _RaiseAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError(f"user callback failed at batch {batch}")


class _StopAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if batch == self.batch:
            self.model.stop_training = True


class _EpochLogsSpy(keras.callbacks.Callback):
    """Records the keys of the epoch logs this callback receives."""

    def __init__(self):
        super().__init__()
        self.keys = []

    def on_epoch_end(self, epoch, logs=None):
        self.keys.append(set(logs))


def _cycle(model, callbacks=()):
    model.fit(
        X, Y, batch_size=4, epochs=1, verbose=0, callbacks=list(callbacks)
    )
    model.evaluate(X, Y, batch_size=4, verbose=0)
    model.predict(X, batch_size=4, verbose=0)


@pytest.mark.long
@pytest.mark.timeout(180)
def test_fifteen_cycles_leave_no_thread_behind():
    model = _staged_model()
    spy = _ThreadSpy()
    # TF starts its own pools on first use: warm up before the baseline.
    _cycle(model, [spy])
    gc.collect()
    before = set(threading.enumerate())
    os_threads_before = psutil.Process().num_threads()

    for _ in range(15):
        _cycle(model, [spy])

    gc.collect()
    new = {t.name for t in set(threading.enumerate()) - before}
    assert new == set()
    assert stage_threads() <= before
    # The check is meaningful: the stage did run a helper thread.
    assert spy.seen == {"keras_stage-life_train"}
    os_threads_after = psutil.Process().num_threads()
    assert os_threads_after <= os_threads_before + MAX_EXTRA_OS_THREADS, (
        f"the process went from {os_threads_before} to {os_threads_after} "
        "OS threads over 15 cycles"
    )


@pytest.mark.timeout(60)
def test_prefetch_callback_is_added_when_none_is_passed():
    model = _staged_model()
    spy = _EpochLogsSpy()
    history = model.fit(
        X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[spy]
    ).history
    for key in STAGE_KEYS:
        assert len(history[key]) == 2
    # Added first: the user's callback already sees the stage's logs.
    assert all(set(STAGE_KEYS) <= keys for keys in spy.keys)


@pytest.mark.timeout(60)
def test_prefetch_callback_passed_last_is_moved_first():
    model = _staged_model()
    spy = _EpochLogsSpy()
    prefetch = PrefetchCallback()
    history = model.fit(
        X,
        Y,
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[spy, prefetch],
    ).history
    assert len(spy.keys) == 2
    assert all(set(STAGE_KEYS) <= keys for keys in spy.keys)
    # The user's instance served the run (no second one was added).
    assert prefetch.verdict is not None
    assert prefetch.verdict["epoch"] == 1
    assert history["stage_wait_ratio"][-1] == prefetch.verdict["wait_ratio"]


@pytest.mark.timeout(60)
def test_one_prefetch_callback_serves_two_fits():
    model = _staged_model()
    prefetch = PrefetchCallback()
    before = stage_threads()

    first = model.fit(
        X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[prefetch]
    ).history
    assert prefetch.verdict["epoch"] == 1
    second = model.fit(
        X,
        Y,
        batch_size=4,
        epochs=3,
        verbose=0,
        validation_data=(X, Y),
        callbacks=[prefetch],
    ).history

    for key in STAGE_KEYS:
        assert len(first[key]) == 2
        assert len(second[key]) == 3
    assert second["stage_skipped"] == [0, 0, 0]
    assert prefetch.verdict["epoch"] == 2
    assert stage_threads() == before
    # The threads tearing down each call's long-lived iterator end too.
    assert wait_until(
        lambda: (
            not [t for t in threading.enumerate() if t.name == RELEASE_THREAD]
        ),
        20,
    )


@pytest.mark.timeout(60)
def test_user_callback_error_mid_epoch_closes_the_stage():
    model = _staged_model()
    prefetch = PrefetchCallback()
    spy = _ThreadSpy()
    before = stage_threads()

    with pytest.raises(RuntimeError, match="user callback failed at batch 1"):
        model.fit(
            X,
            Y,
            batch_size=4,
            epochs=2,
            verbose=0,
            callbacks=[spy, _RaiseAt(batch=1), prefetch],
        )
    assert spy.seen == {"keras_stage-life_train"}
    assert stage_threads() == before

    # The same model and callback work again in the same process.
    history = model.fit(
        X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[prefetch]
    ).history
    assert len(history["loss"]) == 2
    assert history["stage_skipped"] == [0, 0]
    assert prefetch.verdict["epoch"] == 1
    assert stage_threads() == before


@pytest.mark.timeout(60)
def test_stop_training_from_a_callback_ends_cleanly():
    model = _staged_model()
    stop = _StopAt(batch=1)
    before = stage_threads()

    history = model.fit(
        X, Y, batch_size=4, epochs=3, verbose=0, callbacks=[stop]
    ).history

    assert stop.batches == 2
    assert len(history["loss"]) == 1
    for key in STAGE_KEYS:
        assert len(history[key]) == 1
    assert stage_threads() == before
    # Training can resume on the same model.
    history = model.fit(X, Y, batch_size=4, epochs=1, verbose=0).history
    assert len(history["loss"]) == 1


@pytest.mark.timeout(60)
def test_error_in_evaluate_and_predict_callbacks_closes_the_stage():
    model = _staged_model()
    before = stage_threads()

    class FailingTest(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            raise RuntimeError("evaluate callback failed")

        def on_predict_batch_end(self, batch, logs=None):
            raise RuntimeError("predict callback failed")

    with pytest.raises(RuntimeError, match="evaluate callback failed"):
        model.evaluate(X, Y, batch_size=4, verbose=0, callbacks=[FailingTest()])
    with pytest.raises(RuntimeError, match="predict callback failed"):
        model.predict(X, batch_size=4, verbose=0, callbacks=[FailingTest()])
    assert stage_threads() == before

    assert np.isfinite(model.evaluate(X, Y, batch_size=4, verbose=0))
    assert model.predict(X, batch_size=4, verbose=0).shape == (16, 1)


# -- iterators outliving their call ----------------------------------------


def _slow_source(batches=10**6):
    def slow(i):
        time.sleep(0.01)
        return i

    ids = tf.data.Dataset.range(batches).map(
        lambda i: tf.ensure_shape(tf.py_function(slow, [i], tf.int64), ())
    )
    return ids.map(
        lambda i: (tf.ones((4, 2)) * tf.cast(i, tf.float32), tf.ones((4, 1)))
    )


@pytest.mark.timeout(120)
def test_iterator_kept_alive_by_a_failed_fit_stops_counting():
    # A traceback holds the failed fit's frames, and with them Keras's
    # iterator of the stage: its elements must not keep counting in the
    # stats the model's next fit records in.
    inputs = keras.Input(shape=(2,))
    x = StagedInput(capacity=32, num_threads=1, name="kept", adaptive=False)(
        inputs
    )
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError) as info:
        model.fit(
            _slow_source(),
            steps_per_epoch=10,
            shuffle=False,
            verbose=0,
            callbacks=[_RaiseAt(batch=2)],
        )
    assert info.traceback  # the frames, and Keras's iterator, stay alive
    stats = model_state(model).steps.step_stats["train"]
    produced = stats.snapshot()["produced"]
    time.sleep(0.6)  # time for 60 more elements, were it still running
    assert stats.snapshot()["produced"] <= produced + 2


@pytest.mark.parametrize("steps_per_epoch, left", [(None, 6), (10, None)])
def test_a_resumed_epoch_is_counted_down_only_with_an_iterator_per_epoch(
    tmp_path, steps_per_epoch, left
):
    # With steps_per_epoch Keras reads one iterator across the epochs, so
    # the restored iterator also holds the later epochs' batches: the
    # resumed epoch runs its steps as Keras counts them.
    from keras_stage.callbacks.data_backup import DataBackup
    from keras_stage.models.call.staged_call import _with_data_backup

    inputs = keras.Input((1,))
    model = keras_stage.Model(
        inputs, keras.layers.Dense(1)(StagedInput()(inputs))
    )
    backup = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)
    reopened = []

    def reopen(phase, count=1):
        reopened.extend([phase] * count)

    callbacks = _with_data_backup(model, [backup], steps_per_epoch, reopen)
    data_backup = callbacks[1]
    assert isinstance(data_backup, DataBackup)
    data_backup._restore_next(lambda iterator: None, 6, 1)
    restore, got, reopen = model_state(model).bound.pending_restores.pop(
        "train"
    )
    assert got == left
    # Without steps_per_epoch: the draws before epoch 1's own (1), made
    # as it begins; then Keras's iterator after the resumed epoch.
    reopen()
    expected = ["train"] if steps_per_epoch is None else []
    assert reopened == expected + ["train"]
