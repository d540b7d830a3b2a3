"""What a keras_stage model keeps between its staged calls.

One `StagingState` per model, neither tracked nor saved by Keras: the
plan, the compiled steps, their stats, what the policy learned and, while
a call runs, what binds its stages to its steps.
"""

import contextlib
import threading

# Keras's compiled steps, by the phase keras_stage stages for them.
FUNCTIONS = {
    "train": "train_function",
    "test": "test_function",
    "predict": "predict_function",
}
# The key of the whole model's compiled steps in `staged_functions`.
UNSTAGED_STEPS = "unstaged"


class StagingState:
    """Per-model run state, kept out of Keras's attribute tracking."""

    def __init__(self):
        # The model's `backends.Backend`, chosen on first use.
        self.backend = None
        self.smart_stage = False
        self.runners = {}
        # The stats each compiled step records its fetches in: a traced
        # step captures them, so they outlive calls.
        self.step_stats = {}
        # Per role: the size a stage with stats of its own (JAX, predict)
        # ended its pool at, where the next call's starts.
        self.pool_sizes = {}
        # The stats of the phases whose step records during this call.
        self.recording = {}
        # SmartStage: the plan and split, the split each phase's step runs,
        # and the compiled staged steps, apart from Keras's plain ones.
        self.plan = None
        self.split = None
        self.active = {}
        self.staged_functions = {}
        self.requested_jit = "auto"
        self.staged_jit = None
        self.default_input = None
        # `(model.layers, its StagedInput or None)` as last found (see
        # `staging_mixin.find_staged_input`).
        self.staged_input = None
        self.announced = False
        # Per phase: the placement unpacking the step's elements, and the
        # unpacked spec its traced step was built for.
        self.placements = {}
        self.layouts = {}
        # Per phase: the iterator its step read last (weakly), and a
        # restore of its position to run before the next step (see
        # `DataBackup`).
        self.iterators = {}
        self.pending_restores = {}
        # Per phase: `[iterator (weakly), batches, reopen]` left in a resumed
        # epoch (`tensorflow_steps.track_iterator`).
        self.resumed_left = {}
        # Per role: the `KeptStage` later calls run again (`kept_iterators`).
        self.stages = {}
        # Per phase: the list a timed call's step appends its host times to.
        self.step_clocks = {}
        # In the thread tracing a step: the trunk the model's call runs.
        self.local = threading.local()
        # What the policy learned of its calls (`decision.learned`).
        self.learned = None


def state(model):
    state = model.__dict__.get("_keras_stage_state")
    if state is None:
        state = StagingState()
        # A plain object, so Keras's tracker neither tracks nor saves it.
        object.__setattr__(model, "_keras_stage_state", state)
    return state


def drop_traced_steps(model, phase):
    """Makes `phase`'s next staged or plain call trace its step afresh."""
    setattr(model, FUNCTIONS[phase], None)
    kept = state(model).staged_functions
    for key in [k for k in kept if k[0] == phase]:
        del kept[key]


@contextlib.contextmanager
def set_aside(phase, *bindings):
    """Within, `phase` has no entry in the dicts `bindings`; put back after."""
    saved = [binding.pop(phase, None) for binding in bindings]
    try:
        yield
    finally:
        for binding, value in zip(bindings, saved, strict=True):
            if value is not None:
                binding[phase] = value
