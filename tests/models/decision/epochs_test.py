"""Epochs run without the stage where it does not pay (decision/epochs.py).

Which mode is faster is timing; these tests fix the outcome of the
comparison (`MARGIN`, `TRIAL_WAIT_RATIO`) and check everything else: the
epochs that run unstaged, the same weights and logs as plain Keras, what
the stage counts, the verdicts and when no trial happens.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.models.decision import calls
from keras_stage.models.decision import epochs as epoch_switch
from keras_stage.models.decision.learned import learned
from tests.helpers import twin_optimizer

pytestmark = pytest.mark.timeout(180)

# 8 steps an epoch at 8 (`epochs.MIN_STEPS`, the fewest a trial times).
ROWS = 64
WORDS = np.array([f"w{i % 7}" for i in range(ROWS)], dtype=object)
LABELS = np.linspace(0.0, 1.0, ROWS, dtype="float32").reshape(-1, 1)
# What validation reads: 4 steps at 8.
VALIDATION_ROWS = 32


def _models(**staged_input):
    """A plain model and a staged one with its weights."""
    built = []
    for staged in (False, True):
        inputs = keras.Input(shape=(), dtype="string")
        x = inputs
        if staged:
            x = keras_stage.layers.StagedInput(**staged_input)(inputs)
        x = keras.layers.StringLookup(
            vocabulary=[f"w{i}" for i in range(7)], name="lookup"
        )(x)
        x = keras.layers.Embedding(9, 4, name="emb")(x)
        x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
        x = keras.layers.Dropout(0.2, seed=3, name="drop")(x)  # in the trunk
        outputs = keras.layers.Dense(1, name="head")(x)
        cls = keras_stage.Model if staged else keras.Model
        model = cls(inputs, outputs)
        kwargs = {"smart_stage": True} if staged else {}
        model.compile(optimizer=twin_optimizer(), loss="mse", **kwargs)
        built.append(model)
    plain, staged = built
    staged.set_weights(plain.get_weights())
    return plain, staged


def _dataset(seed=None, batch_size=8, rows=ROWS):
    ds = tf.data.Dataset.from_tensor_slices((WORDS[:rows], LABELS[:rows]))
    if seed is not None:
        ds = ds.shuffle(rows, seed=seed)
    return ds.batch(batch_size)


def _fit(model, epochs=6, callbacks=(), batch_size=8, validation=None):
    keras.utils.set_random_seed(1)
    train = _dataset(seed=4, batch_size=batch_size)
    return model.fit(
        train,
        epochs=epochs,
        validation_data=(
            _dataset(rows=VALIDATION_ROWS)
            if validation is None
            else validation(train)
        ),
        callbacks=list(callbacks),
        shuffle=False,
        verbose=0,
    )


# `_plain_fit`'s fits: {op determinism on: (initial weights, final
# weights, History)}.
_PLAIN_FITS = {}


def _plain_fit(plain):
    """`_fit(plain)`'s History, fit once per test process.

    The plain model of `_models()` starts from the same weights in every
    test, and the same fit from the same weights trains the same: a later
    test (with op determinism on or off alike) gets the first one's History
    and `plain` the weights it ended with. Other starting weights are fit
    afresh.
    """
    from tests.op_determinism import enabled

    start = plain.get_weights()
    if enabled() in _PLAIN_FITS:
        initial, final, history = _PLAIN_FITS[enabled()]
        if all(
            np.array_equal(a, b) for a, b in zip(initial, start, strict=True)
        ):
            plain.set_weights(final)
            return history
    history = _fit(plain)
    _PLAIN_FITS[enabled()] = (start, plain.get_weights(), history)
    return history


@pytest.fixture(autouse=True)
def calls_staged(monkeypatch):
    """Every fit of several batches is staged: the epochs are decided here.

    These fits on a dataset in memory would otherwise run unstaged once
    their stage's costs are measured (see `decision/calls.py`).
    """
    decide = calls.CallCosts.decide

    def staged(self, phase, batches, *args, **kwargs):
        if batches is not None and batches > 1:
            return calls.Decision(calls.Kind.BY_REQUEST)
        return decide(self, phase, batches, *args, **kwargs)

    monkeypatch.setattr(calls.CallCosts, "decide", staged)


@pytest.fixture
def unstaged_wins(monkeypatch):
    """Every trial happens and finds the whole model faster."""
    monkeypatch.setattr(epoch_switch, "TRIAL_WAIT_RATIO", float("inf"))
    monkeypatch.setattr(epoch_switch, "TRACE_SHARE", float("inf"))
    monkeypatch.setattr(epoch_switch, "MARGIN", -1e9)


@pytest.fixture
def staged_wins(monkeypatch):
    """Every trial happens and finds the stage faster."""
    monkeypatch.setattr(epoch_switch, "TRIAL_WAIT_RATIO", float("inf"))
    monkeypatch.setattr(epoch_switch, "TRACE_SHARE", float("inf"))
    monkeypatch.setattr(epoch_switch, "MARGIN", 1.0)


def _assert_same(plain, staged, plain_history, staged_history):
    for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(
            plain_history.history[key], staged_history.history[key], rtol=1e-6
        )


def test_a_stage_that_does_not_pay_leaves_the_rest_of_the_fit(
    unstaged_wins, caplog
):
    plain, staged = _models()
    expected = _plain_fit(plain)
    callback = keras_stage.callbacks.PrefetchCallback()
    stats = []

    class Consumed(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            train = staged._keras_stage_state.step_stats["train"]
            stats.append(train.snapshot()["consumed"])

    with caplog.at_level(logging.INFO, logger="keras_stage"):
        history = _fit(staged, callbacks=[callback, Consumed()])
    # Two staged epochs (the adaptive pool resizes after the first), the
    # trial, then the whole model for the rest: same weights and logs.
    assert history.history["stage_unstaged"] == [0, 0, 1, 1, 1, 1]
    _assert_same(plain, staged, expected, history)
    # Every key on every epoch; the unstaged epochs staged nothing.
    lengths = {len(values) for values in history.history.values()}
    assert lengths == {6}
    assert history.history["stage_buffer_fill"][2:] == [0.0] * 4
    assert stats[2:] == [stats[1]] * 4
    assert "does not pay" in caplog.text
    assert callback.verdict["staged"] is False
    assert "without the stage" in callback.verdict["message"]
    # Later calls weigh the switch's two kinds of steps (the call's own
    # clock mixed them): no trial is due again.
    train = calls.costs(staged).phase("train")
    assert train.unstaged_step_seconds is not None
    assert train.staged_step_seconds is not None
    assert not train.trial_due()


def test_a_stage_that_pays_keeps_the_fit_and_later_fits(staged_wins):
    plain, staged = _models()
    expected = _plain_fit(plain)
    history = _fit(staged)
    # The trial epoch alone ran without the stage.
    assert history.history["stage_unstaged"] == [0, 0, 1, 0, 0, 0]
    _assert_same(plain, staged, expected, history)
    # A later fit of the model does not try again...
    again = _fit(staged, epochs=5)
    assert "stage_unstaged" not in again.history
    # ...until compile.
    staged.compile(optimizer=twin_optimizer(), loss="mse", smart_stage=True)
    assert _fit(staged, epochs=5).history["stage_unstaged"] == [0, 0, 1, 0, 0]


def test_adaptive_false_stages_every_epoch(unstaged_wins):
    _, staged = _models(adaptive=False)
    history = _fit(staged)
    assert "stage_unstaged" not in history.history


def test_a_fit_too_short_for_a_trial_is_all_staged(unstaged_wins):
    plain, staged = _models()
    history = _fit(staged, epochs=3)
    assert "stage_unstaged" not in history.history


def test_a_fixed_pool_is_tried_after_one_staged_epoch(unstaged_wins):
    _, staged = _models(num_threads=2)
    # A dataset on a fixed pool runs its epochs on one iterator...
    history = _fit(staged, epochs=4)
    assert "stage_unstaged" not in history.history
    # ...unless its validation reads the same dataset (their draws
    # interleave): an iterator per epoch, and the trial after one.
    plain, staged = _models(num_threads=2)
    expected = _fit(plain, epochs=4, validation=lambda ds: ds.take(3))
    history = _fit(staged, epochs=4, validation=lambda ds: ds.take(3))
    assert history.history["stage_unstaged"] == [0, 1, 1, 1]
    _assert_same(plain, staged, expected, history)


def test_a_step_that_waits_for_input_is_not_tried(monkeypatch):
    monkeypatch.setattr(epoch_switch, "TRIAL_WAIT_RATIO", -1.0)
    monkeypatch.setattr(epoch_switch, "MARGIN", -1e9)
    _, staged = _models()
    history = _fit(staged)
    assert history.history["stage_unstaged"] == [0] * 6


def test_steps_per_execution_and_an_unstaged_evaluate_after(unstaged_wins):
    plain, staged = _models()
    for model in (plain, staged):
        model.compile(
            optimizer=twin_optimizer(),
            loss="mse",
            steps_per_execution=2,
            **({"smart_stage": True} if model is staged else {}),
        )
    staged.set_weights(plain.get_weights())
    expected = _fit(plain, batch_size=4)
    history = _fit(staged, batch_size=4)  # 8 calls of the step an epoch
    assert history.history["stage_unstaged"] == [0, 0, 1, 1, 1, 1]
    _assert_same(plain, staged, expected, history)
    np.testing.assert_allclose(
        plain.evaluate(_dataset(), verbose=0),
        staged.evaluate(_dataset(), verbose=0),
        rtol=1e-6,
    )


def test_under_op_determinism_the_trial_decides_alone(unstaged_wins):
    from tests.op_determinism import op_determinism

    plain, staged = _models()
    with op_determinism():
        expected = _plain_fit(plain)
        history = _fit(
            staged, callbacks=[keras_stage.callbacks.PrefetchCallback()]
        )
    # No clock in the step or the pipeline: the trial's host-timed steps
    # decide, with the same weights as plain.
    assert history.history["stage_unstaged"] == [0, 0, 1, 1, 1, 1]
    _assert_same(plain, staged, expected, history)


def test_under_op_determinism_a_step_that_waits_is_not_tried(monkeypatch):
    # The wait is read from tf.data's model of the stage's iterator (see
    # `data.pipeline_model`): measured, so it still rules out the trial.
    from keras_stage.data import pipeline_model
    from tests.op_determinism import op_determinism

    if not pipeline_model.AVAILABLE:
        pytest.skip("tf.data.experimental.get_model_proto: TF 2.17+")

    monkeypatch.setattr(epoch_switch, "TRIAL_WAIT_RATIO", -1.0)
    monkeypatch.setattr(epoch_switch, "MARGIN", -1e9)
    plain, staged = _models()
    with op_determinism():
        expected = _plain_fit(plain)
        history = _fit(staged)
    assert history.history["stage_unstaged"] == [0] * 6
    assert all(0.0 <= r <= 1.0 for r in history.history["stage_wait_ratio"])
    _assert_same(plain, staged, expected, history)


# `make test` keeps the trial under op determinism (the test above) and a
# trial that finds the stage pays (without it, at the top); the two
# together are in `make test-long`.
@pytest.mark.long
def test_under_op_determinism_a_stage_that_pays_keeps_its_epochs(
    staged_wins,
):
    from tests.op_determinism import op_determinism

    plain, staged = _models()
    with op_determinism():
        expected = _plain_fit(plain)
        history = _fit(staged)
    assert history.history["stage_unstaged"] == [0, 0, 1, 0, 0, 0]
    _assert_same(plain, staged, expected, history)


# Each value of each argument in `make test`; the other two pairs in
# `make test-long`.
@pytest.mark.parametrize(
    "shuffle, unstaged_after_trial",
    [
        (True, True),
        (False, False),
        pytest.param(True, False, marks=pytest.mark.long),
        pytest.param(False, True, marks=pytest.mark.long),
    ],
)
def test_arrays_on_one_iterator_skip_the_epochs_run_without_the_stage(
    monkeypatch, unstaged_after_trial, shuffle
):
    monkeypatch.setattr(epoch_switch, "TRIAL_WAIT_RATIO", float("inf"))
    monkeypatch.setattr(epoch_switch, "TRACE_SHARE", float("inf"))
    monkeypatch.setattr(
        epoch_switch, "MARGIN", -1e9 if unstaged_after_trial else 1.0
    )
    plain, staged = _models()
    histories = []
    for model in (plain, staged):
        keras.utils.set_random_seed(1)
        histories.append(
            model.fit(
                WORDS,
                LABELS,
                batch_size=8,
                epochs=6,
                shuffle=shuffle,
                validation_data=(
                    WORDS[:VALIDATION_ROWS],
                    LABELS[:VALIDATION_ROWS],
                ),
                verbose=0,
            )
        )
    expected, history = histories
    # In-memory arrays run their epochs on one iterator; the trial drops
    # it, and a staged epoch after the trial starts a new one past it.
    assert staged._keras_stage_state.stages == {}  # not a dataset
    trial = [0, 0, 1]
    rest = [1, 1, 1] if unstaged_after_trial else [0, 0, 0]
    assert history.history["stage_unstaged"] == trial + rest
    _assert_same(plain, staged, expected, history)


def test_no_trial_whose_trace_would_outweigh_what_it_can_gain(
    unstaged_wins, monkeypatch
):
    # Tracing the whole model's step would cost more than the epochs
    # after the trial could give back...
    monkeypatch.setattr(epoch_switch, "TRACE_SHARE", 0.0)
    plain, staged = _models()
    history = _fit(staged)
    assert history.history["stage_unstaged"] == [0] * 6
    # ...unless it is traced already: a fit of one batch runs unstaged.
    staged.fit(WORDS[:8], LABELS[:8], batch_size=8, verbose=0)
    assert ("train", "unstaged") in staged._keras_stage_state.staged_functions
    history = _fit(staged)
    assert history.history["stage_unstaged"] == [0, 0, 1, 1, 1, 1]


def _iterators_noted(model):
    """The phases of the stage iterators `model`'s calls make, as made."""
    made = []
    costs = calls.costs(model)
    original = costs.note_iterator

    def note(phase, seconds):
        made.append(phase)
        original(phase, seconds)

    costs.note_iterator = note
    return made


@pytest.mark.parametrize("stage_pays", [False, True])
def test_a_reshuffling_dataset_keeps_plain_orders_on_few_iterators(
    stage_pays, monkeypatch, caplog
):
    # Its epochs' orders follow the iterators made before (a seed
    # generator): each staged epoch before the decision ends its iterator,
    # and the epochs after a decision for the stage share one more.
    monkeypatch.setattr(epoch_switch, "TRIAL_WAIT_RATIO", float("inf"))
    monkeypatch.setattr(epoch_switch, "TRACE_SHARE", float("inf"))
    monkeypatch.setattr(epoch_switch, "MARGIN", 1.0 if stage_pays else -1e9)
    plain, staged = _models()
    expected = _plain_fit(plain)
    made = _iterators_noted(staged)
    history = _fit(staged)
    kept = staged._keras_stage_state.stages["train"]
    assert kept.long_lived.stop is not None
    _assert_same(plain, staged, expected, history)
    if stage_pays:
        assert history.history["stage_unstaged"] == [0, 0, 1, 0, 0, 0]
        # Epochs 1, 2, then 4 to 6 on one.
        assert made.count("train") == 3
    else:
        assert history.history["stage_unstaged"] == [0, 0, 1, 1, 1, 1]
        assert made.count("train") == 2


def test_a_trial_ruled_out_by_the_first_epoch_leaves_one_more_iterator(
    monkeypatch,
):
    # On the adaptive pool the trial waits for the second staged epoch (the
    # first on the resized pool); a trace that would outweigh every epoch
    # left already rules it out after the first, so the second epoch does
    # not end its iterator: epoch 1 alone, then epochs 2 to 6 on one.
    monkeypatch.setattr(epoch_switch, "TRIAL_WAIT_RATIO", float("inf"))
    monkeypatch.setattr(epoch_switch, "TRACE_SHARE", 0.0)
    plain, staged = _models()
    expected = _plain_fit(plain)
    made = _iterators_noted(staged)
    history = _fit(staged)
    assert staged._keras_stage_state.stages["train"].long_lived.stop is not None
    _assert_same(plain, staged, expected, history)
    assert history.history["stage_unstaged"] == [0] * 6
    assert made.count("train") == 2
    # Validation, whose pool nothing resizes, reads one iterator.
    assert made.count("test") == 1


# -- the switch's arithmetic, on epochs timed by hand ----------------------


class _NoWait:
    """Stage stats whose step never waited."""

    def snapshot(self):
        return {"wait_seconds": 0.0}


def _switch(model, epochs=6, shares_iterator=True):
    """An `EpochSwitch` whose trial waits for two staged epochs."""
    return epoch_switch.EpochSwitch(
        model,
        "stage",
        epochs,
        _NoWait(),
        staged_before_trial=2,
        shares_iterator=shares_iterator,
    )


def _timed_switch(model, epochs, shares_iterator, staged, trial):
    """An `EpochSwitch` that read two staged epochs and a trial.

    `staged`: the two staged epochs' `(made_seconds, step_seconds)`;
    `trial`: the trial's. Every epoch reads 8 steps. Returns the switch
    and what it decides the next epoch runs.
    """
    switch = _switch(model, epochs, shares_iterator)
    for mode, (made, step) in [
        (epoch_switch.STAGED, staged[0]),
        (epoch_switch.STAGED, staged[1]),
        (epoch_switch.UNSTAGED, trial),
    ]:
        assert switch.next_mode() == mode
        clock = switch.begin(mode, made)
        for _ in range(epoch_switch.MIN_STEPS):
            clock.add(step)
    return switch, switch.next_mode()


@pytest.mark.parametrize("shares_iterator", [True, False])
def test_the_epochs_after_the_trial_are_weighed_with_the_iterators_they_make(
    shares_iterator,
):
    # A stage whose second epoch made an iterator of its own (a source
    # that draws per iterator), 1 ms steps; the whole model's steps take
    # 1.5 ms from a cheap iterator. Over the 27 epochs left, a long-lived
    # stage makes one more iterator (0.1 + 27 * 8 ms = 0.32 s against 27 *
    # 14 ms = 0.38 s unstaged): it keeps them. A stage that makes one per
    # epoch would pay 27 of them: the whole model takes them.
    _, staged = _models()
    switch, mode = _timed_switch(
        staged,
        epochs=30,
        shares_iterator=shares_iterator,
        staged=[(0.1, 0.001), (0.085, 0.001)],
        trial=(0.002, 0.0015),
    )
    expected = epoch_switch.STAGED if shares_iterator else epoch_switch.UNSTAGED
    assert mode == switch.decision == expected
    assert switch.step_seconds == (0.001, 0.0015)


def _read_staged(switch, epochs=2):
    """Reads `epochs` staged epochs of 8 steps of 1 ms, none tracing."""
    for _ in range(epochs):
        assert switch.next_mode() == epoch_switch.STAGED
        clock = switch.begin(epoch_switch.STAGED, 0.0)
        for _ in range(epoch_switch.MIN_STEPS):
            clock.add(0.001)


def test_no_trial_whose_trace_a_later_fit_still_owes():
    # A later fit's trunk's step is traced already, so its first staged
    # step shows no trace; the whole model's step is not, and what the
    # calls' decisions count it at (measured on a model with this stage,
    # less what its staged calls paid toward it) rules the trial out.
    _, staged = _models()
    calls.costs(staged).phase("train").note(whole_trace=0.5)
    switch = _switch(staged)
    _read_staged(switch)
    assert switch.next_mode() == epoch_switch.STAGED
    assert switch.decision == epoch_switch.STAGED
    assert switch.message is None  # nothing tried, nothing to report
    # Once its staged calls paid as much toward it, nothing is owed.
    learned(staged).rent["train"] = 0.5
    switch = _switch(staged)
    _read_staged(switch)
    assert switch.next_mode() == epoch_switch.UNSTAGED  # the trial
