"""What a model's calls taught the staging policy, until it is compiled.

The policy's own part of a model's state (`calls`, `epochs`): the measured
costs of its stage (shared with models of the same stage), what its
staged calls paid toward tracing the whole model's step, the steps traced
since its last call, its last decision per phase and what an epoch trial
found. `StagingState` holds one `Learned`; compile drops it.
"""

from keras_stage.models.model_state import state as model_state


class Learned:
    """The policy's record of one model (see the module docstring)."""

    def __init__(self):
        # The `calls.CallCosts` of its stage, looked up on first use.
        self.costs = None
        # Per phase: what its staged calls paid over a traced whole step
        # (`calls.trace_owed`).
        self.rent = {}
        # Per phase, while a call staged before anything was measured runs:
        # whether it plans the model (its rent is paid when it ends).
        self.unmeasured_rent = {}
        # `(phase, kind, seconds)` of each step traced since the last call
        # ended: "whole_trace", "step_call" or "step_trace" (noted by
        # `calls.note_traces`).
        self.traces = []
        # Per phase: the `calls.Decision` on its last call, for the verdict.
        self.decisions = {}
        # Per phase: what a fit's trial of its epochs found, when the stage
        # paid (`epochs.EpochSwitch`).
        self.switch_verdicts = {}


def learned(model):
    """The `Learned` of `model`, made on first use."""
    state = model_state(model)
    if state.learned is None:
        state.learned = Learned()
    return state.learned


def forget(model):
    """Drops what `model` learned (its compiled steps are dropped too)."""
    model_state(model).learned = None
