"""What a keras_stage model keeps between its staged calls: one
`StagingState`, neither tracked nor saved by Keras."""

import threading

# Keras's compiled steps, by the phase keras_stage stages for them.
FUNCTIONS = {
    "train": "train_function",
    "test": "test_function",
    "predict": "predict_function",
}
# The key of the whole model's compiled steps in `staged_functions`.
UNSTAGED_STEPS = "unstaged"


class CompiledSteps:
    """The compiled steps a model keeps between calls, which the call swaps
    in (`call/staged_call.py`)."""

    def __init__(self):
        # Per `(phase, split id, or UNSTAGED_STEPS)`: a compiled step.
        self.staged_functions = {}
        # The stats each compiled step records its fetches in: a traced
        # step captures them, so they outlive calls.
        self.step_stats = {}
        # The split each phase's step runs now, and the staged steps' XLA
        # choice (None: Keras's).
        self.active = {}
        self.staged_jit = None
        # In the thread tracing a step: the trunk the model's call runs.
        self.local = threading.local()


class StepBindings:
    """What binds the running call's stages to its phases' steps.

    Set by `StagedCall`, read by the steps: per phase, the stage's runner,
    the stats it records in, the placement unpacking its elements and the
    spec its traced step was built for, its steps' host clock, the iterator
    read last (weakly) and a position to restore before the next step, with
    what is left of a resumed epoch (`DataBackup`).
    """

    def __init__(self):
        self.runners = {}
        self.recording = {}
        self.placements = {}
        self.layouts = {}
        self.step_clocks = {}
        self.iterators = {}
        self.pending_restores = {}
        self.resumed_left = {}


class StagingState:
    """Per-model run state, kept out of Keras's attribute tracking."""

    def __init__(self):
        # The model's `backends.Backend`, chosen on first use.
        self.backend = None
        self.smart_stage = False
        self.requested_jit = "auto"
        # SmartStage: the plan and split, made on the first staged call.
        self.plan = None
        self.split = None
        # A subclassed model's input specs, from its first data or call:
        # what its plan traces its call on (`subclass_graph`).
        self.input_specs = None
        # Whether the plan built the subclass, which Keras's first fit or
        # evaluate would have built from a batch (`keras_builds`).
        self.built_by_plan = False
        self.default_input = None
        # `(model.layers, its StagedInput or None)` as last found (see
        # `staging_mixin.find_staged_input`).
        self.staged_input = None
        self.announced = False
        self.steps = CompiledSteps()
        self.bound = StepBindings()
        # Per role: the `KeptStage` later calls run again (`kept_iterators`),
        # and the size a stage with stats of its own (JAX, predict) ended
        # its pool at, where the next call's starts.
        self.stages = {}
        self.pool_sizes = {}
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
    kept = state(model).steps.staged_functions
    for key in [k for k in kept if k[0] == phase]:
        del kept[key]


def keras_builds(model):
    """Whether Keras's next fit or evaluate builds `model` from a batch
    (`_compat.builds_from_data`), or would, had SmartStage's plan not built
    the subclass from its specs before its first call."""
    from keras_stage import _compat

    return _compat.builds_from_data(model) or state(model).built_by_plan
