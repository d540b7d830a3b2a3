"""What a model's calls taught the staging policy, until it is compiled
(`StagingState.learned`: compile drops it)."""

from keras_stage.models.model_state import state as model_state


class Learned:
    """The policy's record of one model."""

    def __init__(self):
        # The `calls.CallCosts` of its stage (shared by models of the same
        # stage), looked up on first use.
        self.costs = None
        # `(phase, kind, seconds)` of each step traced since the last call
        # ended: "whole_trace", "step_call" or "step_trace".
        self.traces = []
        # Per phase: the `calls.Decision` on its last call, for the verdict.
        self.decisions = {}


def learned(model):
    """The `Learned` of `model`, made on first use."""
    state = model_state(model)
    if state.learned is None:
        state.learned = Learned()
    return state.learned


def forget(model):
    """Drops what `model` learned (its compiled steps are dropped too)."""
    model_state(model).learned = None
