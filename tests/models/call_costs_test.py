"""Tests for keras_stage/models/call_costs.py: when a call skips its stage."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.models.call_costs import (
    CallCosts,
    array_batches,
    fit_batches,
    may_skip_stage,
    shared_costs,
    stage_signature,
)


def _measured(build=0.05, iterator=0.02, batch=0.001):
    costs = CallCosts()
    costs.note_build("train", build)
    costs.note_iterator("train", iterator)
    costs.note_work("train", batch * 10, 10, has_work=True)
    return costs


def test_array_batches_counts_the_batches_keras_makes():
    x = {"a": np.zeros((100, 3)), "b": np.zeros((100,))}
    assert array_batches(x, 32, None) == 4  # Keras's last batch is partial
    assert array_batches(x, None, None) == 4  # Keras's default of 32
    assert array_batches(np.zeros((8, 2)), 8, None) == 1
    assert array_batches(tf.zeros((10, 2)), 4, None) == 3
    assert array_batches(x, 32, 2) == 2  # `steps` bounds the call


def test_array_batches_is_none_for_data_a_stage_may_overlap():
    dataset = tf.data.Dataset.range(10).batch(2)
    assert array_batches(dataset, None, None) is None
    assert array_batches(dataset, None, 5) is None
    assert array_batches((i for i in range(3)), None, None) is None
    assert array_batches(None, None, None) is None


def test_one_batch_is_never_staged():
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


def test_a_call_is_staged_only_when_its_work_can_repay_the_set_up():
    costs = _measured(build=0.05, iterator=0.02, batch=0.001)
    # 70 ms of set-up: 71 batches of 1 ms can save 70 ms, 72 can save 71.
    assert not costs.stages("train", 71, 1)
    assert costs.stages("train", 72, 1)
    # Each epoch's iterator counts: 4 epochs cost 130 ms.
    assert not costs.stages("train", 120, 4)
    assert costs.stages("train", 140, 4)
    assert "can save at most" in costs.describe("train", 71, 1)
    assert "can save up to" in costs.describe("train", 72, 1)


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


def test_fit_batches_counts_epochs_and_validation_runs_as_keras_runs_them():
    x, val = np.zeros((100, 2)), (np.zeros((40, 2)), np.zeros((40, 1)))
    kwargs = dict(
        batch_size=10,
        epochs=5,
        initial_epoch=1,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=2,
    )
    # Epochs 1..4 train; epochs 2 and 4 (1-based) validate.
    assert fit_batches(x, val, **kwargs) == ((40, 4), (8, 2))
    assert fit_batches(x, None, **kwargs) == ((40, 4), (None, 0))
    kwargs.update(validation_freq=[1, 5], validation_batch_size=20)
    assert fit_batches(x, val, **kwargs) == ((40, 4), (2, 1))
    dataset = tf.data.Dataset.range(3)
    assert fit_batches(dataset, None, **kwargs)[0] == (None, 4)


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
