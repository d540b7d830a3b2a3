"""Tests for keras_stage/models/decision/calls.py: whether a call is staged.

`CallCosts` decides from the costs noted on it, `stages` and `fit_stages`
from those noted on the model (or on models with the same stage); here
they are set by hand, so each decision is checked without timing anything.
How a call notes them is tests/models/call/measure_test.py's; fits that
skip their stage are tests/models/model_state_test.py's.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.layers import StagedInput
from keras_stage.models.decision import calls
from keras_stage.models.decision.calls import (
    CallCosts,
    Kind,
    may_skip_stage,
    shared_costs,
    stage_signature,
)
from keras_stage.models.decision.learned import learned
from keras_stage.models.model_state import state as model_state
from tests.helpers import count_step_traces, dense_staged_model

pytestmark = pytest.mark.timeout(120)

X = np.ones((240, 2), "float32")  # 30 batches of 8
Y = np.ones((240, 1), "float32")


def _measured(build=0.05, iterator=0.02, batch=0.001):
    costs = CallCosts()
    costs.note_build("train", build)
    costs.note_iterator("train", iterator)
    costs.note_work("train", batch * 10, 10, has_work=True)
    return costs


def test_call_costs_never_stage_one_batch():
    assert not CallCosts().stages("predict", 1, 1)


def test_unmeasured_or_unbounded_calls_are_staged():
    costs = CallCosts()
    assert costs.stages("train", 100, 1)  # nothing measured yet
    assert costs.stages("train", None, 1)  # not arrays
    costs.note_build("train", 0.05)
    costs.note_iterator("train", 0.02)
    # Timing off (op determinism): busy seconds are not measured.
    costs.note_work("train", 0.0, 10, has_work=True)
    assert costs.stages("train", 100, 1)


def test_untimed_staged_work_is_weighed_from_host_timed_steps():
    # Op determinism: the pipeline times nothing, the host times the steps.
    costs = CallCosts()
    costs.note_build("train", 0.05)
    costs.note_iterator("train", 0.02)
    costs.note_work("train", float("nan"), 10, has_work=True)
    assert not costs.phase("train").trial_due()  # no staged step timed yet
    # The first step (iterator, trace) is left out; too few say nothing.
    costs.note_steps("train", [1.0, 0.004, 0.004, 0.004], staged=True)
    assert costs.phase("train").staged_step_seconds is None
    costs.note_steps("train", [1.0] + [0.004] * 5, staged=True)
    assert costs.phase("train").staged_step_seconds == 0.004
    # A staged call timed: the next one runs unstaged, once, to time the
    # whole model's step.
    assert costs.phase("train").trial_due()
    assert not costs.stages("train", 100, 1)
    assert costs.decide("train", 100, 1).kind is Kind.TRIAL
    assert not costs.stages("train", 1, 1)  # one batch: never staged
    assert costs.stages("train", None, 1)  # not in memory: always staged
    assert costs.stages("test", 100, 1)  # other phases: nothing measured
    # 1 ms saved a batch against 70 ms of set-up, as for timed work.
    costs.note_steps("train", [2.0] + [0.005] * 5, staged=False)
    assert not costs.phase("train").trial_due()
    assert costs.phase("train").batch_saving() == pytest.approx(0.001)
    assert not costs.stages("train", 71, 1)
    assert costs.stages("train", 72, 1)
    # A whole model's step faster than the staged one: staging loses 1 ms
    # a batch, and says so, signed.
    costs.note_steps("train", [2.0] + [0.003] * 5, staged=False)
    assert costs.phase("train").batch_saving() == pytest.approx(-0.001)
    decision = costs.decide("train", 10_000, 1)
    assert decision.kind is Kind.DOES_NOT_PAY
    assert decision.figures["saving"] == pytest.approx(-9.999)


def test_staged_steps_slower_than_the_whole_models_lose_the_call():
    # Issue 73's op-determinism case: a criteo-like fit of 2 epochs x 60
    # batches whose staged steps (13 ms) are slower than the whole model's
    # (10 ms). Clamped at zero, that saving let Keras's 4.9 ms of epoch
    # starts outweigh 1.9 ms of set-up and every call stayed staged, at
    # 1.3x plain; signed, it loses 357 ms and the call runs unstaged.
    costs = CallCosts()
    costs.note_build("train", 0.0015)
    costs.note_iterator("train", 0.0004)
    costs.note_work("train", float("nan"), 120, has_work=True)  # untimed
    costs.note_steps("train", [1.0] + [0.013] * 5, staged=True)
    costs.note_steps("train", [1.0] + [0.010] * 5, staged=False)
    costs.phase("train").note(epoch_start=0.00245)
    decision = costs.decide("train", 120, 1, unstaged_epochs=2)
    assert decision.kind is Kind.DOES_NOT_PAY and not decision.staged
    figures = decision.figures
    assert figures["saving"] == pytest.approx(-0.357)
    assert figures["starts"] == pytest.approx(0.0049)
    assert figures["set_up"] == pytest.approx(0.0019)
    assert figures["gain"] == pytest.approx(-0.357 + 0.0049 - 0.0019)
    assert "-357.0 ms" in decision.reason


def test_untimed_staged_work_stays_staged_until_the_loops_trial():
    # Op determinism where tf.data's model cannot be read (TF 2.16): the
    # staged work is never measured, so the call is staged, unmeasured,
    # until the trial times the whole model's steps: at once where its
    # trace is a small share of the call, else by the LOOP_CALLS-th call.
    costs = CallCosts()
    costs.note_build("train", 0.05)
    costs.note_iterator("train", 0.02)
    costs.note_work("train", float("nan"), 10, has_work=True)
    costs.note_steps("train", [1.0] + [0.004] * 5, staged=True)
    # 100 steps of 4 ms allow 40 ms of trace: 50 owed keep it staged.
    decision = costs.decide("train", 100, 2, owed=0.05)
    assert decision.kind is Kind.UNMEASURED and decision.staged
    assert decision.figures == {"batches": 100}
    assert costs.decide("train", 100, 2, owed=0.04).kind is Kind.TRIAL
    while costs.phase("train").staged_calls < calls.LOOP_CALLS:
        costs.note_work("train", float("nan"), 10, has_work=True)
    assert costs.decide("train", 100, 2, owed=10.0).kind is Kind.TRIAL


def test_host_timed_steps_bound_the_timed_work():
    # The staged work per batch bounds what a stage saves; on busy cores
    # the steps, timed staged and unstaged, may show it saves less.
    costs = _measured(batch=0.002)
    costs.note_steps("train", [1.0] + [0.004] * 5, staged=True)
    assert costs.phase("train").trial_due()  # the whole model untimed
    assert not costs.stages("train", 10_000, 1)
    costs.note_steps("train", [1.0] + [0.0045] * 5, staged=False)
    assert costs.phase("train").batch_saving() == pytest.approx(0.0005)
    costs.note_steps("train", [1.0] + [0.009] * 5, staged=False)
    assert costs.phase("train").batch_saving() == 0.002  # the work bounds
    assert costs.stages("train", 10_000, 1)


def _timed(build=0.05, iterator=0.02, batch=0.001, step=0.004):
    """`_measured`, its staged steps timed (`step` s each): a trial due."""
    costs = _measured(build=build, iterator=iterator, batch=batch)
    costs.note_steps("train", [1.0] + [step] * 5, staged=True)
    return costs


def test_one_slow_build_or_iterator_does_not_flip_the_decision():
    # The same work gets the same decision: set-up costs are the medians
    # of the last few measured, so a busy moment is outvoted.
    costs = _measured(build=0.05, iterator=0.02)  # 70 ms of set-up
    costs.note_build("train", 0.05)
    costs.note_iterator("train", 0.02)
    decisions = [costs.stages("train", 72, 1)]
    costs.note_build("train", 5.0)  # once, a hundred times slower
    costs.note_iterator("train", 2.0)
    decisions.append(costs.stages("train", 72, 1))
    assert decisions == [True, True]
    assert costs.phase("train").cost(1) == pytest.approx(0.07)
    # Measured slower again and again, it is slower.
    for _ in range(2):
        costs.note_build("train", 5.0)
        costs.note_iterator("train", 2.0)
    assert not costs.stages("train", 72, 1)


def test_a_trial_runs_only_where_tracing_the_whole_step_costs_little():
    # 100 batches of 4 ms: a trial may add 40 ms of tracing.
    costs = _timed()
    assert costs.phase("train").trial_due()
    assert not costs.stages("train", 100, 1, owed=0.04)
    assert costs.decide("train", 100, 1, owed=0.04).kind is Kind.TRIAL
    # More is owed: no trial; the call is weighed with the trace counted
    # against running unstaged (99 ms of work and 41 of trace > 70 ms).
    assert costs.stages("train", 100, 1, owed=0.041)
    decision = costs.decide("train", 100, 1, owed=0.041)
    assert decision.kind is Kind.PAYS
    assert decision.figures["owed"] == 0.041
    # Owed or not, a call that cannot repay its stage runs unstaged.
    assert not costs.stages("train", 20, 1, owed=0.041)
    # Calls that repeat repay the trace: by the phase's LOOP_CALLS-th
    # staged call the trial runs whatever is owed.
    assert costs.phase("train").staged_calls == 1
    while costs.phase("train").staged_calls < calls.LOOP_CALLS:
        assert costs.stages("train", 100, 1, owed=10.0)
        costs.note_work("train", 0.01, 10, has_work=True)
    decision = costs.decide("train", 100, 1, owed=10.0)
    assert not decision.staged and decision.trial


def test_the_whole_steps_trace_counts_against_running_unstaged():
    costs = _measured()  # 70 ms of set-up, 1 ms saved a batch
    assert not costs.stages("train", 71, 1)
    # 30 ms of tracing the whole step make 41 batches worth staging.
    assert not costs.stages("train", 40, 1, owed=0.03)
    assert costs.stages("train", 42, 1, owed=0.03)
    # A call that would compile the trunk's step pays that trace too: its
    # Python's until its first call is timed, then that call (its trace,
    # graph set-up, first step and first batch).
    costs.phase("train").note(step_trace=0.02)
    assert not costs.stages("train", 42, 1, owed=0.03, compiles=True)
    assert costs.stages("train", 62, 1, owed=0.03, compiles=True)
    costs.phase("train").note(step_call=0.05)
    assert not costs.stages("train", 62, 1, owed=0.03, compiles=True)
    assert costs.stages("train", 92, 1, owed=0.03, compiles=True)
    # The whole step's first call is estimated from the trunk's first call
    # once that is timed (its Python's trace alone would leave out the
    # graph's set-up, often the larger part).
    assert costs.whole_trace("train") == pytest.approx(0.05)


def test_the_epochs_keras_would_start_unstaged_count_against_it():
    # Unstaged, Keras makes each epoch's iterator of the data (for arrays,
    # a shuffled, sliced pipeline); a stage's epochs on one iterator make
    # one in all. Once an unstaged fit timed those starts, a fit's epochs
    # weigh them.
    costs = CallCosts()  # 70 ms of set-up, no staged work to overlap
    costs.note_build("train", 0.05)
    costs.note_iterator("train", 0.02)
    costs.note_work("train", 0.0, 10, has_work=False)
    assert costs.phase("train").epoch_start_seconds is None
    assert not costs.stages("train", 240, 1, unstaged_epochs=8)
    costs.phase("train").note(epoch_start=0.012)
    decision = costs.decide("train", 240, 1, unstaged_epochs=8)
    assert decision.staged  # 96 ms of epoch starts > 70 ms of set-up
    assert decision.figures["starts"] == pytest.approx(0.096)
    assert decision.figures["epochs"] == 8
    assert decision.gain == pytest.approx(0.096 - 0.07)
    costs.phase("train").note(epoch_start=0.002, build=0.05)
    costs.phase("train").note(epoch_start=0.002, build=0.05)
    # Medians of 0.012, 0.002, 0.002: 16 ms of starts, less than the set-up.
    decision = costs.decide("train", 240, 1, unstaged_epochs=8, owed=0.1)
    assert decision.staged
    assert decision.gain == pytest.approx(0.1 + 0.016 - 0.07)
    # Fewer epochs, or a stage that makes an iterator per epoch too.
    assert not costs.stages("train", 240, 1, unstaged_epochs=5)
    decision = costs.decide("train", 30, 1, unstaged_epochs=1)
    assert decision.figures["starts"] == pytest.approx(0.002)
    assert not costs.stages("train", 240, 8, unstaged_epochs=8)
    assert not costs.stages("train", 240, 1)  # an evaluate: one either way


def test_the_whole_steps_trace_is_measured_or_estimated():
    costs = _measured()
    costs.note_trace("test", 0.03)  # the prefix, traced for inference
    costs.phase("train").note(step_trace=0.2)  # the trunk's step
    assert costs.whole_trace("train") == pytest.approx(0.23)
    # Once the whole model's step was traced, as long as that took.
    costs.phase("train").note(whole_trace=0.49)
    assert costs.whole_trace("train") == pytest.approx(0.49)
    # The median of the last few: one slow trace does not move it.
    for seconds in (0.5, 0.51, 3.0):
        costs.phase("train").note(whole_trace=seconds)
    assert costs.whole_trace("train") == pytest.approx(0.505)


def test_an_unmeasured_predict_is_weighed_by_the_test_stage():
    costs = CallCosts()
    assert costs.stages("predict", 50, 1)  # nothing measured
    costs.note_build("test", 0.05)
    costs.note_iterator("test", 0.02)
    costs.note_work("test", 0.01, 10, has_work=True)
    assert costs.measured_like("predict") is costs.phase("test")
    assert not costs.stages("predict", 50, 1)
    assert costs.stages("predict", 72, 1)
    # Once its own stage is measured, predict's own costs count.
    costs.note_build("predict", 0.5)
    costs.note_iterator("predict", 0.02)
    costs.note_work("predict", 0.01, 10, has_work=True)
    assert not costs.stages("predict", 72, 1)


def test_a_call_is_staged_only_when_its_work_can_repay_the_set_up():
    costs = _measured(build=0.05, iterator=0.02, batch=0.001)
    # 70 ms of set-up: 71 batches of 1 ms can save 70 ms, 72 can save 71.
    assert not costs.stages("train", 71, 1)
    assert costs.stages("train", 72, 1)
    # Each epoch's iterator counts: 4 epochs cost 130 ms.
    assert not costs.stages("train", 120, 4)
    assert costs.stages("train", 140, 4)
    assert costs.decide("train", 71, 1).kind is Kind.DOES_NOT_PAY
    assert costs.decide("train", 72, 1).kind is Kind.PAYS


def test_a_stage_that_computes_nothing_on_arrays_has_nothing_to_save():
    costs = CallCosts()
    costs.note_build("test", 0.01)
    costs.note_iterator("test", 0.001)
    costs.note_work("test", 0.0, 0, has_work=False)
    assert not costs.stages("test", 1000, 1)


@pytest.mark.parametrize("phase", ["train", "test", "predict"])
def test_phases_are_measured_apart(phase):
    costs = _measured()
    assert costs.stages(phase, 50, 1) == (phase != "train")


@pytest.mark.parametrize(
    "options, skippable",
    [
        ({}, True),
        ({"adaptive": False}, False),
        ({"ignored_exception_types": (tf.errors.DataLossError,)}, False),
        ({"closed_exception_types": (StopIteration,)}, False),
        ({"service": "grpc://localhost:5050"}, False),
    ],
)
def test_only_calls_whose_stage_changes_nothing_but_speed_may_skip_it(
    options, skippable
):
    layer = keras_stage.layers.StagedInput(**options)
    assert may_skip_stage(layer) is skippable


def test_a_model_that_plans_and_traces_first_pays_for_both():
    costs = _measured(build=0.05, iterator=0.02, batch=0.001)
    costs.note_plan(0.1)
    costs.note_trace("train", 0.04)
    # 70 ms of set-up; + 100 ms of plan; + 40 ms of trace.
    assert costs.stages("train", 100, 1)
    assert not costs.stages("train", 100, 1, plans=True)
    assert costs.stages("train", 200, 1, plans=True)
    assert not costs.stages("train", 200, 1, plans=True, traces=True)
    assert costs.stages("train", 220, 1, plans=True, traces=True)


def _tabular(width=8, capacity=2, vocabulary=("a", "b", "c")):
    inputs = {
        "num": keras.Input(shape=(1,), name="num"),
        "cat": keras.Input(shape=(1,), dtype="string", name="cat"),
    }
    x = keras_stage.layers.StagedInput(capacity=capacity)(inputs)
    norm = keras.layers.Normalization()
    norm.adapt(np.arange(10, dtype="float32").reshape(-1, 1))
    lookup = keras.layers.StringLookup(
        vocabulary=list(vocabulary), output_mode="one_hot"
    )
    features = keras.layers.Concatenate()([norm(x["num"]), lookup(x["cat"])])
    hidden = keras.layers.Dense(width)(features)
    return keras_stage.Model(inputs, keras.layers.Dense(1)(hidden))


def test_models_with_the_same_stage_share_a_signature():
    signature = stage_signature(_tabular(), True)
    # Another model like it (new layer names), or a wider trunk: the same.
    assert stage_signature(_tabular(), True) == signature
    assert stage_signature(_tabular(width=16), True) == signature
    # Other StagedInput options, smart_stage or staged state: another one.
    assert stage_signature(_tabular(capacity=4), True) != signature
    assert stage_signature(_tabular(), False) != signature
    assert stage_signature(_tabular(), "longest") != signature
    assert shared_costs(signature) is shared_costs(signature)
    assert shared_costs(signature) is not shared_costs(
        stage_signature(_tabular(capacity=4), True)
    )


def _note(model, phase="train", build=0.05, iterator=0.02, batch=0.001):
    """70 ms of set-up for one iterator, 1 ms of staged work a batch."""
    costs = calls.costs(model)
    costs.note_build(phase, build)
    costs.note_iterator(phase, iterator)
    costs.note_work(phase, batch * 10, 10, has_work=True)
    return costs


def _fit_kwargs(epochs=1, **overrides):
    kwargs = dict(
        batch_size=8,
        epochs=epochs,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
    )
    kwargs.update(overrides)
    return kwargs


# -- costs ------------------------------------------------------------------


def test_models_with_the_same_stage_share_their_costs():
    first, _ = dense_staged_model()
    second, _ = dense_staged_model()
    other, _ = dense_staged_model(capacity=3)
    assert calls.costs(first) is calls.costs(second)
    assert calls.costs(other) is not calls.costs(first)


def test_compile_looks_the_costs_up_again():
    model, _ = dense_staged_model()
    before = calls.costs(model)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    assert calls.costs(model) is not before  # another stage signature


# -- stages -----------------------------------------------------------------


def test_a_call_that_cannot_repay_its_set_up_is_not_staged(caplog):
    model, layer = dense_staged_model()
    _note(model)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        assert not calls.stages(model, layer, "train", 71)
    message = caplog.records[-1].getMessage()
    assert message.startswith(
        f"Model '{model.name}': train runs the whole model in Keras's "
        "step, unstaged [does_not_pay]: staging 71 batches saves +70.0 ms"
    )
    assert calls.stages(model, layer, "train", 72)


def test_every_iterator_a_call_makes_counts():
    model, layer = dense_staged_model()
    _note(model)
    assert calls.stages(model, layer, "train", 100, iterators=1)
    assert not calls.stages(model, layer, "train", 100, iterators=3)


def test_unmeasured_phases_and_unbounded_data_are_staged():
    model, layer = dense_staged_model()
    _note(model, phase="train")
    assert calls.stages(model, layer, "test", 2)  # test: not measured
    assert calls.stages(model, layer, "train", None)  # not arrays


@pytest.mark.first_call_rule
def test_a_first_call_of_few_in_memory_batches_skips_its_stage():
    # Nothing measured on a model with its stage: the first call of a
    # phase of at most FIRST_CALL_BATCHES batches from in-memory data runs
    # unstaged (what plain Keras costs), without planning the model; a
    # longer one, or the next short one (a loop of calls), is staged and
    # measured; data read by a pipeline is always staged.
    model, layer = dense_staged_model(
        [keras.layers.Rescaling(0.5)], smart_stage=True
    )
    few = calls.FIRST_CALL_BATCHES
    assert few == 32
    for phase in ("train", "test", "predict"):
        assert calls.stages(model, layer, phase, few + 1)
        assert calls.stages(model, layer, phase, None)
        assert calls.costs(model).decide(phase, few, 1).first_call
        assert not calls.stages(model, layer, phase, few)
        decision = learned(model).decisions[phase]
        assert decision.kind is Kind.FIRST_CALL
        assert decision.figures == {"batches": 32}
        assert not calls.costs(model).decide(phase, few, 1).first_call
        assert calls.stages(model, layer, phase, few)
        assert _kind(model, phase) is Kind.UNMEASURED
    assert model_state(model).plan is None
    # Once a model with this stage is measured, its costs decide instead.
    _note(model, phase="train")
    decision = calls.costs(model).decide("train", few, 1)
    assert decision.kind in (Kind.PAYS, Kind.DOES_NOT_PAY)


@pytest.mark.first_call_rule
def test_a_first_fit_of_few_batches_trains_unstaged_as_plain_keras(
    monkeypatch,
):
    # The README's case: a first fit on a few in-memory batches runs the
    # whole model in Keras's step, unplanned, to plain Keras's weights.
    # Its step is traced once: the optimizer is built before (Keras builds
    # Adam's slots inside the first trace, which makes TensorFlow trace it
    # twice).
    traced = count_step_traces(monkeypatch)

    def build(model_class, staged):
        keras.utils.set_random_seed(4)
        inputs = keras.Input(shape=(2,))
        x = StagedInput(name="stage")(inputs) if staged else inputs
        x = keras.layers.Rescaling(0.5)(x)
        model = model_class(inputs, keras.layers.Dense(1, name="head")(x))
        kwargs = {"smart_stage": True} if staged else {}
        model.compile(optimizer="adam", loss="mse", **kwargs)
        return model

    staged = build(keras_stage.Model, True)
    plain = build(keras.Model, False)
    histories = []
    for model in (staged, plain):
        keras.utils.set_random_seed(5)
        histories.append(
            model.fit(X, Y, batch_size=16, epochs=2, verbose=0).history
        )
    assert histories[0]["stage_unstaged"] == [1.0, 1.0]
    assert histories[0]["loss"] == pytest.approx(histories[1]["loss"])
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert model_state(staged).plan is None  # nothing planned
    assert traced == [(staged.name, "train")]
    assert [v.name for v in staged.optimizer.variables] == [
        v.name for v in plain.optimizer.variables
    ]


def test_one_batch_is_never_staged():
    model, layer = dense_staged_model()
    assert not calls.stages(model, layer, "predict", 1)


@pytest.mark.parametrize(
    "options",
    [
        {"adaptive": False},
        {"ignored_exception_types": (tf.errors.InvalidArgumentError,)},
        {
            "closed_exception_types": (
                tf.errors.OutOfRangeError,
                tf.errors.DataLossError,
            )
        },
    ],
    ids=["adaptive_false", "ignored", "closed"],
)
def test_calls_whose_stage_changes_more_than_speed_are_always_staged(
    options,
):
    model, layer = dense_staged_model(**options)
    _note(model)
    assert calls.stages(model, layer, "predict", 1)
    assert calls.stages(model, layer, "train", 2)


def test_a_model_not_yet_planned_pays_its_plan_and_trace_too():
    model, layer = dense_staged_model(
        [keras.layers.Rescaling(0.5)], smart_stage=True
    )
    costs = _note(model)
    costs.note_plan(0.02)
    costs.note_trace("train", 0.01)
    # 70 ms of stage, 20 of plan, 10 of trace against, unstaged, tracing
    # the whole step (at least the prefix's 10 ms): 91 batches save 90 ms.
    assert not calls.stages(model, layer, "train", 91)
    assert calls.stages(model, layer, "train", 92)
    model.get_stage_plan()  # planned now, but not traced
    assert not calls.stages(model, layer, "train", 71)
    assert calls.stages(model, layer, "train", 72)


def test_without_smart_stage_no_plan_or_trace_is_added():
    model, layer = dense_staged_model()
    costs = _note(model)
    costs.note_plan(1.0)
    costs.note_trace("train", 1.0)
    assert calls.stages(model, layer, "train", 72)


def test_training_that_stages_random_layers_is_always_staged():
    model, layer = dense_staged_model(
        [keras.layers.Dropout(0.5)], smart_stage=True
    )
    for phase in ("train", "test"):
        _note(model, phase=phase, build=10.0)
    assert calls.stages(model, layer, "train", 30)
    # Evaluation runs random layers as identities: it may be skipped.
    assert not calls.stages(model, layer, "test", 30)


# -- fit_stages -------------------------------------------------------------


def test_a_fit_whose_epochs_share_one_iterator_pays_one_set_up():
    model, layer = dense_staged_model()
    _note(model)  # 3 epochs of 30 batches: 89 ms to save
    kwargs = _fit_kwargs(epochs=3)
    assert calls.fit_stages(model, layer, X, None, **kwargs)
    # An iterator per epoch: 50 + 3 * 20 = 110 ms of set-up.
    assert not calls.fit_stages(
        model, layer, X, None, long_lived=False, **kwargs
    )


def test_a_fit_is_staged_when_its_validation_gains_more_than_training_loses():
    # A staged fit stages both phases. Its training alone loses 21 ms (29
    # batches of 1 ms of staged work against 50 ms of set-up); a free
    # validation stage gains its 29 ms: staged, and both halves are said.
    model, layer = dense_staged_model()
    _note(model, phase="train", build=0.03)
    _note(model, phase="test", build=0.0, iterator=0.0)
    kwargs = _fit_kwargs()
    assert not calls.fit_stages(model, layer, X, None, **kwargs)
    assert calls.fit_stages(model, layer, X, (X, Y), **kwargs)
    decision = _decision(model)
    assert decision.kind is Kind.VALIDATION_PAYS
    assert decision.figures["training"].kind is Kind.DOES_NOT_PAY
    assert decision.figures["training"].gain == pytest.approx(-0.021)
    assert decision.figures["validation"].kind is Kind.PAYS
    # A training that loses 10 s is not staged for its validation's 29 ms.
    model, layer = dense_staged_model(capacity=3)
    _note(model, phase="train", build=10.0)
    _note(model, phase="test", build=0.0, iterator=0.0)
    assert not calls.fit_stages(model, layer, X, (X, Y), **kwargs)
    assert _kind(model, "test") is Kind.TRAINING_LOSES
    assert _kind(model) is Kind.DOES_NOT_PAY
    # Nor for a validation in memory not measured yet.
    model, layer = dense_staged_model(capacity=4)
    _note(model, phase="train", build=0.03)
    assert not calls.fit_stages(model, layer, X, (X, Y), **kwargs)


def test_a_fit_whose_training_is_due_a_trial_runs_it_whatever_its_validation():
    model, layer = dense_staged_model()
    costs = _note(model, phase="train")
    costs.note_steps("train", [1.0] + [0.004] * 5, staged=True)
    _note(model, phase="test", build=0.0, iterator=0.0)
    assert costs.phase("train").trial_due()
    assert not calls.fit_stages(model, layer, X, (X, Y), **_fit_kwargs())
    assert _kind(model) is Kind.TRIAL


def test_a_fit_on_a_dataset_that_maps_is_always_staged():
    model, layer = dense_staged_model()
    _note(model, build=10.0)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    mapped = dataset.map(lambda x, y: (x * 2, y))
    assert calls.fit_stages(model, layer, mapped, None, **_fit_kwargs())


def test_a_fit_on_a_dataset_in_memory_is_decided_as_arrays_are():
    # Slicing and batching tensors in memory: nothing for the stage to
    # overlap but its staged work, which cannot repay a 10 s set-up.
    model, layer = dense_staged_model()
    _note(model, build=10.0)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(8).batch(8)
    assert not calls.fit_stages(model, layer, dataset, None, **_fit_kwargs())
    # Unknown length (a filter runs a function, too): staged.
    kept = dataset.unbatch().filter(lambda x, y: True).batch(8)
    assert calls.fit_stages(model, layer, kept, None, **_fit_kwargs())


def _decision(model, phase="train"):
    return learned(model).decisions[phase]


def _kind(model, phase="train"):
    return _decision(model, phase).kind


def test_the_decision_says_why_a_call_on_a_dataset_keeps_its_stage():
    model, layer = dense_staged_model()
    _note(model, build=10.0)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    unknown = dataset.unbatch().filter(lambda x, y: True).batch(8)
    assert int(unknown.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    assert calls.fit_stages(model, layer, unknown, None, **_fit_kwargs())
    decision = _decision(model)
    assert decision.kind is Kind.UNBOUNDED
    assert decision.figures["unknown_length"]
    assert "length is unknown" in decision.reason
    mapped = dataset.map(lambda x, y: (x * 2, y))
    assert calls.fit_stages(model, layer, mapped, None, **_fit_kwargs())
    decision = _decision(model)
    assert not decision.figures["unknown_length"]
    assert decision.figures["maps"]
    assert "runs functions or reads files" in decision.reason
    assert not calls.fit_stages(model, layer, dataset, None, **_fit_kwargs())
    assert _kind(model) is Kind.DOES_NOT_PAY  # measured: cannot repay


@pytest.mark.timeout(120)
# Keras warns as it ends each epoch after the first of a dataset of unknown
# length (plain Keras too).
@pytest.mark.filterwarnings("ignore:Your input ran out of data:UserWarning")
def test_the_verdict_says_why_the_fit_was_staged():
    model, _ = dense_staged_model(smart_stage=True)
    unknown = tf.data.Dataset.from_tensor_slices((X, Y))
    unknown = unknown.filter(lambda x, y: True).batch(8)
    callback = keras_stage.callbacks.PrefetchCallback()
    fit = {"verbose": 0, "shuffle": False, "callbacks": [callback]}
    model.fit(unknown, epochs=1, **fit)
    assert "length is unknown" in callback.verdict["call"]
    assert (
        "The call is staged: its dataset's length is unknown"
        in (callback.verdict["message"])
    )
    # Said in the call's first epoch's message only; `call` in every one.
    model.fit(unknown, epochs=2, **fit)
    assert "length is unknown" in callback.verdict["call"]
    assert "The call is staged" not in callback.verdict["message"]
