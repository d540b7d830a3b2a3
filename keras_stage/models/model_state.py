"""What a keras_stage model keeps between its staged calls.

One `StagingState` per model, kept out of Keras's attribute tracking (it
is neither tracked nor saved): the SmartStage plan and split, the compiled
steps of staged and unstaged calls, the stats those steps record in, what
the policy learned of its calls (`decision.learned`) and, while a call
runs, what binds its stages to its steps.
"""

import contextlib
import threading

# Keras's compiled steps, by the phase keras_stage stages for them.
FUNCTIONS = {
    "train": "train_function",
    "test": "test_function",
    "predict": "predict_function",
}
# What makes each of them.
MAKERS = {
    "train": "make_train_function",
    "test": "make_test_function",
    "predict": "make_predict_function",
}
# The key of the whole model's compiled steps in `staged_functions` (calls
# that skip their stage, epochs run without it).
UNSTAGED_STEPS = "unstaged"


class StagingState:
    """Per-model run state, kept out of Keras's attribute tracking."""

    def __init__(self):
        # The model's `backends.Backend`, chosen on first use.
        self.backend = None
        self.smart_stage = False
        self.runners = {}
        # The stats each compiled step ("train", "test") records its
        # fetches in: kept across calls, since a traced step captures
        # them, and replaced (with a retrace) once closed by a timeout.
        self.step_stats = {}
        # Where a call's stages count in stats of their own (every JAX
        # stage, a predict's), the size each role's adaptive pool ended the
        # last call with: the next call's pool starts there rather than
        # growing again, since each resize restarts the stage.
        self.pool_sizes = {}
        # The stats of the phases whose step records during this call.
        self.recording = {}
        # SmartStage: the plan and split (computed on first use after
        # compile), the split each phase's step runs, and the compiled
        # steps of staged runs, kept apart from Keras's plain ones.
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
        # Per phase: the placement of the stage feeding the step (which
        # unpacks packed elements), and the unpacked spec its traced step
        # was built for.
        self.placements = {}
        self.layouts = {}
        # Per phase: the iterator its step read last (weakly), and a
        # restore of its position to run before the next step (see
        # `DataBackup`).
        self.iterators = {}
        self.pending_restores = {}
        # Per phase: `[iterator (weakly), batches]` left in an epoch
        # resumed from a saved position, whose data ends before Keras's
        # count of the epoch's steps (see `tensorflow_steps.track_iterator`).
        self.resumed_left = {}
        # Per role: the `KeptStage` its last call built over a user's
        # dataset, run again by later calls (owned by `kept_iterators`).
        self.stages = {}
        # Per phase: the list the compiled step appends its host time per
        # batch to while a call times its steps (see `decision.calls
        # .note_steps`).
        self.step_clocks = {}
        # Set, in the thread tracing a step, to the trunk the model's call
        # runs instead of the whole model.
        self.local = threading.local()
        # What the staging policy learned of this model's calls
        # (`decision.learned`), until compile.
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
    """Within, `phase` has no entry in any of the dicts `bindings`.

    Each entry it had is put back afterwards: what an outer call (or the
    staged epochs of this one) bound for the phase.
    """
    saved = [binding.pop(phase, None) for binding in bindings]
    try:
        yield
    finally:
        for binding, value in zip(bindings, saved, strict=True):
            if value is not None:
                binding[phase] = value
