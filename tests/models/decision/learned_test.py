"""Tests for keras_stage/models/decision/learned.py: the policy's record."""

import keras
import numpy as np
import pytest

import keras_stage
from keras_stage.layers import StagedInput
from keras_stage.models.call import facts
from keras_stage.models.decision import calls
from keras_stage.models.decision.learned import Learned, forget, learned


def _model():
    inputs = keras.Input((2,))
    x = StagedInput()(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    return model


def test_a_model_learns_into_one_record_until_compile_forgets_it():
    model = _model()
    record = learned(model)
    assert isinstance(record, Learned) and learned(model) is record
    costs = facts.costs(model)
    assert record.costs is costs
    record.decisions["train"] = calls.Decision(calls.Kind.PAYS)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    fresh = learned(model)
    assert fresh is not record
    assert fresh.decisions == {}
    # The stage's costs are shared by its signature, looked up again.
    assert facts.costs(model) is costs
    forget(model)
    assert learned(model) is not fresh


@pytest.mark.first_call_rule
def test_an_unstaged_call_keeps_its_decision_in_the_record():
    model = _model()
    x = np.ones((16, 2), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    decision = learned(model).decisions["train"]
    assert decision.kind is calls.Kind.FIRST_CALL and not decision.staged
    assert decision.figures == {"batches": 2}
