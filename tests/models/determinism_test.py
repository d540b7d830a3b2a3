"""Staged runs under op determinism train exactly like plain Keras.

The Keras reproducibility recipe, `keras.utils.set_random_seed(s)` plus
`tf.config.experimental.enable_op_determinism()`, makes TensorFlow refuse
`tf.timestamp`. Each test turns determinism on after keras_stage was
imported (as a user would), builds a staged model and a plain
`keras.Model` with the same weights, seeds both the same way right before
each call, and checks that fit, evaluate and predict give the same numbers,
bit for bit, and that the PrefetchCallback reports what it measured and
says what it could not.
"""

import logging
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.callbacks import PrefetchCallback
from keras_stage.data import pipeline_model
from keras_stage.data.stats import NO_CLOCK_NOTE
from keras_stage.layers import StagedInput
from keras_stage.models.call import facts
from keras_stage.models.decision import calls
from tests.helpers import sweep, tensorboard_scalars, twin_optimizer
from tests.op_determinism import needs_tf_data_model, op_determinism

pytestmark = pytest.mark.timeout(180)

SEED = 5
N = 44  # not a multiple of the batch size: a partial last batch
BATCH = 8
# adaptive=False: every call is staged. These short calls on data in memory
# would otherwise run unstaged once their stage's costs are measured, and
# what is checked here is the staged path under op determinism.
STAGE = dict(capacity=2, num_threads=2, name="stage", adaptive=False)
_rng = np.random.default_rng(0)
X = _rng.normal(size=(N, 4)).astype("float32")
Y = _rng.normal(size=(N, 1)).astype("float32")
WORDS = np.array([f"w{i % 9}" for i in range(N)], dtype=object)
VOCABULARY = [f"w{i}" for i in range(6)]  # w6-w8 are out of vocabulary


@pytest.fixture
def determinism():
    with op_determinism():
        yield


class _RecordingPrefetch(PrefetchCallback):
    """Records which phases were staged, to prove staging happened."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.phases = []

    def attach(self, phase, staged, adapter=None, **kwargs):
        self.phases.append(phase)
        super().attach(phase, staged, adapter, **kwargs)


def _dense(model_class, dropout=True):
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(**STAGE)(inputs)
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    if dropout:  # seeded randomness
        x = keras.layers.Dropout(0.3, name="dropout")(x)
    return model_class(inputs, keras.layers.Dense(1, name="head")(x))


def _words(model_class):
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(), dtype="string", name="word")
    x = StagedInput(**STAGE)(inputs)
    ids = keras.layers.StringLookup(vocabulary=VOCABULARY, name="lookup")(x)
    hashed = keras.layers.Hashing(num_bins=16, name="hash")(x)
    a = keras.layers.Embedding(len(VOCABULARY) + 1, 4, name="emb_a")(ids)
    b = keras.layers.Embedding(16, 4, name="emb_b")(hashed)
    x = keras.layers.Concatenate(name="concat")([a, b])
    return model_class(inputs, keras.layers.Dense(1, name="head")(x))


def _twins(build, smart_stage=False, **compile_kwargs):
    """A staged model and a plain `keras.Model` with the same weights."""
    staged, plain = build(keras_stage.Model), build(keras.Model)
    plain.set_weights(staged.get_weights())
    for model in (staged, plain):
        kwargs = dict(compile_kwargs)
        if model is staged:
            kwargs["smart_stage"] = smart_stage
        model.compile(optimizer=twin_optimizer(), loss="mse", **kwargs)
    return staged, plain


def _data(x, y=None, shuffle=False):
    data = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y))
    if shuffle:
        # Its seeds pair the global seed with `seed`: the same global seed
        # here shuffles both models' data alike, epoch after epoch.
        tf.random.set_seed(SEED)
        data = data.shuffle(N, seed=SEED)
    return data.batch(BATCH)


def _seeded(call, *args, **kwargs):
    keras.utils.set_random_seed(SEED)
    if call.__name__ == "fit":
        kwargs["shuffle"] = False  # the datasets shuffle themselves
    return call(*args, verbose=0, **kwargs)


def _assert_same_weights(staged, plain):
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


CASES = {
    # StagedInput only: the stage copies the batches.
    "staged_input": (_dense, X, False, {}),
    # Several batches per call: the step accumulates its fetches in the
    # graph instead of reporting them.
    "steps_per_execution": (_dense, X, False, {"steps_per_execution": 2}),
    # SmartStage: the lookup and the hashing run in the stage.
    "smart_stage": (_words, WORDS, True, {}),
}


@pytest.mark.parametrize(
    "case", sweep(sorted(CASES), kept=("smart_stage", "steps_per_execution"))
)
def test_fit_evaluate_predict_equal_plain_keras(determinism, case, caplog):
    build, x, smart_stage, compile_kwargs = CASES[case]
    caplog.set_level(logging.WARNING, logger="keras_stage")
    staged, plain = _twins(build, smart_stage, **compile_kwargs)
    if smart_stage:
        assert sorted(staged.get_stage_plan().staged_layers) == [
            "hash",
            "lookup",
            "stage",
        ]
    prefetch = _RecordingPrefetch()
    histories = [
        _seeded(
            model.fit,
            _data(x, Y, shuffle=True),
            epochs=3,
            validation_data=_data(x[:12], Y[:12]),
            callbacks=[prefetch] if model is staged else [],
        ).history
        for model in (staged, plain)
    ]
    assert prefetch.phases == ["train", "test"]
    for key, values in histories[1].items():
        assert histories[0][key] == values, key
    _assert_same_weights(staged, plain)

    # The same PrefetchCallback serves the evaluate and predict calls.
    results = [
        _seeded(
            model.evaluate,
            _data(x, Y),
            callbacks=[prefetch] if model is staged else [],
        )
        for model in (staged, plain)
    ]
    assert results[0] == results[1]
    predictions = [
        _seeded(
            model.predict,
            _data(x),
            callbacks=[prefetch] if model is staged else [],
        )
        for model in (staged, plain)
    ]
    np.testing.assert_array_equal(predictions[0], predictions[1])
    assert prefetch.phases == ["train", "test", "test", "predict"]
    # One note, however many stages and steps were traced without a clock.
    notes = [r for r in caplog.records if r.getMessage() == NO_CLOCK_NOTE]
    assert len(notes) == 1


@needs_tf_data_model
def test_prefetch_callback_logs_what_tf_data_measured(determinism, capsys):
    staged, _ = _twins(_dense)
    callback = PrefetchCallback(verbose=1)
    history = _seeded(
        staged.fit, _data(X, Y), epochs=2, callbacks=[callback]
    ).history
    # No clock or counter in the pipeline (either would make tf.data run it
    # one batch at a time): the wait and the buffer's fill are read from
    # tf.data's own model of the stage's iterator.
    assert history["stage_skipped"] == [0, 0]
    for key in ("stage_wait_ratio", "stage_buffer_fill"):
        assert len(history[key]) == 2, key
        assert all(0.0 <= value <= 1.0 for value in history[key]), key
    verdict = callback.verdict
    assert verdict["epoch"] == 1
    assert verdict["wait_ratio"] == history["stage_wait_ratio"][-1]
    assert verdict["buffer_fill"] == history["stage_buffer_fill"][-1]
    assert verdict["input_bound"] in (True, False)
    assert verdict["train_seconds_per_batch"] > 0.0
    assert verdict["delivery_seconds_per_batch"] > 0.0
    # A stage that only buffers: no staged computation, as without
    # determinism.
    assert verdict["prepare_seconds_per_batch"] is None
    assert verdict["suggested_num_threads"] >= 1
    printed = capsys.readouterr().out
    assert printed.count("Stage 'stage_train': ") == 2
    assert "not measured" not in printed
    assert "Op determinism is on" not in printed


def test_without_tf_data_s_model_the_wait_is_said_not_measured(
    determinism, capsys
):
    # A dataset whose options turn autotuning off: tf.data keeps no model
    # of its iterators, so nothing measures the wait or the buffer's fill.
    staged, _ = _twins(_dense)
    options = tf.data.Options()
    options.autotune.enabled = False
    callback = PrefetchCallback(verbose=1)
    history = _seeded(
        staged.fit,
        _data(X, Y).with_options(options),
        epochs=2,
        callbacks=[callback],
    ).history
    assert history["stage_skipped"] == [0, 0]
    # Left out, not reported as a measured 0.0.
    assert "stage_wait_ratio" not in history
    assert "stage_buffer_fill" not in history
    verdict = callback.verdict
    assert verdict["wait_ratio"] is None
    assert verdict["buffer_fill"] is None
    assert verdict["input_bound"] is None
    assert verdict["suggested_num_threads"] is None
    assert verdict["delivery_seconds_per_batch"] > 0.0
    unmeasured = "the training step's wait for data was not measured"
    assert verdict["message"].startswith(f"Stage 'stage_train': {unmeasured}")
    assert "no advice on num_threads or capacity" in verdict["message"]
    assert "its buffer's fill was not counted" in verdict["message"]
    assert capsys.readouterr().out.count(unmeasured) == 2


def _sleepy(x):
    def sleep(value):
        time.sleep(0.02)
        return value

    return tf.ensure_shape(tf.py_function(sleep, [x], tf.float32), x.shape)


class _SlowTrunk(keras.layers.Layer):
    def call(self, x):
        return _sleepy(x)


@needs_tf_data_model
def test_the_verdict_tells_a_slow_source_from_a_slow_step(determinism):
    # The wait comes from the gaps tf.data measures between the step's
    # fetches: a source that sleeps 20 ms a batch is waited for, a step
    # that sleeps 20 ms is not.
    def fit(slow_source):
        inputs = keras.Input(shape=(4,))
        x = StagedInput(capacity=2, num_threads=1, adaptive=False)(inputs)
        if not slow_source:
            x = _SlowTrunk()(x)
        model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
        model.compile(optimizer="sgd", loss="mse")
        data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(2)
        if slow_source:
            data = data.map(lambda a, b: (_sleepy(a), b))
        callback = PrefetchCallback()
        model.fit(
            data, epochs=2, shuffle=False, verbose=0, callbacks=[callback]
        )
        return callback.verdict

    slow, fast = fit(slow_source=True), fit(slow_source=False)
    why = f"slow source: {slow}; slow step: {fast}"
    assert slow["input_bound"] is True, why
    assert slow["source_bound"] is True, why
    assert fast["input_bound"] is False, why
    assert slow["wait_ratio"] > fast["wait_ratio"], why


@needs_tf_data_model
def test_tensorboard_gets_what_tf_data_measured(determinism, tmp_path):
    staged, _ = _twins(_dense)
    history = _seeded(
        staged.fit,
        _data(X, Y),
        epochs=2,
        callbacks=[
            PrefetchCallback(log_dir=tmp_path / "stage_logs"),
            keras.callbacks.TensorBoard(log_dir=str(tmp_path / "keras")),
        ],
    ).history
    written = tensorboard_scalars(tmp_path / "stage_logs" / "stage")
    # A stage with nothing to compute has no preparation time to write: left
    # out, as the verdict leaves it out, not written as 0.
    assert sorted(written) == [
        "stage/buffer_fill",
        "stage/delivery_ms_per_batch",
        "stage/skipped",
        "stage/suggested_capacity",
        "stage/suggested_num_threads",
        "stage/train_ms_per_batch",
        "stage/wait_ratio",
    ]
    for values in written.values():
        assert [step for step, _ in values] == [0, 1]
    assert [v for _, v in written["stage/skipped"]] == history["stage_skipped"]
    assert [v for _, v in written["stage/wait_ratio"]] == pytest.approx(
        history["stage_wait_ratio"]
    )
    keras_written = tensorboard_scalars(tmp_path / "keras" / "train")
    for key in ("buffer_fill", "skipped", "wait_ratio"):
        assert f"epoch_stage_{key}" in keras_written


def test_a_model_fit_before_determinism_trains_after_it():
    # No dropout: its seed state, which `set_weights` does not copy, moves
    # with the fits only the staged model runs here.
    staged, plain = _twins(lambda cls: _dense(cls, dropout=False))
    _seeded(staged.fit, _data(X, Y), epochs=1)
    with op_determinism():
        # Its step was traced with the stage's clock, which TensorFlow now
        # refuses: the model traces its steps afresh on new stats itself
        # (see `StageStats.clock_refused`).
        _seeded(staged.fit, _data(X, Y), epochs=1)
        history = _seeded(staged.evaluate, _data(X, Y), return_dict=True)
        assert np.isfinite(history["loss"])
        # Compiled again, its steps are traced afresh, without the clock.
        for model in (staged, plain):
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        plain.set_weights(staged.get_weights())
        for model in (staged, plain):
            _seeded(model.fit, _data(X, Y, shuffle=True), epochs=2)
        _assert_same_weights(staged, plain)


def test_an_unstaged_call_after_a_staged_one_runs_under_determinism():
    # A stage alone over arrays has nothing to overlap: once measured, the
    # model's calls skip it (adaptive) and run steps traced apart from the
    # staged call's, which holds the stage's clock.
    inputs = keras.Input(shape=(4,))
    x = StagedInput(name="skipped")(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=0)
    with op_determinism():
        history = model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0)
        assert history.history["stage_unstaged"] == [1.0, 1.0]
        assert np.isfinite(history.history["loss"]).all()


def test_calls_on_data_in_memory_are_decided_from_host_timed_steps(
    determinism, caplog
):
    # Under op determinism the stage's pipeline times nothing (a clock or a
    # counter in it would make tf.data run it one batch at a time): the
    # host times the steps and reads the staged work from tf.data's model.
    # A first staged call, then, by the LOOP_CALLS-th staged call at the
    # latest, an unstaged call (the trial) times the whole model's step,
    # and later calls weigh the two. Every call trains exactly as plain
    # Keras does.
    stage = dict(STAGE, adaptive=True, name="timed")

    def build(model_class):
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=(), dtype="string", name="word")
        x = StagedInput(**stage)(inputs)
        ids = keras.layers.StringLookup(vocabulary=VOCABULARY)(x)
        x = keras.layers.Embedding(len(VOCABULARY) + 1, 4)(ids)
        return model_class(inputs, keras.layers.Dense(1, name="head")(x))

    staged, plain = _twins(build, smart_stage=True)
    costs = facts.costs(staged).phase("train")
    caplog.set_level(logging.INFO, logger="keras_stage")
    prefetch = _RecordingPrefetch()
    unstaged_at = None
    for round_ in range(calls.LOOP_CALLS + 3):
        if unstaged_at is not None and round_ > unstaged_at + 1:
            break
        for model in (staged, plain):
            _seeded(
                model.fit,
                _data(WORDS, Y, shuffle=True),
                epochs=2,
                callbacks=[prefetch] if model is staged else [],
            )
        _assert_same_weights(staged, plain)
        if round_ == 0:
            # Staged (nothing measured yet), its steps timed on the host,
            # its staged work by tf.data's model of its iterators.
            assert prefetch.phases == ["train"]
            if pipeline_model.AVAILABLE:
                assert costs.batch_seconds > 0
            else:
                assert costs.batch_seconds is None
            assert costs.staged_step_seconds > 0
            assert costs.unstaged_step_seconds is None
        elif unstaged_at is None and costs.unstaged_step_seconds is not None:
            # Unstaged (the trial): its whole-model steps and trace timed.
            unstaged_at = round_
            # The staged rounds before it attached the callback; not this.
            assert prefetch.phases == ["train"] * round_
            assert "train runs the whole model in Keras's step" in caplog.text
            assert costs.unstaged_trace_seconds > 0
    assert unstaged_at is not None and unstaged_at <= calls.LOOP_CALLS
    # Decided from the two: measured, and no second trial.
    assert costs.measured() and not costs.trial_due()
    assert caplog.text.count("[trial]") <= 1
