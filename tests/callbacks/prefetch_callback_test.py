"""`PrefetchCallback`: the stage's epoch logs and the bottleneck verdict.

End to end, the logs are present and in range every epoch, and a source
slower than the training step shows as a high wait ratio and an
"input-bound" verdict, a trunk slower than the source as "compute-bound".
The pure functions behind them are checked on hand-made snapshots. A model
with no stage gets one warning naming the fix, and a call its model runs
unstaged none.
"""

import copy
import logging
import re
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.callbacks import PrefetchCallback
from keras_stage.callbacks.prefetch_callback import epoch_statistics, verdict
from keras_stage.data import StageOptions
from keras_stage.layers import StagedInput
from tests.helpers import printed_in_forked_python, tensorboard_scalars

SLEEP_SECONDS = 0.03
# Enough batches that one scheduling stall of a loaded machine cannot
# swamp an epoch's wait ratio.
NUM_BATCHES = 24


def _sleep_then_return(x):
    time.sleep(SLEEP_SECONDS)
    return x


def _sleepy(x):
    y = tf.py_function(_sleep_then_return, [x], tf.float32)
    return tf.ensure_shape(y, x.shape)


def _dataset(slow_source=False):
    x = np.ones((NUM_BATCHES * 4, 2), "float32")
    y = np.ones((NUM_BATCHES * 4, 1), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    if slow_source:
        # Preprocessing before the stage: 30 ms per batch.
        dataset = dataset.map(lambda a, b: (_sleepy(a), b))
    return dataset


class SlowLayer(keras.layers.Layer):
    """A trunk layer that takes 30 ms per batch."""

    def call(self, x):
        return _sleepy(x)


def _model(slow_trunk=False, name="bench", **staged_input):
    inputs = keras.Input(shape=(2,))
    x = StagedInput(capacity=1, num_threads=1, name=name, **staged_input)(
        inputs
    )
    if slow_trunk:
        x = SlowLayer()(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


# -- end to end --------------------------------------------------------------


@pytest.mark.timeout(60)
def test_stage_logs_are_present_and_in_range_every_epoch():
    model = _model()
    x = np.ones((16, 2), "float32")
    y = np.ones((16, 1), "float32")
    history = model.fit(
        x, y, batch_size=4, epochs=3, validation_split=0.25, verbose=0
    ).history

    for key in ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped"):
        assert len(history[key]) == 3, key
    for ratio in history["stage_wait_ratio"]:
        assert 0.0 <= ratio <= 1.0
    for fill in history["stage_buffer_fill"]:
        assert 0.0 <= fill <= 1.0
    for skipped in history["stage_skipped"]:
        assert isinstance(skipped, int)
        assert skipped == 0


@pytest.mark.timeout(120)
def test_slow_source_waits_more_and_is_called_input_bound(capsys):
    slow_cb = PrefetchCallback(verbose=1)
    slow = _model(name="slow_source").fit(
        _dataset(slow_source=True),
        epochs=2,
        verbose=0,
        shuffle=False,
        callbacks=[slow_cb],
    )
    slow_out = capsys.readouterr().out

    fast_cb = PrefetchCallback(verbose=1)
    fast = _model(slow_trunk=True, name="slow_trunk").fit(
        _dataset(), epochs=2, verbose=0, shuffle=False, callbacks=[fast_cb]
    )
    fast_out = capsys.readouterr().out

    # The last epoch: the first one also pays for tracing the step.
    slow_ratio = slow.history["stage_wait_ratio"][-1]
    fast_ratio = fast.history["stage_wait_ratio"][-1]
    why = f"slow: {slow.history}, {slow_cb.verdict}; fast: {fast.history}"
    assert slow_ratio > fast_ratio, why
    # The source's sleep dwarfs the tiny step on an idle machine; a loaded
    # one slows the step too, so only the verdict's threshold is assumed.
    assert slow_ratio >= 0.1, why

    # One verdict line per epoch, naming the stage.
    assert slow_out.count("Stage 'slow_source_train': input-bound") == 2
    assert fast_out.count("Stage 'slow_trunk_train': compute-bound") == 2
    assert slow_cb.verdict["input_bound"] is True
    assert fast_cb.verdict["input_bound"] is False
    # The slow part is the pipeline before the stage, and the verdict says
    # so instead of asking for more stage threads.
    assert slow_cb.verdict["source_bound"] is True
    assert "The pipeline before the stage is the bottleneck" in slow_out
    # The stage computes nothing (a StagedInput without smart_stage): the
    # source's time is all there is, and no staged computation is reported
    # as a measured 0.
    assert slow_cb.verdict["source_seconds_per_batch"] > 0
    assert slow_cb.verdict["prepare_seconds_per_batch"] is None
    assert "no staged computation (the stage only buffers)" in slow_out
    for cb in (slow_cb, fast_cb):
        assert cb.verdict["epoch"] == 1
        assert cb.verdict["suggested_num_threads"] >= 1
        assert cb.verdict["suggested_capacity"] >= 1
        assert cb.verdict["message"] in (slow_out + fast_out)
    assert slow_cb.verdict["wait_ratio"] == slow_ratio


class SlowGradient(keras.layers.Layer):
    """Identity forward; its gradient takes 30 ms per batch."""

    def call(self, x):
        @tf.custom_gradient
        def identity(t):
            return tf.identity(t), _sleepy

        return identity(x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["backward", "callbacks"])
def test_time_outside_the_fetch_is_not_waiting(where):
    # A step's outputs (its loss and metrics) are ready before its backward
    # pass ends, and Keras runs the callbacks between steps: with a source
    # that keeps up, neither may count as waiting for input.
    inputs = keras.Input(shape=(2,))
    x = StagedInput(capacity=2, num_threads=1, name=f"slow_{where}")(inputs)
    if where == "backward":
        x = SlowGradient()(keras.layers.Dense(2)(x))
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    callbacks = [PrefetchCallback()]
    if where == "callbacks":
        callbacks.append(
            keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: time.sleep(0.03)
            )
        )
    history = model.fit(
        _dataset(), epochs=2, verbose=0, shuffle=False, callbacks=callbacks
    ).history
    assert history["stage_wait_ratio"][-1] < 0.1, history
    assert callbacks[0].verdict["input_bound"] is False


@pytest.mark.timeout(120)
def test_the_first_epoch_leaves_out_the_first_step_which_traces():
    # The first step of a fit traces the step function (often a second or
    # more); a 2 s pause in that step's window stands in for it. Without
    # leaving it out, the epoch's 24 steps would average over 80 ms each,
    # the verdict calling a millisecond step slow and the wait ratio wrong.
    pause = 2.0

    def trace_like(batch, logs):
        if batch == 0 and not paused:
            paused.append(batch)
            time.sleep(pause)

    paused = []
    callback = PrefetchCallback()
    history = (
        _model(name="first_step")
        .fit(
            _dataset(),
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[
                callback,
                keras.callbacks.LambdaCallback(on_train_batch_begin=trace_like),
            ],
        )
        .history
    )
    assert paused == [0]
    per_batch = callback.verdict["train_seconds_per_batch"]
    assert per_batch < pause / NUM_BATCHES, callback.verdict
    assert 0.0 <= history["stage_wait_ratio"][0] <= 1.0
    assert history["stage_skipped"] == [0]


def test_it_leaves_keras_free_to_dispatch_batch_ends_asynchronously():
    # Keras (on JAX) runs the callbacks' batch ends off the training loop's
    # thread only if no callback overrides one; one that does makes every
    # step wait for its logs before the next is dispatched.
    for hook in (
        "on_batch_end",
        "on_train_batch_end",
        "on_test_batch_end",
        "on_predict_batch_end",
    ):
        assert getattr(PrefetchCallback, hook) is getattr(
            keras.callbacks.Callback, hook
        ), hook


@pytest.mark.timeout(60)
@pytest.mark.parametrize("given_bar", [False, True])
def test_the_verdict_prints_on_its_own_line_after_the_progress_line(
    capsys, given_bar
):
    # As Keras's own callbacks print: never inside the epoch's progress
    # line, here with a progress bar Keras adds or one the user passes.
    callbacks = [PrefetchCallback(verbose=1)]
    if given_bar:
        callbacks.append(keras.callbacks.ProgbarLogger())
    _model(name="console").fit(
        _dataset(), epochs=2, verbose=1, shuffle=False, callbacks=callbacks
    )
    lines = capsys.readouterr().out.splitlines()
    verdicts = [
        i for i, line in enumerate(lines) if "Stage 'console_train'" in line
    ]
    assert len(verdicts) == 2, lines
    for i in verdicts:
        assert lines[i].startswith("Stage 'console_train': "), lines[i]
        # The line before is the epoch's finished progress line.
        assert "step" in lines[i - 1] and "loss" in lines[i - 1], lines
    assert lines[0] == "Epoch 1/2", lines


@pytest.mark.timeout(60)
def test_verbose_0_prints_nothing_and_logs_the_verdict_at_debug(capsys, caplog):
    cb = PrefetchCallback()
    with caplog.at_level(logging.DEBUG, logger="keras_stage"):
        _model(name="quiet").fit(
            _dataset(), epochs=2, verbose=0, shuffle=False, callbacks=[cb]
        )
    assert capsys.readouterr().out == ""
    verdicts = [
        r
        for r in caplog.records
        if r.name == "keras_stage" and "Stage 'quiet_train'" in r.getMessage()
    ]
    assert len(verdicts) == 2
    assert all(r.levelno == logging.DEBUG for r in verdicts)
    assert verdicts[-1].getMessage() == cb.verdict["message"]


def test_callback_survives_deepcopy_before_and_after_a_fit():
    # keras-tuner deep-copies callbacks; no lock or thread may live in one.
    cb = PrefetchCallback(verbose=1)
    clone = copy.deepcopy(cb)
    assert clone.verbose == 1
    assert clone.verdict is None

    model = _model(name="copied")
    model.fit(_dataset(), epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    cb.set_model(None)  # Keras leaves the model on the callback
    clone = copy.deepcopy(cb)
    assert clone.verdict == cb.verdict


def _warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "keras_stage" and r.levelno >= logging.WARNING
    ]


@pytest.mark.timeout(120)
def test_callback_on_a_plain_model_reports_nothing_and_warns_once(caplog):
    inputs = keras.Input(shape=(2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs), name="plain")
    model.compile(optimizer="sgd", loss="mse")
    cb = PrefetchCallback(verbose=1)
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        history = model.fit(
            _dataset(), epochs=1, verbose=0, shuffle=False, callbacks=[cb]
        ).history
        model.fit(
            _dataset(),
            epochs=1,
            verbose=0,
            shuffle=False,
            validation_data=_dataset(),
            callbacks=[cb],
        )
    assert "stage_wait_ratio" not in history
    assert cb.verdict is None
    assert _warnings(caplog) == [
        "PrefetchCallback has no stage to report: model 'plain' is a plain "
        "Keras `Functional`, which runs none. Build it with "
        "`keras_stage.Model` or `keras_stage.Sequential`, with a "
        "`keras_stage.layers.StagedInput` right after its inputs (or "
        "compiled with `smart_stage=True`)."
    ]


@pytest.mark.timeout(120)
def test_callback_on_a_keras_stage_model_without_a_stage_warns_once(caplog):
    inputs = keras.Input(shape=(2,))
    model = keras_stage.Model(
        inputs, keras.layers.Dense(1)(inputs), name="stageless"
    )
    model.compile(optimizer="sgd", loss="mse")
    cb = PrefetchCallback(verbose=1)
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        model.fit(
            _dataset(), epochs=2, verbose=0, shuffle=False, callbacks=[cb]
        )
        model.evaluate(_dataset(), verbose=0, callbacks=[cb])
        assert len(_warnings(caplog)) == 1
        # Once per callback: another one says it again, from predict too.
        model.predict(_dataset(), verbose=0, callbacks=[PrefetchCallback()])
    expected = (
        "PrefetchCallback has no stage to report: model 'stageless' has no "
        "`keras_stage.layers.StagedInput` among its layers and is compiled "
        "without `smart_stage`, so it trains like a plain Keras model. Put "
        "a `StagedInput` right after its inputs, or compile it with "
        "`smart_stage=True`."
    )
    assert _warnings(caplog) == [expected, expected]
    assert cb.verdict is None


@pytest.mark.timeout(120)
def test_callback_on_a_plain_model_with_a_staged_input_warns_once(caplog):
    # The callback and the layer's training call both see the mistake; the
    # user reads it once.
    inputs = keras.Input(shape=(2,))
    x = StagedInput(name="reader")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(x), name="plain")
    model.compile(optimizer="sgd", loss="mse")
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        for _ in range(2):
            model.fit(
                _dataset(),
                epochs=2,
                verbose=0,
                shuffle=False,
                callbacks=[PrefetchCallback(verbose=1)],
            )
    [message] = _warnings(caplog)
    assert message.startswith(
        "StagedInput 'reader' stages nothing: its model 'plain' is a plain "
        "Keras `Functional` (so PrefetchCallback has no stage to report)"
    )
    assert "`keras_stage.Model(inputs, outputs)`" in message


@pytest.mark.timeout(120)
@pytest.mark.first_call_rule
def test_callback_of_calls_run_unstaged_by_their_model_is_not_warned(
    caplog, capsys
):
    # Calls too short to repay their stage run unstaged, and the model logs
    # why at info level: the callback adds no warning to that. The fit's
    # epochs log the stage's keys as unstaged, and its verdict says why
    # (printed once, with the first epoch's).
    inputs = keras.Input(shape=(2,))
    x = StagedInput(name="short")(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    cb = PrefetchCallback(verbose=1)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        history = model.fit(
            x, y, batch_size=4, epochs=2, verbose=0, callbacks=[cb]
        ).history
        verdict = cb.verdict
        model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[cb])
        model.predict(x, batch_size=4, verbose=0, callbacks=[cb])
    assert caplog.text.count("runs the whole model in Keras's step") == 3
    assert _warnings(caplog) == []
    assert history["stage_unstaged"] == [1.0, 1.0]
    assert history["stage_wait_ratio"] == [0.0, 0.0]
    assert history["stage_buffer_fill"] == [0.0, 0.0]
    assert history["stage_skipped"] == [0, 0]
    assert verdict["staged"] is False and verdict["epoch"] == 1
    assert verdict["wait_ratio"] is None and verdict["input_bound"] is None
    assert "without its stage: a first call of 2 batches" in verdict["message"]
    assert verdict["call"] in verdict["message"]
    assert capsys.readouterr().out.count("without its stage") == 1


@pytest.mark.timeout(120)
def free_iterators(monkeypatch):
    """Makes a stage's new iterator cost nothing: the verdict's shrink pays.

    (`PrefetchCallback` keeps a pool whose shrink the rest of the fit cannot
    repay: see `test_a_shrink_the_fit_cannot_repay_keeps_the_pool`.)
    """
    from keras_stage.models.call import measure

    monkeypatch.setattr(measure, "iterator_cost", lambda model, phase: 0.0)


def test_auto_pool_follows_the_verdict_across_epochs_and_fits(
    capsys, monkeypatch
):
    # StagedInput() leaves threads and pool to keras_stage: a compute-bound
    # epoch shrinks the pool to the threads its verdict asks for (one: the
    # staged Rescaling takes far less than the 30 ms step), an input-bound
    # one gives it its full size back, and the size carries over to the
    # next fit of the model.
    free_iterators(monkeypatch)
    inputs = keras.Input(shape=(2,))
    x = StagedInput(name="adaptive")(inputs)
    x = keras.layers.Rescaling(2.0)(x)  # staged: the stage has work
    x = SlowLayer()(keras.layers.Dense(2)(x))
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    options = StageOptions()
    largest = options.resolved_pool_size()

    cb = PrefetchCallback(verbose=1)
    model.fit(_dataset(), epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    out = capsys.readouterr().out
    assert cb.verdict["input_bound"] is False, cb.verdict
    assert cb.verdict["suggested_num_threads"] == 1, cb.verdict
    assert cb.verdict["thread_pool_size"] == 1, cb.verdict
    assert cb.verdict["next_thread_pool_size"] == 1
    assert out.count(f"Its thread pool goes from {largest} to 1 threads") == 1

    # A source twice as slow as the trunk keeps the step waiting.
    slower = _dataset(slow_source=True).map(lambda a, b: (_sleepy(a), b))
    cb = PrefetchCallback()
    model.fit(
        slower,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[cb],
    )
    assert cb.verdict["input_bound"] is True, cb.verdict
    assert cb.verdict["thread_pool_size"] == 1
    assert cb.verdict["next_thread_pool_size"] == largest


class ThreadRecorder(keras.layers.Layer):
    """A staged layer noting its traces and the threads that run it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.traces = 0
        self.threads = []

    def _record(self, x):
        self.threads.append(threading.get_native_id())
        return x

    def call(self, x):
        self.traces += 1  # once per trace of the staged layers
        y = tf.py_function(self._record, [x], tf.float32)
        return tf.ensure_shape(y, x.shape)


@pytest.mark.timeout(120)
def test_a_fit_epoch_runs_on_the_pool_its_verdict_sized(monkeypatch):
    # One core: a compute-bound epoch shrinks the pool to one thread, and
    # Keras's next epoch iterator runs on a pipeline built for that size.
    monkeypatch.setattr(keras_stage.data.options, "usable_cpus", lambda: 1)
    free_iterators(monkeypatch)
    inputs = keras.Input(shape=(2,))
    x = StagedInput(name="resized_fit")(inputs)
    recorder = ThreadRecorder()
    x = SlowLayer()(keras.layers.Dense(2)(recorder(x)))
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)

    class Epochs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.marks = []

        def on_epoch_end(self, epoch, logs=None):
            self.marks.append((len(recorder.threads), recorder.traces))

    epochs = Epochs()
    cb = PrefetchCallback()
    model.fit(
        _dataset(),
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=[cb, epochs],
    )
    assert cb.verdict["thread_pool_size"] == 1, cb.verdict
    (first, traces), (second, _), (third, last_traces) = epochs.marks
    # The 1-thread pipeline, built for the second epoch, reuses the staged
    # layers' trace (kept on the model's split) instead of tracing again.
    assert last_traces == traces, epochs.marks
    assert len(set(recorder.threads[first:second])) == 1
    assert len(set(recorder.threads[second:third])) == 1


def test_a_shrink_the_fit_cannot_repay_keeps_the_pool(capsys):
    # The staged Rescaling's work in the batches left is far less than a
    # new iterator of the stage costs (measured as the first was made): the
    # pool keeps its size for the fit's next epochs, on the same iterator,
    # and shrinks after the last, for the next call. After the iterator's
    # first epoch, whose figure holds the stage's start, it waits for the
    # next epoch's figure.
    inputs = keras.Input(shape=(2,))
    x = StagedInput(name="kept_pool")(inputs)
    x = keras.layers.Rescaling(2.0)(x)
    x = SlowLayer()(keras.layers.Dense(2)(x))
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    largest = StageOptions().resolved_pool_size()
    cb = PrefetchCallback(verbose=1)
    model.fit(_dataset(), epochs=3, verbose=0, shuffle=False, callbacks=[cb])
    out = capsys.readouterr().out
    assert cb.verdict["input_bound"] is False, cb.verdict
    assert out.count(f"Its thread pool stays at {largest} threads") == 2
    assert out.count("an iterator's first epoch includes its start") == 1
    assert out.count("a new iterator of the stage costs") == 1
    # The last epoch ran on the pool the first did; the next call's gets 1.
    assert cb.verdict["thread_pool_size"] == largest, cb.verdict
    assert cb.verdict["next_thread_pool_size"] == 1
    assert out.count(f"Its thread pool goes from {largest} to 1 threads") == 1


class _Binding:
    """What `PrefetchCallback._shrink_cannot_pay` reads of a stage's binding."""

    def __init__(self, cost, carried=False):
        self.iterator_cost = lambda: cost
        self.carried = carried
        self.epochs_begun = 0
        self.least_prepare = None


@pytest.mark.parametrize("carried", [False, True])
def test_a_shrink_weighs_the_least_work_an_epoch_measured(carried):
    # 10 epochs of 10 batches; a new iterator costs 100 ms. Per batch the
    # epochs measure 2 ms (the first, holding the stage's start), 0.5 ms,
    # then 1.5 ms (threads contending): the least, 0.5 ms, decides.
    cb = PrefetchCallback()
    cb.set_params({"epochs": 10, "steps": 10})
    binding = _Binding(cost=0.1, carried=carried)
    reasons = []
    for epoch, prepare in enumerate((0.002, 0.0005, 0.0015)):
        binding.epochs_begun += 1
        cb.verdict = {"prepare_seconds_per_batch": prepare}
        reasons.append(cb._shrink_cannot_pay(epoch, binding))
    first, second, third = reasons
    if carried:
        # An iterator an earlier call left starts nothing in this epoch.
        assert first is None
    else:
        assert "an iterator's first epoch includes its start" in first
    assert "hold at most 40.0 ms of staged work" in second, second
    assert "hold at most 35.0 ms of staged work" in third, third
    assert "the 100.0 ms a new iterator of the stage costs" in third
    # A new iterator that costs nothing (the next epoch makes one anyway).
    binding = _Binding(cost=0.0)
    binding.epochs_begun = 1
    assert cb._shrink_cannot_pay(0, binding) is None


# -- epoch_statistics ----------------------------------------------------------


def _snapshot(**counters):
    snapshot = dict(
        produced=0,
        consumed=0,
        skipped=0,
        skipped_messages=[],
        wait_seconds=0.0,
        busy_seconds=0.0,
        buffered_sum=0,
        buffered_peak=0,
        time=0.0,
    )
    snapshot.update(counters)
    return snapshot


BEFORE = _snapshot(
    produced=10,
    consumed=8,
    skipped=1,
    wait_seconds=1.0,
    busy_seconds=2.0,
    buffered_sum=10,
    buffered_peak=2,
)
AFTER = _snapshot(
    produced=30,
    consumed=28,
    skipped=3,
    wait_seconds=3.0,
    busy_seconds=6.0,
    buffered_sum=50,
    buffered_peak=4,
)


def test_epoch_statistics_are_the_differences_of_two_snapshots():
    options = StageOptions(capacity=4, num_threads=2, name="s")
    stats = epoch_statistics(BEFORE, AFTER, 8.0, options)
    assert stats == {
        "consumed": 20,
        "produced": 20,
        "skipped": 2,
        "seconds": 8.0,
        "wait_seconds": 2.0,
        "busy_seconds": 4.0,
        "wait_ratio": 0.25,  # 2 s waited of 8 s
        "cpu_load": None,  # the snapshots have no process CPU time
        "buffer_fill": 0.5,  # 40 buffered over 20 fetches of 4 slots
    }


def test_epoch_statistics_measure_the_cores_the_process_used(monkeypatch):
    from keras_stage.callbacks import prefetch_callback

    monkeypatch.setattr(prefetch_callback, "usable_cpus", lambda: 2)
    options = StageOptions(capacity=4, name="s")
    before = dict(BEFORE, process_cpu_seconds=10.0)
    after = dict(AFTER, process_cpu_seconds=14.0)
    # 4 CPU seconds over an 8 s epoch on 2 cores: a quarter of them.
    stats = epoch_statistics(before, after, 8.0, options)
    assert stats["cpu_load"] == 0.25
    assert verdict(stats, options)["cores_busy"] is False
    busy = dict(AFTER, process_cpu_seconds=24.0)  # 14 of 16 CPU seconds
    stats = epoch_statistics(before, busy, 8.0, options)
    assert stats["cpu_load"] == 0.875
    assert verdict(stats, options)["cores_busy"] is True


def test_epoch_statistics_scale_an_auto_buffer_by_its_peak_fill():
    options = StageOptions(capacity="auto", name="s")
    stats = epoch_statistics(BEFORE, AFTER, 8.0, options)
    assert stats["buffer_fill"] == 0.5  # peak 4 stands in for capacity

    never_filled = dict(AFTER, buffered_peak=0)
    stats = epoch_statistics(BEFORE, never_filled, 8.0, options)
    assert stats["buffer_fill"] == 1.0  # 40 / (20 * 1), clipped to 1


def test_epoch_statistics_of_an_empty_or_instant_epoch():
    options = StageOptions(capacity=4, name="s")
    stats = epoch_statistics(AFTER, AFTER, 5.0, options)
    assert stats["consumed"] == 0
    assert stats["buffer_fill"] == 0.0
    assert stats["wait_ratio"] == 0.0

    stats = epoch_statistics(BEFORE, AFTER, 0.0, options)
    assert stats["seconds"] == 1e-9
    assert stats["wait_ratio"] == 1.0  # clipped


# -- verdict -------------------------------------------------------------------


def _stats(**overrides):
    stats = dict(
        consumed=20,
        produced=20,
        skipped=0,
        seconds=8.0,
        wait_seconds=2.0,
        busy_seconds=16.0,
        wait_ratio=0.25,
        buffer_fill=0.5,
    )
    stats.update(overrides)
    return stats


def test_verdict_of_an_epoch_bound_by_the_staged_computation():
    options = StageOptions(capacity=4, num_threads=2, name="s")
    result = verdict(_stats(), options)
    # Per batch: staged computation 16 s / 20 = 0.8 s (0.4 s with 2
    # threads), delivered every 8 s / 20 = 0.4 s: the threads set the pace.
    # Training (8 - 2) s / 20 = 0.3 s; threads ceil(1.25 * 0.8 / 0.3) = 4
    # (a 25% margin); capacity ceil(6 / 2) = 3.
    assert result == {
        "input_bound": True,
        "source_bound": False,
        "wait_ratio": 0.25,
        "buffer_fill": 0.5,
        "source_seconds_per_batch": None,
        "delivery_seconds_per_batch": 0.4,
        "prepare_seconds_per_batch": 0.8,
        "train_seconds_per_batch": pytest.approx(0.3),
        "suggested_num_threads": 4,
        "suggested_capacity": 3,
        "thread_pool_size": None,
        # Not measured in these statistics: counted as busy.
        "cpu_load": None,
        "cores_busy": True,
        "message": (
            "Stage 's': input-bound, the training step waited 25% of the "
            "epoch for data; per batch: 800.0 ms of staged computation (per "
            "thread), 300.0 ms to train; the stage delivered one every 400.0 "
            "ms. Use num_threads >= 4 (now 2) and capacity ~3 (now 4)."
        ),
    }


def test_verdict_figures_below_a_millisecond_show_in_microseconds():
    # Per batch: 0.008 s / 20 = 400 us of staged computation, 200 us over
    # the 2 threads; printed in ms to one decimal they read as 0.0 and 0.2.
    options = StageOptions(capacity=4, num_threads=2, name="s")
    message = verdict(_stats(busy_seconds=0.008), options)["message"]
    assert "per batch: 400 us of staged computation" in message
    assert "could deliver one every 200 us" in message
    assert not re.search(r"(?<![\d.])0\.0 ms", message), message


def test_verdict_of_a_fixed_pool_names_no_pool_sizes():
    options = StageOptions(capacity=4, num_threads=2, name="s")
    result = verdict(_stats(busy_seconds=4.0), options)
    assert result["thread_pool_size"] is None
    # The pool the epoch ran on counts as the stage's threads.
    adaptive = StageOptions(name="a")
    pooled = verdict(_stats(busy_seconds=4.0), adaptive, pool_size=3)
    assert pooled["thread_pool_size"] == 3
    assert "its 3 threads could deliver" in pooled["message"]


def test_verdict_of_an_epoch_bound_by_the_pipeline_before_the_stage():
    options = StageOptions(capacity=4, num_threads=2, name="s")
    # Staged computation 4 s / 20 = 0.2 s per batch, 0.1 s over 2 threads,
    # but a batch came every 8 s / 20 = 0.4 s: the source set the pace.
    result = verdict(_stats(busy_seconds=4.0), options)
    assert result["input_bound"] is True
    assert result["source_bound"] is True
    assert result["source_seconds_per_batch"] == 0.4
    assert result["delivery_seconds_per_batch"] == 0.4
    assert result["message"] == (
        "Stage 's': input-bound, the training step waited 25% of the epoch "
        "for data; per batch: 200.0 ms of staged computation (per thread), "
        "300.0 ms to train; the stage delivered one every 400.0 ms. The "
        "pipeline before the stage is the bottleneck (the stage pulls from "
        "it one batch at a time, and its 2 threads could deliver one every "
        "100.0 ms): parallelize its maps (num_parallel_calls) and reads "
        "(interleave), or make that work the stage's own computation so the "
        "stage's threads run it: as layers of the model with "
        "compile(smart_stage=True), or as the `fn` of keras_stage.data.stage."
    )
    # Delivered 1.5x slower than the threads compute counts as the source's
    # fault; less is the threads' (their own overhead, contention).
    at_factor = verdict(_stats(busy_seconds=32.0 / 3.0), options)
    assert at_factor["source_bound"] is True
    below = verdict(_stats(busy_seconds=11.0), options)
    assert below["source_bound"] is False


def test_verdict_of_a_compute_bound_epoch():
    options = StageOptions(capacity="auto", num_threads="auto", name="s")
    result = verdict(
        _stats(
            wait_seconds=0.0,
            wait_ratio=0.0,
            busy_seconds=1.0,
        ),
        options,
    )
    # Staged computation 1 s / 20 = 50 ms, training 8 s / 20 = 400 ms per
    # batch.
    assert result["input_bound"] is False
    assert result["source_bound"] is False
    assert result["suggested_num_threads"] == 1
    # Nothing waited: the smallest buffer, one batch taken, one waiting.
    assert result["suggested_capacity"] == 2
    assert result["message"] == (
        "Stage 's': compute-bound, the training step waited 0% of the epoch "
        "for data; per batch: 50.0 ms of staged computation (per thread), "
        "400.0 ms to train; the stage delivered one every 400.0 ms. The "
        "input keeps up; num_threads=1 would be enough (now auto)."
    )


def test_compute_bound_verdict_ignores_a_slow_source():
    # A slow source does not matter while the training step never waits.
    options = StageOptions(capacity=4, num_threads=2, name="s")
    result = verdict(
        _stats(wait_seconds=0.0, wait_ratio=0.0, busy_seconds=1.0),
        options,
    )
    assert result["input_bound"] is False
    assert result["source_bound"] is False
    assert result["source_seconds_per_batch"] is None
    assert "compute-bound" in result["message"]


def test_verdict_threshold_and_capacity_cap():
    options = StageOptions(capacity=4, num_threads=2, name="s")
    # Exactly 10% waiting is input-bound.
    assert verdict(_stats(wait_ratio=0.1), options)["input_bound"] is True
    assert verdict(_stats(wait_ratio=0.099), options)["input_bound"] is False
    # ceil(89 / 11) = 9 for an input-bound epoch.
    ruled = verdict(
        _stats(seconds=100.0, wait_seconds=11.0, wait_ratio=0.11), options
    )
    assert ruled["suggested_capacity"] == 9
    # ceil(199.5 / 0.5) = 399 is capped at 64 (wait_ratio as given).
    capped = verdict(
        _stats(seconds=200.0, wait_seconds=0.5, wait_ratio=0.1), options
    )
    assert capped["suggested_capacity"] == 64
    # Compute-bound: compute / wait (199 here) is no guide; the minimum.
    kept_up = verdict(
        _stats(seconds=100.0, wait_seconds=0.5, wait_ratio=0.005), options
    )
    assert kept_up["suggested_capacity"] == 2
    # ceil(8 / 16) = 1 is raised to 2.
    floored = verdict(_stats(seconds=24.0, wait_seconds=16.0), options)
    assert floored["suggested_capacity"] == 2
    # Threads: preparation exactly 4x the training time gets a 25% margin.
    margin = verdict(_stats(busy_seconds=24.0), options)
    assert margin["suggested_num_threads"] == 5


def test_verdict_of_an_epoch_without_batches():
    options = StageOptions(capacity=4, num_threads=2, name="s")
    result = verdict(
        _stats(
            consumed=0,
            produced=0,
            seconds=1e-9,
            wait_seconds=0.0,
            busy_seconds=0.0,
            wait_ratio=0.0,
        ),
        options,
    )
    assert result["suggested_num_threads"] == 1
    assert result["suggested_capacity"] == 2
    assert result["input_bound"] is False
    assert "compute-bound" in result["message"]


def test_a_stage_that_only_buffers_reports_no_staged_computation():
    # No `fn` and no SmartStage prefix: the stage times nothing, and its
    # epoch's busy seconds are 0. The verdict says why there is no figure
    # instead of printing "0 us of staged computation".
    options = StageOptions(capacity=4, num_threads=2, name="s")
    result = verdict(_stats(busy_seconds=0.0), options)
    assert result["input_bound"] is True
    assert result["source_bound"] is True
    # Every key is kept; the figure not measured is None.
    assert set(result) == set(verdict(_stats(), options))
    assert result["prepare_seconds_per_batch"] is None
    assert result["source_seconds_per_batch"] == 0.4
    assert result["message"] == (
        "Stage 's': input-bound, the training step waited 25% of the epoch "
        "for data; per batch: no staged computation (the stage only "
        "buffers), 300.0 ms to train; the stage delivered one every 400.0 "
        "ms. The pipeline before the stage is the bottleneck (the stage "
        "pulls from it one batch at a time, and it has no computation of "
        "its own for its 2 threads): parallelize its maps "
        "(num_parallel_calls) and reads (interleave), or make that work the "
        "stage's own computation so the stage's threads run it: as layers "
        "of the model with compile(smart_stage=True), or as the `fn` of "
        "keras_stage.data.stage."
    )

    kept_up = verdict(
        _stats(wait_seconds=0.0, wait_ratio=0.0, busy_seconds=0.0), options
    )
    assert kept_up["input_bound"] is False
    assert kept_up["prepare_seconds_per_batch"] is None
    assert kept_up["message"] == (
        "Stage 's': compute-bound, the training step waited 0% of the epoch "
        "for data; per batch: no staged computation (the stage only "
        "buffers), 400.0 ms to train; the stage delivered one every 400.0 "
        "ms. The input keeps up; num_threads=1 would be enough (now 2)."
    )
    for message in (result["message"], kept_up["message"]):
        assert not re.search(r"(?<![\d.])0(\.0)? (us|ms)", message), message


def test_an_untimed_stage_that_only_buffers_reports_no_staged_computation():
    # Under op determinism the wait is not measured; a stage with nothing
    # to compute still has no staged computation to report.
    options = StageOptions(capacity=4, num_threads=2, name="s")
    result = verdict(
        _stats(wait_seconds=None, wait_ratio=None, busy_seconds=0.0), options
    )
    assert result["prepare_seconds_per_batch"] is None
    assert result["input_bound"] is None
    assert result["message"].startswith(
        "Stage 's': the training step's wait for data was not measured; no "
        "staged computation (the stage only buffers); per batch, the stage "
        "delivered one every 400.0 ms"
    )
    assert "the clock that times the wait:" in result["message"]


def _string_and_number_model(smart_stage, name):
    """A string column looked up, a number normalized, a small trunk."""
    words = keras.Input(shape=(), dtype="string", name="word")
    number = keras.Input(shape=(1,), name="number")
    staged = StagedInput(name=name)([words, number])
    ids = keras.layers.StringLookup(vocabulary=["a", "b", "c"])(staged[0])
    scaled = keras.layers.Normalization(mean=0.5, variance=0.25)(staged[1])
    x = keras.layers.Concatenate()([keras.layers.Embedding(5, 4)(ids), scaled])
    model = keras_stage.Model([words, number], keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=smart_stage)
    return model


def _string_and_number_data():
    words = np.array(["a", "b", "c", "d"] * 24, dtype=object)
    number = np.linspace(0.0, 1.0, 96, dtype="float32").reshape(-1, 1)
    return {"word": words, "number": number}, np.ones((96, 1), "float32")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_the_verdict_reports_staged_layers_work_and_a_buffer_s_none(
    data, capsys
):
    # SmartStage stages the lookup and the normalization: their time is
    # measured (on arrays the batches are gathered in the stage's own map).
    # Without smart_stage the same stage only buffers: no figure at all.
    x, y = _string_and_number_data()
    if data == "dataset":
        x = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        y = None
    for smart_stage in (True, False):
        callback = PrefetchCallback(verbose=1)
        model = _string_and_number_model(smart_stage, f"words_{smart_stage}")
        model.fit(
            x,
            y,
            batch_size=None if y is None else 8,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[callback],
        )
        out = capsys.readouterr().out
        prepare = callback.verdict["prepare_seconds_per_batch"]
        if smart_stage:
            assert "lookup" in " ".join(model.get_stage_plan().staged_layers)
            assert prepare is not None and prepare > 0, callback.verdict
            assert "of staged computation (per thread)" in out
            assert "no staged computation" not in out
        else:
            assert prepare is None, callback.verdict
            assert out.count("no staged computation") == 2, out
            assert "of staged computation (per thread)" not in out


# -- where the consumer's side is counted ------------------------------------


class _Attached(PrefetchCallback):
    """Keeps the stages it was attached to, to inspect them after fit."""

    def attach(self, phase, staged, adapter=None, **kwargs):
        self.seen = getattr(self, "seen", {})
        self.seen[phase] = staged
        super().attach(phase, staged, adapter, **kwargs)


@pytest.mark.timeout(120)
def test_keras_steps_count_every_fetch_in_the_step_not_in_the_pipeline():
    # adaptive=False: the later fit, short and on data in memory, would
    # otherwise run unstaged (decision/calls.py) and count nothing.
    model = _model(name="in_step", adaptive=False)
    cb = _Attached()
    model.fit(
        _dataset(),
        epochs=2,
        verbose=0,
        shuffle=False,
        validation_data=_dataset(),
        callbacks=[cb],
    )
    train, val = cb.seen["train"], cb.seen["test"]
    # Both runners report their calls; the stages they iterated have no
    # fetch map on the consumer's path, nor built beside it (a stage whose
    # consumer records is its lean pipeline).
    assert train.runner.records_in_step and val.runner.records_in_step
    lean_graph = train.lean_pipeline._as_serialized_graph().numpy()
    assert b"in_step_train_fetch" not in lean_graph
    assert b"in_step_train_fetch" not in train._as_serialized_graph().numpy()
    assert train.pipeline is train.lean_pipeline
    # Every batch of both epochs, counted exactly once, in the step. Its
    # dataset draws nothing, so the stage's iterator runs on into the next
    # call on it (see kept_iterators.py): what it made
    # past the call waits in its buffer, for that call.
    snap = train.stats.snapshot()
    assert snap["consumed"] == 2 * NUM_BATCHES
    assert 0 <= snap["produced"] - snap["consumed"] <= NUM_BATCHES
    assert val.stats.snapshot()["consumed"] == 2 * NUM_BATCHES
    # A new dataset object: a new stage. The stats outlive the call: the
    # traced step records in them again.
    model.fit(_dataset(), epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    assert cb.seen["train"].stats is train.stats
    assert train.stats.snapshot()["consumed"] == 3 * NUM_BATCHES


@pytest.mark.timeout(120)
def test_closed_step_stats_are_replaced_and_the_step_retraced():
    model = _model(name="reopened", adaptive=False)  # both fits staged
    cb = _Attached()
    model.fit(_dataset(), epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    first = cb.seen["train"].stats
    first.close()  # what a timeout does
    model.fit(_dataset(), epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    second = cb.seen["train"].stats
    assert second is not first
    assert second.snapshot()["consumed"] == NUM_BATCHES


# -- TensorBoard ---------------------------------------------------------------


def _tiny_staged_model():
    inputs = keras.Input(shape=(2,))
    x = StagedInput(capacity=2, num_threads=1, name="tb")(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _tiny_smart_staged_model():
    # A stageable layer, so that the stage has a computation to time; and
    # adaptive=False, so that every epoch of this short fit is staged.
    inputs = keras.Input(shape=(2,))
    x = StagedInput(capacity=2, num_threads=1, name="tb", adaptive=False)(
        inputs
    )
    x = keras.layers.Normalization(mean=0.0, variance=1.0)(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    return model


@pytest.mark.timeout(120)
def test_log_dir_writes_the_stage_figures_per_epoch(tmp_path):
    model = _tiny_smart_staged_model()
    callback = PrefetchCallback(log_dir=tmp_path)
    history = model.fit(
        np.ones((16, 2)),
        np.ones((16, 1)),
        batch_size=4,
        epochs=3,
        verbose=0,
        callbacks=[callback],
    ).history
    scalars = tensorboard_scalars(tmp_path / "stage")
    for name in (
        "wait_ratio",
        "buffer_fill",
        "skipped",
        "suggested_num_threads",
        "suggested_capacity",
        "prepare_ms_per_batch",
        "train_ms_per_batch",
        "delivery_ms_per_batch",
    ):
        assert [step for step, _ in scalars[f"stage/{name}"]] == [0, 1, 2]
    written = [value for _, value in scalars["stage/wait_ratio"]]
    assert written == pytest.approx(history["stage_wait_ratio"])
    assert [v for _, v in scalars["stage/skipped"]] == [0.0, 0.0, 0.0]
    assert all(v > 0 for _, v in scalars["stage/prepare_ms_per_batch"])


@pytest.mark.timeout(120)
def test_log_dir_leaves_out_the_staged_computation_of_a_buffer(tmp_path):
    # A stage with nothing to compute has no preparation time: the tag is
    # left out, not written as 0; every other figure is written.
    _tiny_staged_model().fit(
        np.ones((16, 2)),
        np.ones((16, 1)),
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[PrefetchCallback(log_dir=tmp_path)],
    )
    scalars = tensorboard_scalars(tmp_path / "stage")
    assert "stage/prepare_ms_per_batch" not in scalars
    for name in ("wait_ratio", "train_ms_per_batch", "delivery_ms_per_batch"):
        assert [step for step, _ in scalars[f"stage/{name}"]] == [0, 1]


@pytest.mark.timeout(120)
def test_keras_tensorboard_callback_records_the_stage_logs(tmp_path):
    model = _tiny_staged_model()
    model.fit(
        np.ones((16, 2)),
        np.ones((16, 1)),
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[keras.callbacks.TensorBoard(log_dir=str(tmp_path))],
    )
    scalars = tensorboard_scalars(tmp_path / "train")
    for key in ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped"):
        assert [step for step, _ in scalars[f"epoch_{key}"]] == [0, 1]


@pytest.mark.timeout(120)
def test_log_dir_without_tensorboard_names_the_fix():
    # TensorFlow has tf.summary's scalars from TensorBoard, which it loads
    # on first use: blocked before that, they are missing, as in an
    # environment without it. (The forking process imported TensorFlow,
    # not TensorBoard.)
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from keras_stage.callbacks import PrefetchCallback\n"
        "PrefetchCallback(log_dir=None)\n"
        "try:\n"
        "    PrefetchCallback(log_dir='logs')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = printed_in_forked_python(code)
    assert out.startswith(
        "PrefetchCallback(log_dir=...) writes TensorBoard event files, "
        "which needs the `tensorboard` package, and it is not installed. "
        "Install it with `pip install tensorboard`"
    )
    assert "Received: log_dir='logs'" in out


@pytest.mark.parametrize("log_dir", [3, b"logs", ["logs"]])
def test_log_dir_must_be_a_path(log_dir):
    with pytest.raises(
        ValueError, match=r"Invalid value for argument `log_dir`"
    ):
        PrefetchCallback(log_dir=log_dir)
