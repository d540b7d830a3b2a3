"""Tests for keras_stage/models/call/facts.py: what a call is decided from.

`stages` and `fit_stages` decide from the model's state, the call's data
and the costs noted on the model (or on models with the same stage); here
the costs are set by hand, so each decision is checked without timing
anything. The policy's own rules are tests/models/decision/calls_test.py's;
fits that skip their stage are tests/models/model_state_test.py's.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.layers import StagedInput
from keras_stage.models.call import facts
from keras_stage.models.call.facts import may_skip_stage, stage_signature
from keras_stage.models.decision import calls
from keras_stage.models.decision.calls import Kind, shared_costs
from keras_stage.models.decision.learned import learned
from keras_stage.models.model_state import state as model_state
from tests.helpers import count_step_traces, dense_staged_model

pytestmark = pytest.mark.timeout(120)

X = np.ones((240, 2), "float32")  # 30 batches of 8
Y = np.ones((240, 1), "float32")


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
    costs = facts.costs(model)
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
    assert facts.costs(first) is facts.costs(second)
    assert facts.costs(other) is not facts.costs(first)


def test_compile_looks_the_costs_up_again():
    model, _ = dense_staged_model()
    before = facts.costs(model)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    assert facts.costs(model) is not before  # another stage signature


# -- stages -----------------------------------------------------------------


def test_a_call_that_cannot_repay_its_set_up_is_not_staged(caplog):
    model, layer = dense_staged_model()
    _note(model)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        assert not facts.stages(model, layer, "train", 71)
    message = caplog.records[-1].getMessage()
    assert message.startswith(
        f"Model '{model.name}': train runs the whole model in Keras's "
        "step, unstaged [does_not_pay]: staging 71 batches saves +70.0 ms"
    )
    assert facts.stages(model, layer, "train", 72)


def test_every_iterator_a_call_makes_counts():
    model, layer = dense_staged_model()
    _note(model)
    assert facts.stages(model, layer, "train", 100, iterators=1)
    assert not facts.stages(model, layer, "train", 100, iterators=3)


def test_unmeasured_phases_and_unbounded_data_are_staged():
    model, layer = dense_staged_model()
    _note(model, phase="train")
    assert facts.stages(model, layer, "test", 2)  # test: not measured
    assert facts.stages(model, layer, "train", None)  # not arrays


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
        assert facts.stages(model, layer, phase, few + 1)
        assert facts.stages(model, layer, phase, None)
        assert facts.costs(model).decide(phase, few, 1).first_call
        assert not facts.stages(model, layer, phase, few)
        decision = learned(model).decisions[phase]
        assert decision.kind is Kind.FIRST_CALL
        assert decision.figures == {"batches": 32}
        assert not facts.costs(model).decide(phase, few, 1).first_call
        assert facts.stages(model, layer, phase, few)
        assert _kind(model, phase) is Kind.UNMEASURED
    assert model_state(model).plan is None
    # Once a model with this stage is measured, its costs decide instead.
    _note(model, phase="train")
    decision = facts.costs(model).decide("train", few, 1)
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
    assert not facts.stages(model, layer, "predict", 1)


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
    assert facts.stages(model, layer, "predict", 1)
    assert facts.stages(model, layer, "train", 2)


def test_a_model_not_yet_planned_pays_its_plan_and_trace_too():
    model, layer = dense_staged_model(
        [keras.layers.Rescaling(0.5)], smart_stage=True
    )
    costs = _note(model)
    costs.note_plan(0.02)
    costs.note_trace("train", 0.01)
    # 70 ms of stage, 20 of plan, 10 of trace against, unstaged, tracing
    # the whole step (at least the prefix's 10 ms): 91 batches save 90 ms.
    assert not facts.stages(model, layer, "train", 91)
    assert facts.stages(model, layer, "train", 92)
    model.get_stage_plan()  # planned now, but not traced
    assert not facts.stages(model, layer, "train", 71)
    assert facts.stages(model, layer, "train", 72)


def test_without_smart_stage_no_plan_or_trace_is_added():
    model, layer = dense_staged_model()
    costs = _note(model)
    costs.note_plan(1.0)
    costs.note_trace("train", 1.0)
    assert facts.stages(model, layer, "train", 72)


def test_training_that_stages_random_layers_is_always_staged():
    model, layer = dense_staged_model(
        [keras.layers.Dropout(0.5)], smart_stage=True
    )
    for phase in ("train", "test"):
        _note(model, phase=phase, build=10.0)
    assert facts.stages(model, layer, "train", 30)
    # Evaluation runs random layers as identities: it may be skipped.
    assert not facts.stages(model, layer, "test", 30)


# -- fit_stages -------------------------------------------------------------


def test_a_fit_whose_epochs_share_one_iterator_pays_one_set_up():
    model, layer = dense_staged_model()
    _note(model)  # 3 epochs of 30 batches: 89 ms to save
    kwargs = _fit_kwargs(epochs=3)
    assert facts.fit_stages(model, layer, X, None, **kwargs)
    # An iterator per epoch: 50 + 3 * 20 = 110 ms of set-up.
    assert not facts.fit_stages(
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
    assert not facts.fit_stages(model, layer, X, None, **kwargs)
    assert facts.fit_stages(model, layer, X, (X, Y), **kwargs)
    decision = _decision(model)
    assert decision.kind is Kind.VALIDATION_PAYS
    assert decision.figures["training"].kind is Kind.DOES_NOT_PAY
    assert decision.figures["training"].gain == pytest.approx(-0.021)
    assert decision.figures["validation"].kind is Kind.PAYS
    # A training that loses 10 s is not staged for its validation's 29 ms.
    model, layer = dense_staged_model(capacity=3)
    _note(model, phase="train", build=10.0)
    _note(model, phase="test", build=0.0, iterator=0.0)
    assert not facts.fit_stages(model, layer, X, (X, Y), **kwargs)
    assert _kind(model, "test") is Kind.TRAINING_LOSES
    assert _kind(model) is Kind.DOES_NOT_PAY
    # Nor for a validation in memory not measured yet.
    model, layer = dense_staged_model(capacity=4)
    _note(model, phase="train", build=0.03)
    assert not facts.fit_stages(model, layer, X, (X, Y), **kwargs)


def test_a_fit_whose_training_is_due_a_trial_runs_it_whatever_its_validation():
    model, layer = dense_staged_model()
    costs = _note(model, phase="train")
    costs.note_steps("train", [1.0] + [0.004] * 5, staged=True)
    _note(model, phase="test", build=0.0, iterator=0.0)
    assert costs.phase("train").trial_due()
    assert not facts.fit_stages(model, layer, X, (X, Y), **_fit_kwargs())
    assert _kind(model) is Kind.TRIAL


def test_a_fit_on_a_dataset_that_maps_is_always_staged():
    model, layer = dense_staged_model()
    _note(model, build=10.0)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    mapped = dataset.map(lambda x, y: (x * 2, y))
    assert facts.fit_stages(model, layer, mapped, None, **_fit_kwargs())


def test_a_fit_on_a_dataset_in_memory_is_decided_as_arrays_are():
    # Slicing and batching tensors in memory: nothing for the stage to
    # overlap but its staged work, which cannot repay a 10 s set-up.
    model, layer = dense_staged_model()
    _note(model, build=10.0)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(8).batch(8)
    assert not facts.fit_stages(model, layer, dataset, None, **_fit_kwargs())
    # Unknown length (a filter runs a function, too): staged.
    kept = dataset.unbatch().filter(lambda x, y: True).batch(8)
    assert facts.fit_stages(model, layer, kept, None, **_fit_kwargs())


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
    assert facts.fit_stages(model, layer, unknown, None, **_fit_kwargs())
    decision = _decision(model)
    assert decision.kind is Kind.UNBOUNDED
    assert decision.figures["unknown_length"]
    assert "length is unknown" in decision.reason
    mapped = dataset.map(lambda x, y: (x * 2, y))
    assert facts.fit_stages(model, layer, mapped, None, **_fit_kwargs())
    decision = _decision(model)
    assert not decision.figures["unknown_length"]
    assert decision.figures["maps"]
    assert "runs functions or reads files" in decision.reason
    assert not facts.fit_stages(model, layer, dataset, None, **_fit_kwargs())
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
