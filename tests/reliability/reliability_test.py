"""Fault injection on staged models: no lost batch, no hang, no thread left.

A staged fit/evaluate/predict is interrupted in every way a user meets: a
source that fails mid-epoch, EarlyStopping, Ctrl-C (KeyboardInterrupt in
the main thread) while the step waits for its batch or runs, and user
callbacks that raise. Each time the error reaches the user as it would
without the stage, every stage thread ends, and the same model trains
again in the same process. A soak of 200 short cycles on one model checks
that threads, file descriptors and memory do not grow.
"""

import _thread
import gc
import signal
import threading
import time

import keras
import numpy as np
import psutil
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.callbacks import PrefetchCallback
from keras_stage.layers import StagedInput
from tests.helpers import stage_threads

pytestmark = pytest.mark.reliability

STAGE_KEYS = ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped")
# The stage's default timeout: each step runs on its helper thread while
# the main thread waits (see `StageRunner`). `None` runs it in the caller.
DEFAULT_TIMEOUT = 300.0
TIMEOUTS = [
    pytest.param(DEFAULT_TIMEOUT, id="helper_thread"),
    pytest.param(None, id="main_thread"),
]
# Ctrl-C comes `INTERRUPT_DELAY` s after batch `INTERRUPT_AFTER_BATCH` ends;
# the source makes no later batch before that end, then takes
# `SLOW_BATCH_SECONDS` per batch: the interrupt lands while the next step
# waits for its batch.
INTERRUPT_AFTER_BATCH = 2
INTERRUPT_DELAY = 0.3
SLOW_BATCH_SECONDS = 1.5
# KeyboardInterrupt must reach the user within this many seconds of the
# signal, the interrupted step included.
PROMPT_SECONDS = 5.0

X = np.linspace(0.0, 1.0, 32, dtype="float32").reshape(16, 2)
Y = X.sum(axis=1, keepdims=True)


@pytest.fixture(autouse=True)
def _sigint_raises_keyboard_interrupt():
    """Ctrl-C as in a terminal: Python's own SIGINT handler installed.

    A process started in the background by a non-interactive shell (`make
    test &`) inherits SIGINT ignored, and then Python installs no handler
    and `_thread.interrupt_main` does nothing.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _model(name="rel", timeout=DEFAULT_TIMEOUT):
    inputs = keras.Input(shape=(2,))
    # Every call staged: these tests end and restart the stage.
    x = StagedInput(
        capacity=2,
        num_threads=1,
        timeout=timeout,
        name=name,
        adaptive=False,
    )(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _plain_model():
    inputs = keras.Input(shape=(2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _assert_same_weights(model, other):
    for mine, theirs in zip(
        model.get_weights(), other.get_weights(), strict=True
    ):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


def _fits_again(model, callbacks=(), epochs=2):
    """Checks that `model` trains, evaluates and predicts normally."""
    history = model.fit(
        X,
        Y,
        batch_size=4,
        epochs=epochs,
        verbose=0,
        validation_data=(X, Y),
        callbacks=list(callbacks),
    ).history
    for key in ("loss", "val_loss", *STAGE_KEYS):
        assert len(history[key]) == epochs, key
    assert np.all(np.isfinite(history["loss"]))
    assert history["stage_skipped"] == [0] * epochs
    assert np.isfinite(model.evaluate(X, Y, batch_size=4, verbose=0))
    assert model.predict(X, batch_size=4, verbose=0).shape == (16, 1)


class _BatchSpy(keras.callbacks.Callback):
    """Counts the batches each phase finished and the stage threads seen."""

    def __init__(self):
        super().__init__()
        self.batches = {"train": 0, "test": 0, "predict": 0}
        self.threads = set()

    def _saw(self, phase):
        self.batches[phase] += 1
        self.threads |= {t.name for t in stage_threads()}

    def on_train_batch_end(self, batch, logs=None):
        self._saw("train")

    def on_test_batch_end(self, batch, logs=None):
        self._saw("test")

    def on_predict_batch_end(self, batch, logs=None):
        self._saw("predict")


# -- a source that fails mid-epoch -------------------------------------------

FAIL_AT = 3
SOURCE_BATCHES = 8


def _failing_map():
    """Batches from a map whose assertion fails at batch `FAIL_AT`."""

    def batch(i):
        check = tf.debugging.assert_less(
            i, tf.constant(FAIL_AT, tf.int64), message="bad batch in the map"
        )
        with tf.control_dependencies([check]):
            x = tf.fill((4, 2), tf.cast(i, tf.float32) / SOURCE_BATCHES)
        return x, tf.reduce_sum(x, axis=1, keepdims=True)

    return tf.data.Dataset.range(SOURCE_BATCHES).map(batch)


def _failing_generator():
    """A Python generator of batches that raises at batch `FAIL_AT`."""
    for i in range(SOURCE_BATCHES):
        if i == FAIL_AT:
            raise ValueError(f"generator broke at batch {i}")
        x = np.full((4, 2), i / SOURCE_BATCHES, "float32")
        yield x, x.sum(axis=1, keepdims=True)


SOURCES = {
    "tf_data_map": (_failing_map, "bad batch in the map"),
    "generator": (_failing_generator, "generator broke at batch 3"),
}


def _error_of(fit):
    with pytest.raises(Exception) as info:
        fit()
    return info.value


@pytest.mark.timeout(90)
# `make test` keeps each source and each thread once; the other two
# combinations are in `make test-long`.
@pytest.mark.parametrize(
    "timeout, source",
    [
        (DEFAULT_TIMEOUT, "generator"),
        (None, "tf_data_map"),
        pytest.param(DEFAULT_TIMEOUT, "tf_data_map", marks=pytest.mark.long),
        pytest.param(None, "generator", marks=pytest.mark.long),
    ],
    ids=[
        "helper_thread-generator",
        "main_thread-tf_data_map",
        "helper_thread-tf_data_map",
        "main_thread-generator",
    ],
)
def test_source_failing_mid_epoch_surfaces_and_the_model_fits_again(
    source, timeout
):
    make, text = SOURCES[source]
    # A generator has no length: give Keras the epoch's length.
    steps = SOURCE_BATCHES if source == "generator" else None
    model = _model(name="src", timeout=timeout)
    initial = model.get_weights()
    spy = _BatchSpy()
    before = stage_threads()

    error = _error_of(
        lambda: model.fit(
            make(),
            steps_per_epoch=steps,
            epochs=2,
            verbose=0,
            shuffle=False,
            callbacks=[spy],
        )
    )
    plain = _plain_model()
    plain.set_weights(initial)
    plain_error = _error_of(
        lambda: plain.fit(
            make(), steps_per_epoch=steps, epochs=2, verbose=0, shuffle=False
        )
    )
    # The type plain Keras gives for the same source (TensorFlow turns a
    # generator's exception into an op error), with the stage named.
    assert type(error) is type(plain_error)
    assert isinstance(error, tf.errors.InvalidArgumentError)
    message = str(error)
    assert text in message
    assert "raised inside stage 'src_train'" in message
    # The batches before the failing one were all trained, once each, and
    # the failing step did what it does in plain Keras.
    assert spy.batches["train"] == FAIL_AT
    _assert_same_weights(model, plain)
    assert (
        model.optimizer.iterations.numpy() == plain.optimizer.iterations.numpy()
    )
    if timeout is not None:
        assert spy.threads == {"keras_stage-src_train"}
    assert stage_threads() == before

    _fits_again(model)
    assert stage_threads() == before


# -- EarlyStopping ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_early_stopping_ends_cleanly_and_the_model_fits_again():
    model = _model(name="early")
    # No epoch can improve on the first by 1e9: training stops once
    # `patience` epochs have passed without improvement, after epoch 3.
    stop = keras.callbacks.EarlyStopping(
        monitor="val_loss", min_delta=1e9, patience=2
    )
    prefetch = PrefetchCallback()
    before = stage_threads()

    history = model.fit(
        X,
        Y,
        batch_size=4,
        epochs=10,
        verbose=0,
        validation_data=(X, Y),
        callbacks=[stop, prefetch],
    ).history

    assert stop.stopped_epoch == 2
    for key in ("loss", "val_loss", *STAGE_KEYS):
        assert len(history[key]) == 3, key
    assert prefetch.verdict["epoch"] == 2
    assert int(model.optimizer.iterations.numpy()) == 3 * 4
    assert stage_threads() == before

    # The same callbacks serve the next fit, which stops at the same point.
    history = model.fit(
        X,
        Y,
        batch_size=4,
        epochs=10,
        verbose=0,
        validation_data=(X, Y),
        callbacks=[stop, prefetch],
    ).history
    assert len(history["loss"]) == 3
    assert stop.stopped_epoch == 2
    assert stage_threads() == before
    _fits_again(model)


# -- KeyboardInterrupt ------------------------------------------------------


def _slow_after(go, fast_batches=INTERRUPT_AFTER_BATCH + 1, slow_batches=2):
    """Batches after the first `fast_batches` wait for `go`, then are slow.

    The wait keeps the stage's buffer from running ahead, so which step is
    waiting when Ctrl-C comes does not depend on how long tracing took. The
    few slow batches bound what an abandoned iterator still makes.
    """
    batches = fast_batches + slow_batches

    def make(i):
        if i >= fast_batches:
            go.wait(30)
            time.sleep(SLOW_BATCH_SECONDS)
        return i

    ids = tf.data.Dataset.range(batches).map(
        lambda i: tf.ensure_shape(tf.py_function(make, [i], tf.int64), ())
    )
    return ids.map(
        lambda i: (
            tf.ones((4, 2)) * tf.cast(i, tf.float32) / batches,
            tf.ones((4, 1)),
        )
    )


class _CtrlCAfter(keras.callbacks.Callback):
    """Presses Ctrl-C `INTERRUPT_DELAY` s after a phase's batch ends.

    `_thread.interrupt_main` has the effect of SIGINT: Python raises
    KeyboardInterrupt in the main thread at its next bytecode (a real
    signal also cuts a blocking wait short, so it is at least as prompt).
    The time it fired is kept to check that the call ended promptly.
    """

    def __init__(self, phase, batch=INTERRUPT_AFTER_BATCH):
        super().__init__()
        self.phase = phase
        self.batch = batch
        # Lets the source make the batches after `batch`.
        self.go = threading.Event()
        self.fired_at = None
        self.handler = None
        self.timer = None

    def _fire(self):
        self.fired_at = time.monotonic()
        # interrupt_main does nothing unless Python handles SIGINT: kept to
        # tell that apart from an interrupt lost on its way to the user.
        self.handler = signal.getsignal(signal.SIGINT)
        _thread.interrupt_main()

    def _batch_end(self, phase, batch):
        if phase == self.phase and batch == self.batch and not self.timer:
            self.timer = threading.Timer(INTERRUPT_DELAY, self._fire)
            self.timer.start()
            self.go.set()

    def on_train_batch_end(self, batch, logs=None):
        self._batch_end("train", batch)

    def on_test_batch_end(self, batch, logs=None):
        self._batch_end("test", batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._batch_end("predict", batch)


def _interrupted(call, ctrl_c, within=PROMPT_SECONDS):
    """Runs `call`; returns the frames the KeyboardInterrupt came through."""
    with pytest.raises(KeyboardInterrupt) as info:
        started = time.monotonic()
        call()
        ctrl_c.timer.join()
        pytest.fail(
            f"no KeyboardInterrupt: the call took "
            f"{time.monotonic() - started:.1f} s, Ctrl-C fired "
            f"{(ctrl_c.fired_at or started) - started:.1f} s in with SIGINT "
            f"handled by {ctrl_c.handler!r}"
        )
    caught_at = time.monotonic()
    ctrl_c.timer.join()
    assert ctrl_c.fired_at is not None
    assert caught_at - ctrl_c.fired_at < within
    frames = [entry.name for entry in info.traceback]
    # The traceback holds the call's frames, and with them Keras's iterator
    # of the stage: end it now rather than in a later test's collection.
    del info
    gc.collect()
    return frames


def _check_interrupt_origin(frames, timeout):
    # With a timeout the signal interrupts the main thread's wait for the
    # step; without one it lands once the step, run by that thread, returns.
    waited = "_call_with_timeout" in frames
    assert waited == (timeout is not None), frames


@pytest.mark.timeout(90)
@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_ctrl_c_during_fit_ends_promptly_and_the_model_fits_again(timeout):
    model = _model(name="intr", timeout=timeout)
    spy = _BatchSpy()
    ctrl_c = _CtrlCAfter("train")
    before = stage_threads()

    frames = _interrupted(
        lambda: model.fit(
            _slow_after(ctrl_c.go),
            verbose=0,
            shuffle=False,
            callbacks=[spy, ctrl_c],
        ),
        ctrl_c,
    )
    _check_interrupt_origin(frames, timeout)
    if timeout is not None:
        assert spy.threads == {"keras_stage-intr_train"}
    assert stage_threads() == before
    # The step that was running when Ctrl-C came either finished before
    # the call ended or never applied (no thread is left to apply it).
    finished = spy.batches["train"]
    assert finished == INTERRUPT_AFTER_BATCH + 1
    steps = int(model.optimizer.iterations.numpy())
    assert finished <= steps <= finished + 1

    _fits_again(model)
    assert stage_threads() == before


# Fit is interrupted with and without the timeout's helper thread; evaluate
# with it and predict without it, the other way round in `make test-long`.
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "timeout",
    [
        TIMEOUTS[0],
        pytest.param(None, id="main_thread", marks=pytest.mark.long),
    ],
)
def test_ctrl_c_during_evaluate_ends_promptly(timeout):
    model = _model(name="intr", timeout=timeout)
    ctrl_c = _CtrlCAfter("test")
    before = stage_threads()

    frames = _interrupted(
        lambda: model.evaluate(
            _slow_after(ctrl_c.go),
            verbose=0,
            callbacks=[ctrl_c],
        ),
        ctrl_c,
    )
    _check_interrupt_origin(frames, timeout)
    assert stage_threads() == before
    _fits_again(model)
    assert stage_threads() == before


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "timeout",
    [
        pytest.param(
            DEFAULT_TIMEOUT, id="helper_thread", marks=pytest.mark.long
        ),
        TIMEOUTS[1],
    ],
)
def test_ctrl_c_during_predict_ends_promptly(timeout):
    model = _model(name="intr", timeout=timeout)
    ctrl_c = _CtrlCAfter("predict")
    before = stage_threads()
    inputs_only = _slow_after(ctrl_c.go).map(lambda x, y: x)

    frames = _interrupted(
        lambda: model.predict(inputs_only, verbose=0, callbacks=[ctrl_c]),
        ctrl_c,
    )
    _check_interrupt_origin(frames, timeout)
    assert stage_threads() == before
    _fits_again(model)
    assert stage_threads() == before


@pytest.mark.timeout(60)
def test_ctrl_c_while_iterating_a_stage_leaves_it_usable():
    # Iterated eagerly, a staged dataset keeps one runner across loops: the
    # loop after an interrupted one needs a fresh helper thread while the
    # abandoned fetch still runs.
    go = threading.Event()
    staged = keras_stage.data.stage(
        _slow_after(go), capacity=1, num_threads=1, name="loop"
    )
    before = stage_threads()
    fired_at = []

    def ctrl_c():
        fired_at.append(time.monotonic())
        _thread.interrupt_main()

    timer = threading.Timer(INTERRUPT_DELAY, ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(staged):
            if i == INTERRUPT_AFTER_BATCH:
                # The next fetch blocks until `go`, set below.
                timer.start()
    caught_at = time.monotonic()
    timer.join()
    # The wait ended within its poll, long before the blocked fetch (held
    # for 30 s by `go`): the bound leaves a loaded machine room.
    assert caught_at - fired_at[0] < 10.0
    assert {t.name for t in stage_threads() - before} == {"keras_stage-loop"}

    again = iter(staged)
    np.testing.assert_array_equal(next(again)[1], np.ones((4, 1)))
    # While the abandoned fetch is blocked, closing says a thread is left.
    assert staged.close(timeout=0.2) is False
    # Deleting a tf.data iterator waits for the elements it is making.
    go.set()
    del again
    # The abandoned fetch ends once its batch is made.
    assert staged.close() is True
    assert stage_threads() == before
    gc.collect()  # ends the interrupted loop's iterator here


# How long a staged call waits at its end for a step it abandoned (the
# `timeout` of `PrefetchCallback.close`).
CLOSE_SECONDS = 5.0


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_hung_step_leaves_the_model_usable():
    # The source hangs, so the interrupted step cannot finish: the call
    # ends after waiting `CLOSE_SECONDS` for it and leaves its thread
    # behind, and the next fit must not wait for that step.
    model = _model(name="hung")
    ctrl_c = _CtrlCAfter("train")
    hung = threading.Event()  # never set: the batches after 2 hang
    before = stage_threads()

    frames = _interrupted(
        lambda: model.fit(
            _slow_after(hung), verbose=0, shuffle=False, callbacks=[ctrl_c]
        ),
        ctrl_c,
        within=CLOSE_SECONDS + PROMPT_SECONDS,
    )
    _check_interrupt_origin(frames, DEFAULT_TIMEOUT)
    assert {t.name for t in stage_threads() - before} == {
        "keras_stage-hung_train"
    }
    # The source answers again a while later: long after the fit below
    # ends, even on a loaded machine, unless that fit waits for the hung
    # step (then it ends only once the source answers, and fails below).
    # Before the hung batch's own `go.wait(30)` would give up, though, or
    # a fit that waited for it would end with `hung` still unset.
    release = threading.Timer(15.0, hung.set)
    release.start()
    try:
        history = model.fit(X, Y, batch_size=4, epochs=2, verbose=0).history
        finished_while_hung = not hung.is_set()
    finally:
        release.cancel()
        hung.set()
        # Whatever happened, no thread is left for the next test.
        deadline = time.monotonic() + SLOW_BATCH_SECONDS + CLOSE_SECONDS
        while stage_threads() != before and time.monotonic() < deadline:
            time.sleep(0.1)
    assert stage_threads() == before
    assert len(history["loss"]) == 2
    assert finished_while_hung


# -- user callbacks that raise ----------------------------------------------


def _raising_in(hook):
    """A callback raising in `hook`: its first call, or second batch."""
    at = 2 if hook.endswith("batch_end") else 1

    def maybe_raise(self, *args, **kwargs):
        self.calls += 1
        if self.calls == at:
            raise RuntimeError(f"user callback failed in {hook}")

    cls = type(
        f"RaiseIn_{hook}", (keras.callbacks.Callback,), {hook: maybe_raise}
    )
    callback = cls()
    callback.calls = 0
    return callback


# on_train_batch_end, and evaluate's/predict's batch ends, are covered in
# tests/models/call/staged_call_test.py.
# `make test` raises before the first epoch, between epochs and during
# validation; the other hooks run in `make test-long`.
HOOKS = [
    "on_train_begin",
    pytest.param("on_epoch_begin", marks=pytest.mark.long),
    "on_epoch_end",
    pytest.param("on_test_begin", marks=pytest.mark.long),
    "on_test_batch_end",
    pytest.param("on_test_end", marks=pytest.mark.long),
    pytest.param("on_train_end", marks=pytest.mark.long),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hook", HOOKS)
def test_callback_raising_in_fit_ends_cleanly_and_the_model_fits_again(hook):
    model = _model(name="cb")
    spy = _BatchSpy()
    prefetch = PrefetchCallback()
    before = stage_threads()

    with pytest.raises(RuntimeError, match=f"user callback failed in {hook}"):
        model.fit(
            X,
            Y,
            batch_size=4,
            epochs=2,
            verbose=0,
            validation_data=(X, Y),
            callbacks=[spy, _raising_in(hook), prefetch],
        )
    if hook in ("on_test_batch_end", "on_test_end", "on_train_end"):
        # The validation stage ran its steps on its own helper thread.
        assert spy.threads == {"keras_stage-cb_train", "keras_stage-cb_val"}
    assert stage_threads() == before

    # The same model and PrefetchCallback work again.
    _fits_again(model, callbacks=[prefetch])
    assert prefetch.verdict["epoch"] == 1
    assert stage_threads() == before


# -- soak -------------------------------------------------------------------

SOAK_CYCLES = 200
WARM_UP_CYCLES = 20
# Growth allowed from the end of the warm-up to the end of the soak. A
# stage kept alive with its iterator per cycle costs about 6 OS threads and
# 4.7 MB of RSS here, so each bound catches a leak within a few cycles; TF
# may park a worker or two, and the allocator keeps some slack.
MAX_EXTRA_PY_THREADS = 0
MAX_EXTRA_OS_THREADS = 4
MAX_EXTRA_FDS = 4
MAX_EXTRA_RSS_MB = 16.0
# Each cycle builds its pipelines (and Keras its datasets): some 2,000
# objects in reference cycles, which Python's full collections free only
# once they reach a share of the process's long-lived objects. The heap
# grows meanwhile and keeps its size after the collection (24 MB over the
# 200 cycles when run alone, 18 MB in the whole suite, with no object
# kept: a leak-free process), so the soak collects every few cycles and the
# bound measures what the cycles keep, not when the collector ran.
COLLECT_EVERY_CYCLES = 10
SOAK_X = X[:8]
SOAK_Y = Y[:8]


def _soak_cycle(model):
    # Two batches each.
    model.fit(SOAK_X, SOAK_Y, batch_size=4, epochs=1, verbose=0)
    model.evaluate(SOAK_X, SOAK_Y, batch_size=4, verbose=0)
    model.predict(SOAK_X, batch_size=4, verbose=0)


def _resources():
    gc.collect()
    process = psutil.Process()
    return {
        "python_threads": threading.active_count(),
        "os_threads": process.num_threads(),
        "fds": process.num_fds(),
        "rss_mb": process.memory_info().rss / 2**20,
    }


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(240)
def test_soak_200_cycles_on_one_model_grow_nothing():
    model = _model(name="soak")
    spy = _BatchSpy()
    model.fit(SOAK_X, SOAK_Y, batch_size=4, verbose=0, callbacks=[spy])
    # The stage did run its helper thread, so the thread counts mean
    # something.
    assert spy.threads == {"keras_stage-soak_train"}
    # TF starts its pools and traces the steps on first use.
    for _ in range(WARM_UP_CYCLES):
        _soak_cycle(model)
    start = _resources()
    started = time.monotonic()
    for cycle in range(SOAK_CYCLES):
        _soak_cycle(model)
        if cycle % COLLECT_EVERY_CYCLES == 0:
            gc.collect()
    seconds = time.monotonic() - started
    end = _resources()

    print(
        f"\nsoak: {SOAK_CYCLES} fit/evaluate/predict cycles in {seconds:.1f} s"
        f" ({seconds / SOAK_CYCLES:.3f} s per cycle)"
    )
    for key in start:
        print(f"soak: {key}: start {start[key]:.1f}, end {end[key]:.1f}")
    assert int(model.optimizer.iterations.numpy()) == 2 * (
        1 + WARM_UP_CYCLES + SOAK_CYCLES
    )
    assert stage_threads() == set()
    limits = {
        "python_threads": MAX_EXTRA_PY_THREADS,
        "os_threads": MAX_EXTRA_OS_THREADS,
        "fds": MAX_EXTRA_FDS,
        "rss_mb": MAX_EXTRA_RSS_MB,
    }
    for key, limit in limits.items():
        assert end[key] <= start[key] + limit, (
            f"{key} went from {start[key]:.1f} to {end[key]:.1f} over "
            f"{SOAK_CYCLES} cycles (allowed growth: {limit})"
        )
