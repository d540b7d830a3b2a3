"""Tests for keras_stage/models/call/measure.py: what a call measures.

The stage's build and iterators, the steps' traces and Keras's epoch
starts, noted for the policy (`decision/calls.py`).
"""

import keras
import numpy as np
import pytest

from keras_stage.models.call import facts, measure
from keras_stage.models.decision.learned import learned
from tests.helpers import dense_staged_model

pytestmark = pytest.mark.timeout(120)

X = np.ones((240, 2), "float32")  # 30 batches of 8
Y = np.ones((240, 1), "float32")


def test_staged_data_and_note_work_note_what_a_staged_call_costs():
    model, layer = dense_staged_model()
    data = measure.staged_data(model, "test", layer, "test", X, Y, batch_size=8)
    costs = facts.costs(model).phase("test")
    assert costs.build_seconds > 0 and costs.iterator_seconds is None
    assert data.cost_phase == "test"
    assert data.work_before == (0.0, 0)
    batches = list(data.pipeline)  # Keras's read of one epoch
    assert len(batches) == 30
    assert costs.iterator_seconds > 0
    measure.note_work(model, data)
    # No SmartStage prefix: the stage of arrays computes nothing.
    assert costs.batch_seconds == 0.0
    assert costs.measured()
    data.end_call()


@pytest.mark.first_call_rule
def test_an_unstaged_fit_times_its_epochs_starts(monkeypatch):
    model, layer = dense_staged_model(
        [keras.layers.Rescaling(0.5)], smart_stage=True
    )
    # A first fit of few batches runs unstaged (`FIRST_CALL_BATCHES`).
    history = model.fit(X, Y, batch_size=48, epochs=3, verbose=0).history
    assert history["stage_unstaged"] == [1.0, 1.0, 1.0]
    started = facts.costs(model).phase("train").epoch_start_seconds
    assert started is not None and 0 < started < 10
    # Now and then one epoch's start takes far longer (tf.data's tear-down
    # of the previous epoch's iterator waits): a cost an unstaged fit pays
    # and a stage's one iterator does not, so it counts, as the mean...
    other, _ = dense_staged_model()
    measure.note_epoch_starts(other, [0.003, 0.196])
    phase = facts.costs(other).phase("train")
    assert phase.epoch_start_seconds == pytest.approx(0.0995)
    # ...and one busy call among the last few noted does not make it.
    for _ in range(2):
        measure.note_epoch_starts(other, [0.003, 0.005])
    assert phase.epoch_start_seconds == pytest.approx(0.004)
    # Each epoch's start (to its first step) and end (from its last step to
    # its validation or its end) are timed, not its steps.
    clock = measure.EpochStartClock()
    now = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])
    for epoch, validation in enumerate((False, True)):
        clock.on_epoch_begin(epoch)
        now[0] += 0.002  # making the iterator
        for batch in range(2):
            clock.on_train_batch_begin(batch)  # the second: not timed
            now[0] += 0.05  # a step
            clock.on_train_batch_end(batch)
        now[0] += 0.003  # letting the iterator go
        if validation:
            clock.on_test_begin()
            now[0] += 0.5
            clock.on_test_end()
        clock.on_epoch_end(epoch)
    assert clock.seconds == pytest.approx([0.005, 0.005])


def test_a_steps_trace_is_timed_and_noted_after_the_call():
    model, layer = dense_staged_model(
        [keras.layers.Rescaling(0.5)], smart_stage=True
    )
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)  # staged: the trunk
    measured = facts.costs(model).phase("train")
    assert measured.step_trace_seconds > 0
    # Its first call traced it, set it up and ran a step.
    assert measured.step_call_seconds > measured.step_trace_seconds
    assert measured.unstaged_trace_seconds is None
    assert learned(model).traces == []  # noted, drained
    assert facts.traces_whole_step(model, "train")
    # An unstaged call (its stage cannot repay) traces the whole step.
    facts.costs(model).note_build("train", 100.0)
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert measured.unstaged_trace_seconds > 0
    assert not facts.traces_whole_step(model, "train")
