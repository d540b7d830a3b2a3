"""Tests for keras_stage/models/decision/calls.py: the staging policy.

`CallCosts` decides from the costs noted on it, `decide` from a call's
facts and `weigh_fit` from a fit's two decisions; here they are set by
hand, so each decision is checked without a model or timing anything.
Facts read off a model are tests/models/call/facts_test.py's; how a call
notes its costs is tests/models/call/measure_test.py's.
"""

import types

import pytest

from keras_stage.models.decision import calls
from keras_stage.models.decision.calls import (
    CallCosts,
    Decision,
    Kind,
    decide,
    weigh_fit,
    weighs_validation,
)


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


def test_a_stage_that_can_save_little_runs_its_trial_at_once():
    # DeepRec's seed example on 2 cores: 0.22 ms of staged work a batch
    # against 6.5 ms staged steps. The most it saves is 3% of the steps and
    # its threads slowed the trunk by more (12%), so the trial runs at the
    # second call, not after LOOP_CALLS staged calls, whatever it owes.
    costs = _timed(batch=0.00022, step=0.0065)
    assert costs.phase("train").staged_calls == 1
    assert costs.decide("train", 200, 1, owed=1.0).kind is Kind.TRIAL
    # Work of more than WORK_SHARE of a step: weighed, staged (it pays).
    costs = _timed(batch=0.0007, step=0.0065)
    assert costs.decide("train", 200, 1, owed=1.0).kind is Kind.PAYS
    # Work not measured (op determinism): no early trial.
    costs = _timed(step=0.0065)
    costs.phase("train").batch_seconds = None
    assert costs.decide("train", 200, 1, owed=1.0).kind is Kind.UNMEASURED


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


def test_the_rules_read_only_the_facts_they_need():
    # A plain object of facts: a rule that decides leaves the later unread.
    facts = types.SimpleNamespace(skippable=False)
    assert decide(facts).kind is Kind.BY_REQUEST
    facts = types.SimpleNamespace(
        skippable=True, batches=None, unbounded={"source": "python"}
    )
    assert decide(facts) == Decision(Kind.UNBOUNDED, {"source": "python"})
    facts = types.SimpleNamespace(skippable=True, batches=8, jit_compile=True)
    assert decide(facts).kind is Kind.JIT_COMPILE
    facts.jit_compile, facts.random_prefix = False, True
    assert decide(facts).kind is Kind.RANDOM_PREFIX
    facts = types.SimpleNamespace(
        skippable=True,
        batches=72,
        jit_compile=False,
        random_prefix=False,
        costs=_measured(),
        phase="train",
        iterators=1,
        plans=False,
        traces=False,
        owed=0.0,
        compiles=False,
        unstaged_epochs=0,
    )
    assert decide(facts) == facts.costs.decide("train", 72, 1)


def test_a_fits_validation_stages_it_only_if_the_fit_gains():
    loses = Decision(Kind.DOES_NOT_PAY, {"gain": -0.02})
    pays = Decision(Kind.PAYS, {"gain": 0.03})
    assert weighs_validation(loses)
    assert not weighs_validation(pays)
    assert not weighs_validation(Decision(Kind.TRIAL))
    training, validation = weigh_fit(loses, pays, in_memory=True)
    assert training.kind is Kind.VALIDATION_PAYS and training.staged
    assert training.figures == {"training": loses, "validation": pays}
    assert validation is pays
    small = Decision(Kind.PAYS, {"gain": 0.01})
    training, validation = weigh_fit(loses, small, in_memory=True)
    assert training is loses
    assert validation.kind is Kind.TRAINING_LOSES and not validation.staged
    # Unmeasured: in memory it gains nothing known; read by a pipeline,
    # the stage overlaps it and the fit is staged.
    unmeasured = Decision(Kind.UNMEASURED, {"batches": 30})
    assert not weigh_fit(loses, unmeasured, in_memory=True)[0].staged
    unbounded = Decision(Kind.UNBOUNDED, {"source": "python"})
    assert weigh_fit(loses, unbounded, in_memory=False)[0].staged
