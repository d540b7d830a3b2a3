"""Tests for keras_stage/models/adaptive.py: whether a call is staged.

`stages` and `fit_stages` decide from the costs noted on the model (or on
models with the same stage), here set by hand, so each decision is checked
without timing anything; `staged_data` and `note_work` note those costs.
The rules themselves are tests/models/call_costs_test.py's; fits that skip
their stage are tests/models/model_state_test.py's.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.layers import StagedInput
from keras_stage.models import adaptive

pytestmark = pytest.mark.timeout(120)

X = np.ones((240, 2), "float32")  # 30 batches of 8
Y = np.ones((240, 1), "float32")


def _model(middle=(), smart_stage=False, **options):
    inputs = keras.Input(shape=(2,))
    x = StagedInput(name="stage", **options)(inputs)
    for layer in middle:
        x = layer(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1, name="head")(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=smart_stage)
    return model, model.get_layer("stage")


def _note(model, phase="train", build=0.05, iterator=0.02, batch=0.001):
    """70 ms of set-up for one iterator, 1 ms of staged work a batch."""
    costs = adaptive.costs(model)
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
    first, _ = _model()
    second, _ = _model()
    other, _ = _model(capacity=3)
    assert adaptive.costs(first) is adaptive.costs(second)
    assert adaptive.costs(other) is not adaptive.costs(first)


def test_compile_looks_the_costs_up_again():
    model, _ = _model()
    before = adaptive.costs(model)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    assert adaptive.costs(model) is not before  # another stage signature


# -- stages -----------------------------------------------------------------


def test_a_call_that_cannot_repay_its_set_up_is_not_staged(caplog):
    model, layer = _model()
    _note(model)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        assert not adaptive.stages(model, layer, "train", 71)
    message = caplog.records[-1].getMessage()
    assert message.startswith(
        f"Model '{model.name}': train runs the whole model in Keras's "
        "step, unstaged: staging 71 batches can save at most 70.0 ms"
    )
    assert adaptive.stages(model, layer, "train", 72)


def test_every_iterator_a_call_makes_counts():
    model, layer = _model()
    _note(model)
    assert adaptive.stages(model, layer, "train", 100, iterators=1)
    assert not adaptive.stages(model, layer, "train", 100, iterators=3)


def test_unmeasured_phases_and_unbounded_data_are_staged():
    model, layer = _model()
    _note(model, phase="train")
    assert adaptive.stages(model, layer, "test", 2)  # test: not measured
    assert adaptive.stages(model, layer, "train", None)  # not arrays


def test_one_batch_is_never_staged():
    model, layer = _model()
    assert not adaptive.stages(model, layer, "predict", 1)


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
    model, layer = _model(**options)
    _note(model)
    assert adaptive.stages(model, layer, "predict", 1)
    assert adaptive.stages(model, layer, "train", 2)


def test_a_model_not_yet_planned_pays_its_plan_and_trace_too():
    model, layer = _model([keras.layers.Rescaling(0.5)], smart_stage=True)
    costs = _note(model)
    costs.note_plan(0.02)
    costs.note_trace("train", 0.01)
    # 70 ms of stage, 20 of plan, 10 of trace: 101 batches save 100 ms.
    assert not adaptive.stages(model, layer, "train", 101)
    assert adaptive.stages(model, layer, "train", 102)
    model.get_stage_plan()  # planned now, but not traced
    assert adaptive.stages(model, layer, "train", 82)
    assert not adaptive.stages(model, layer, "train", 81)


def test_without_smart_stage_no_plan_or_trace_is_added():
    model, layer = _model()
    costs = _note(model)
    costs.note_plan(1.0)
    costs.note_trace("train", 1.0)
    assert adaptive.stages(model, layer, "train", 72)


def test_training_that_stages_random_layers_is_always_staged():
    model, layer = _model([keras.layers.Dropout(0.5)], smart_stage=True)
    for phase in ("train", "test"):
        _note(model, phase=phase, build=10.0)
    assert adaptive.stages(model, layer, "train", 30)
    # Evaluation runs random layers as identities: it may be skipped.
    assert not adaptive.stages(model, layer, "test", 30)


# -- fit_stages -------------------------------------------------------------


def test_a_fit_whose_epochs_share_one_iterator_pays_one_set_up():
    model, layer = _model()
    _note(model)  # 3 epochs of 30 batches: 89 ms to save
    kwargs = _fit_kwargs(epochs=3)
    assert adaptive.fit_stages(model, layer, X, None, **kwargs)
    # An iterator per epoch: 50 + 3 * 20 = 110 ms of set-up.
    assert not adaptive.fit_stages(
        model, layer, X, None, long_lived=False, **kwargs
    )


def test_a_fit_is_staged_when_only_its_validation_can_pay():
    model, layer = _model()
    _note(model, phase="train", build=10.0)
    _note(model, phase="test", build=0.0, iterator=0.0)
    kwargs = _fit_kwargs()
    assert not adaptive.fit_stages(model, layer, X, None, **kwargs)
    assert adaptive.fit_stages(model, layer, X, (X, Y), **kwargs)


def test_a_fit_on_a_dataset_is_always_staged():
    model, layer = _model()
    _note(model, build=10.0)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    assert adaptive.fit_stages(model, layer, dataset, None, **_fit_kwargs())


# -- noting costs -------------------------------------------------------------


def test_staged_data_and_note_work_note_what_a_staged_call_costs():
    model, layer = _model()
    data = adaptive.staged_data(
        model, "test", layer, "test", X, Y, batch_size=8
    )
    costs = adaptive.costs(model).phase("test")
    assert costs.build_seconds > 0 and costs.iterator_seconds is None
    assert data.cost_phase == "test"
    assert data.work_before == (0.0, 0)
    batches = list(data.pipeline)  # Keras's read of one epoch
    assert len(batches) == 30
    assert costs.iterator_seconds > 0
    adaptive.note_work(model, data)
    # No SmartStage prefix: the stage of arrays computes nothing.
    assert costs.batch_seconds == 0.0
    assert costs.measured()
    data.end_call()
