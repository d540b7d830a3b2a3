"""The compiled steps of a staged call: Keras's steps, guarded and recorded.

`TensorFlowBackend`'s helper; `calling_trunk` (the SmartStage trunk in a
step's trace) serves every backend.
"""

import contextlib
import inspect
import time
import weakref

import keras
import tensorflow as tf

from keras_stage import _compat
from keras_stage.data.errors import StageTimeoutError
from keras_stage.data.runner import EndOfData, SkipElement
from keras_stage.data.stats import StageStats
from keras_stage.models.decision.learned import learned
from keras_stage.models.iterators.kept_iterators import resolve
from keras_stage.models.model_state import FUNCTIONS, drop_traced_steps
from keras_stage.models.model_state import state as _state


def guard(model, phase, function):
    """Wraps a compiled Keras step with the stage runner of `phase`, timing
    each step where the host times them (`StepBindings.step_clocks`)."""
    unrecorded = UnrecordedStep(model, phase)
    unstaged_ran = []  # whether this step ran unstaged yet (its first traces)

    def guarded(iterator):
        clock = _state(model).bound.step_clocks.get(phase)
        if clock is None or len(clock) >= TIMED_STEPS_KEPT:
            return staged(iterator)
        started = time.perf_counter()
        outputs = staged(iterator)
        clock.append(
            (time.perf_counter() - started) / model.steps_per_execution
        )
        return outputs

    def staged(iterator):
        iterator = resolve(iterator)
        state = _state(model)
        runner = state.bound.runners.get(phase)
        if runner is None:
            if unstaged_ran or state.steps.active.get(phase) is not None:
                return reported(function(iterator))[0]
            # Its first call, trace included, for `measure.note_traces`.
            unstaged_ran.append(True)
            started = time.perf_counter()
            outputs = reported(function(iterator))[0]
            learned(model).traces.append(
                (phase, "whole_trace", time.perf_counter() - started)
            )
            return outputs
        track_iterator(state.bound, phase, iterator)
        if resumed_epoch_ended(
            state.bound, phase, iterator, model.steps_per_execution
        ):
            raise StopIteration
        while True:
            # Bounds a one-step call's fetch (`StageStats.take_report`).
            called = time.time() if model.steps_per_execution == 1 else None
            first = not unrecorded.first_call_noted
            started = time.perf_counter()
            try:
                outputs, report = reported(
                    runner.call(
                        function,
                        iterator,
                        check_origin=True,
                        elements=model.steps_per_execution,
                        ready_fn=unrecorded.get(),
                    )
                )
                if first:
                    seconds = time.perf_counter() - started
                    unrecorded.note_first_call(seconds)
                    # As the whole model's first call, with the first wait.
                    learned(model).traces.append((phase, "step_call", seconds))
                if report is not None:
                    values = report.numpy().tolist()
                    unrecorded.reported(values)
                    runner.take_report(iterator, values, called)
                return outputs
            except SkipElement:
                continue
            except EndOfData:
                # Keras ends the epoch on StopIteration.
                raise StopIteration from None
            except (StageTimeoutError, KeyboardInterrupt):
                # The abandoned call may still run this tf.function, whose
                # calls run one at a time: the next call traces a fresh one.
                setattr(model, FUNCTIONS[phase], None)
                raise

    guarded.keras_stage_guarded = True
    return guarded


def build_optimizer(model):
    """Builds `model`'s optimizer before its train step is first traced:
    Keras builds it inside the first trace without a strategy, and a
    `tf.function` whose first trace creates variables is traced twice."""
    optimizer = getattr(model, "optimizer", None)
    if (
        optimizer is None
        or optimizer.built
        or not model.built
        or not _compat.layers_built(model)
    ):
        return
    with model.distribute_strategy.scope():
        optimizer.build(model.trainable_variables)


def guarded(function):
    """Whether `function` is a compiled step `guard` already wrapped."""
    return getattr(function, "keras_stage_guarded", False)


def track_iterator(bound, phase, iterator):
    """Notes the iterator `phase`'s step reads; restores it first if asked.

    A resumed epoch (`DataBackup`) holds only the batches after its saved
    position, where Keras counts the whole epoch: their count, when known,
    ends it (`resumed_epoch_ended`), then `reopen()` makes the iterator
    Keras makes after a full epoch.
    """
    pending = bound.pending_restores.pop(phase, None)
    if pending is not None:
        restore, left, reopen = pending
        restore(iterator)
    try:
        bound.iterators[phase] = weakref.ref(iterator)
    except TypeError:  # not weakly referable: not checkpointable either
        bound.iterators.pop(phase, None)
        return
    if pending is not None and left is not None:
        bound.resumed_left[phase] = [bound.iterators[phase], left, reopen]


def resumed_epoch_ended(bound, phase, iterator, batches):
    """Whether a resumed epoch's data is all read (see `track_iterator`);
    counts down the call's `batches` otherwise. Keras's extra call, failing
    at the end of the data, would count an optimizer iteration that a run
    never stopped does not make."""
    left = bound.resumed_left.get(phase)
    if left is None or left[0]() is not iterator:
        bound.resumed_left.pop(phase, None)
        return False
    if left[1] <= 0:
        del bound.resumed_left[phase]
        left[2]()  # reopen
        return True
    left[1] -= batches
    return False


# The most step times of one call the host keeps (for their median).
TIMED_STEPS_KEPT = 1024
# The fewest recorded calls before the unrecorded twin is traced: a second
# trace pays for itself only over many steps.
UNRECORDED_AFTER = 100
# About what the recording adds to a step, in seconds: the twin is traced
# once the recorded steps would have paid its trace at this rate.
RECORDING_SECONDS = 50e-6


class UnrecordedStep:
    """`phase`'s compiled step without the fetch recording, made on demand.

    A batch known to be buffered has no wait to measure: the runner runs
    this twin instead (`StageRunner.call`'s `ready_fn`), for keras_stage's
    own steps at one batch per call (docs/engine.md).
    """

    def __init__(self, model, phase):
        self._model = weakref.ref(model)
        self._phase = phase
        self._reports = 0  # full reports (see `StageStats.report`) seen
        self._function = None
        self._after = UNRECORDED_AFTER  # recorded calls before the twin
        self.first_call_noted = False

    def note_first_call(self, seconds):
        """Notes the recorded step's first call (its trace): the twin's
        trace waits for recorded calls that cost as much."""
        self.first_call_noted = True
        self._after = max(UNRECORDED_AFTER, int(seconds / RECORDING_SECONDS))

    def reported(self, values):
        """Notes a report the recorded step returned."""
        if len(values) == StageStats.REPORT_SIZE:
            self._reports += 1

    def get(self):
        """The twin for the next call, or None to record it."""
        model = self._model()
        if (
            model is None
            or self._reports < self._after
            or model.steps_per_execution != 1
            or self._phase not in _state(model).bound.recording
        ):
            return None
        return self._call

    def _call(self, iterator):
        model = self._model()
        if self._function is None:
            # A stage that never knows its batch is ready never traces it.
            self._function = make_unrecorded(model, self._phase)
        local = _state(model).steps.local
        local.unrecorded = True  # read by `recorded_step` while tracing
        try:
            return self._function(iterator)
        finally:
            local.unrecorded = False


def make_unrecorded(model, phase):
    """`phase`'s step on an iterator's next batch, compiled unrecorded.

    Keras's compiled step at one batch per call on one replica, without
    its end-of-data Optional (two eager ops a call): on buffered batches
    only; at the end of the data `get_next` raises.
    """
    step = getattr(model, f"{phase}_step")
    strategy = model.distribute_strategy

    def one_step(iterator):
        # Keras's adapters pass absent parts (no labels, no sample weights)
        # as empty Optionals, and its steps take them as None.
        data = keras.tree.map_structure(
            lambda x: None if isinstance(x, tf.experimental.Optional) else x,
            iterator.get_next(),
        )
        outputs = strategy.run(step, args=(data,))
        # One replica: its own results.
        return tf.nest.map_structure(
            lambda value: strategy.experimental_local_results(value)[0],
            outputs,
        )

    if model.run_eagerly:
        return one_step
    return tf.function(one_step, reduce_retracing=True, autograph=False)


def step_stats(model, layer, phase):
    """The stats `phase`'s compiled step records in, or None where it
    cannot take timestamps (XLA, several replicas): the pipeline counts."""
    state = _state(model)
    if (
        state.requested_jit is True
        or keras.Model.jit_compile.fget(model) is True
        or model.distribute_strategy.num_replicas_in_sync > 1
    ):
        return None
    stats = state.steps.step_stats.get(phase)
    # A traced step fails on closed stats or a clock op determinism refuses.
    if stats is None or stats.closed or stats.clock_refused:
        if stats is not None:
            # The traced step still records in the closed stats.
            drop_traced_steps(model, phase)
        stats = layer.new_stats(f"{layer.stage_options.name}_{phase}")
        state.steps.step_stats[phase] = stats
    return stats


# The logs key of a recorded step's report, removed by its guard.
REPORT_KEY = "_keras_stage_report"


def recorded_step(model, phase, step, data):
    """Runs `step(data)`, recording its fetch where `phase` records.

    keras_stage's own step returns its report in its logs (`REPORT_KEY`)
    for the guard to accumulate in Python. A subclass's step may drop the
    key, and a call of several steps hands out only the last one's
    outputs: those accumulate in the graph.
    """
    state = _state(model)
    stats = state.bound.recording.get(phase)
    if stats is None or getattr(state.steps.local, "unrecorded", False):
        return step(data)  # unrecorded: a buffered batch (`UnrecordedStep`)
    fetch = stats.record_fetch(data, accumulate=False)
    outputs = step(data)
    end = stats.record_step_end(outputs)
    if not own_step(model, phase) or not isinstance(outputs, dict):
        stats.accumulate(fetch)
        return outputs
    if model.steps_per_execution > 1:
        stats.accumulate(fetch)
        fetch = None
    return {**outputs, REPORT_KEY: stats.report(fetch, end)}


def own_step(model, phase):
    """Whether `phase`'s step is keras_stage's (`own`), not a subclass's."""
    step = getattr(type(model), f"{phase}_step")
    return getattr(step, "keras_stage_step", False)


def own(step):
    """Marks a model class's step method as keras_stage's (`own_step`)."""
    step.keras_stage_step = True
    return step


def reported(outputs):
    """`(outputs, report)`: a step's outputs without its report, and it."""
    if isinstance(outputs, dict) and REPORT_KEY in outputs:
        outputs = dict(outputs)
        return outputs, outputs.pop(REPORT_KEY)
    return outputs, None


def unpacked(model, phase, data):
    """The step's `data`, unpacked on the device if its stage packed it."""
    placement = _state(model).bound.placements.get(phase)
    return data if placement is None else placement.unpack(data)


@contextlib.contextmanager
def calling_trunk(model, phase):
    """Within a step's trace, makes the model's call run `phase`'s trunk."""
    state = _state(model)
    split = state.steps.active.get(phase)
    previous = getattr(state.steps.local, "split", None)
    state.steps.local.split = split
    # Python runs only while the step traces: its time is the trace's.
    started = (
        None if split is None or tf.executing_eagerly() else time.perf_counter()
    )
    try:
        yield
    finally:
        state.steps.local.split = previous
        if started is not None:
            learned(model).traces.append(
                (phase, "step_trace", time.perf_counter() - started)
            )


def active_split(model):
    """The split whose trunk the model's call runs while a staged step
    traces, or None."""
    return getattr(_state(model).steps.local, "split", None)


def call_model(model, call, inputs, **kwargs):
    """`call(inputs, **kwargs)`, or the trunk's call while a step traces it
    (the stage hands a cut of one tensor bare; the trunk takes a list).
    Without `training`, the call gets its own default, as Keras gives it:
    a subclass's call planned per flag runs that flag's trunk."""
    split = active_split(model)
    if split is None:
        return call(inputs, **kwargs)
    if kwargs.get("training") is None:
        kwargs["training"] = default_training(model)
    split_trunk = split.trunk_for(kwargs["training"])
    if len(split_trunk.inputs) == 1 and not isinstance(inputs, (list, tuple)):
        inputs = [inputs]
    return split_trunk(inputs, **kwargs)


def default_training(model):
    """The default of the `training` argument of the model's call, or None."""
    parameter = inspect.signature(model.call).parameters.get("training")
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default
