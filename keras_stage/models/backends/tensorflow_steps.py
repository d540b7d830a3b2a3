"""The compiled steps of a staged call: Keras's steps, guarded and recorded.

This is `TensorFlowBackend`'s helper (`tensorflow.py`), the only module
that knows how Keras's compiled train/test/predict functions take their
data (an iterator, read inside a `tf.function`):

- `guard` wraps a compiled step with the stage runner of its phase, which
  applies the exception policies and the timeout around each step;
- `step_stats` and `recorded_step` make the traced step record its own
  fetches (two ops in the step instead of a map on the fetch path), and
  `UnrecordedStep` runs a twin without them when the batch is known to be
  buffered;
- `unpacked` and `calling_trunk` make the traced step unpack what its
  stage packed and run the SmartStage trunk instead of the whole model
  (`calling_trunk` on every backend: `Backend.step`).
"""

import contextlib
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
    """Wraps a compiled Keras step with the stage runner of `phase`.

    A call whose steps the host times (`StagingState.step_clocks`) is timed
    step by step.
    """
    unrecorded = UnrecordedStep(model, phase)
    # Whether this compiled step ran unstaged yet (its first call traces).
    unstaged_ran = []

    def guarded(iterator):
        clock = _state(model).step_clocks.get(phase)
        if clock is None or len(clock) >= TIMED_STEPS_KEPT:
            return staged(iterator)
        # Timed on the host for `decision.calls`: what a staged step costs
        # beside the whole model's.
        started = time.perf_counter()
        outputs = staged(iterator)
        clock.append(
            (time.perf_counter() - started) / model.steps_per_execution
        )
        return outputs

    def staged(iterator):
        iterator = resolve(iterator)
        state = _state(model)
        runner = state.runners.get(phase)
        if runner is None:
            if unstaged_ran or state.active.get(phase) is not None:
                return reported(function(iterator))[0]
            # The whole model's step, first called: what its trace (and
            # one step) took is noted for `decision.calls.note_traces`.
            unstaged_ran.append(True)
            started = time.perf_counter()
            outputs = reported(function(iterator))[0]
            learned(model).traces.append(
                (phase, "whole_trace", time.perf_counter() - started)
            )
            return outputs
        track_iterator(state, phase, iterator)
        if resumed_epoch_ended(
            state, phase, iterator, model.steps_per_execution
        ):
            raise StopIteration
        while True:
            # A call of one step reports its one fetch, which the call's
            # start bounds (see `StageStats.take_report`).
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
                    # The trunk's step's first call, timed as the whole
                    # model's is (above): its trace, graph set-up and one
                    # step, here with the wait for the stage's first batch
                    # (what a staged call adds), for
                    # `decision.calls.note_traces`.
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
                # The abandoned call (timed out, or interrupted while the
                # step ran on the helper thread) may still run this
                # compiled function, and TensorFlow runs the calls of one
                # tf.function one at a time: the next fit/evaluate must
                # trace a fresh one.
                setattr(model, FUNCTIONS[phase], None)
                raise

    guarded.keras_stage_guarded = True
    return guarded


def build_optimizer(model):
    """Builds `model`'s optimizer before its train step is first traced.

    Keras on TensorFlow, without a strategy, builds it inside the step's
    first trace, and a `tf.function` whose first trace creates variables
    is traced a second time. Called as the train function is made, before
    any trace, staged or not (a staged call with unbuilt metrics builds it
    with them: `staged_call._build_before_trace`). Its variables are the same
    (`optimizer.build` on the model's trainable variables, as Keras's own
    build under a strategy); a model with a layer not built yet is left to
    Keras.
    """
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


def track_iterator(state, phase, iterator):
    """Notes the iterator `phase`'s step reads; restores it first if asked.

    See `DataBackup`: a resumed epoch's iterator continues from the saved
    position before its first step, and holds the epoch's batches after
    that position only, where Keras still counts the whole epoch's steps.
    Their count, when known, ends the epoch (`resumed_epoch_ended`), with
    `reopen()` (or None) making the iterator Keras makes at the end of an
    epoch it stepped through.
    """
    pending = state.pending_restores.pop(phase, None)
    if pending is not None:
        restore, left, reopen = pending
        restore(iterator)
    try:
        state.iterators[phase] = weakref.ref(iterator)
    except TypeError:  # not weakly referable: not checkpointable either
        state.iterators.pop(phase, None)
        return
    if pending is not None and left is not None:
        state.resumed_left[phase] = [state.iterators[phase], left, reopen]


def resumed_epoch_ended(state, phase, iterator, batches):
    """Whether a resumed epoch's data is all read (see `track_iterator`).

    Counts down the call's `batches` otherwise. Keras would make one more
    call, whose step fails at the end of the data: and a failing step
    still counts an optimizer iteration (TensorFlow orders the optimizer's
    counter after no read of the data), which a run never stopped does not
    make there. An epoch ended here is one Keras did not step through, so
    Keras skips the iterator it makes after one: it is made here instead
    (a run never stopped draws its reshuffle sequence with it).
    """
    left = state.resumed_left.get(phase)
    if left is None or left[0]() is not iterator:
        state.resumed_left.pop(phase, None)
        return False
    if left[1] <= 0:
        del state.resumed_left[phase]
        if left[2] is not None:
            left[2]()
        return True
    left[1] -= batches
    return False


# The step calls of one call the host times (see `guard`): their median is
# what `decision.calls` keeps, and a long fit need not hold them all.
TIMED_STEPS_KEPT = 1024
# Calls of a guarded step that report their fetch before it makes the
# step's unrecorded twin, at the least: a second trace costs as much as the
# first and saves each step only the recording's small share, so it pays
# for itself only over many steps.
UNRECORDED_AFTER = 100
# What the recording adds to a step, in seconds: an estimate of the two
# eager ops the twin saves (docs/benchmarks.md measures the recording). The
# twin is made once the steps recorded would have paid its trace at this
# rate (rent or buy: the recording a short call pays is at most about what
# the trace it avoids would cost, and at most twice that over a long one).
RECORDING_SECONDS = 50e-6


class UnrecordedStep:
    """`phase`'s compiled step without the fetch recording, made on demand.

    The recording (`recorded_step`) lengthens every call of the step
    (Keras runs the step in a `tf.while_loop` and hands its outputs out in
    an Optional, where every output and every op after the step's outputs
    adds to the call; the `none` benchmark shows it); a call whose batch
    is known to be buffered has no wait to measure, so the runner runs
    this twin instead (see `StageRunner.call`'s `ready_fn`). Its batch
    being there, the twin also skips Keras's end-of-data Optional
    (`make_unrecorded`). Only keras_stage's own steps, one batch per call:
    those report each fetch to the guard, which counts the twin's fetches
    in Python.
    """

    def __init__(self, model, phase):
        self._model = weakref.ref(model)
        self._phase = phase
        self._reports = 0  # full reports (see `StageStats.report`) seen
        self._function = None
        # The recorded calls after which the twin is made (see
        # `note_first_call`).
        self._after = UNRECORDED_AFTER
        self.first_call_noted = False

    def note_first_call(self, seconds):
        """Notes how long the recorded step's first call took.

        That call traced the step (and made its iterator, and waited for
        the first batch): the twin's trace costs about as much, so it is
        made only after as many recorded calls as would cost that much
        (`RECORDING_SECONDS`).
        """
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
            or self._phase not in _state(model).recording
        ):
            return None
        return self._call

    def _call(self, iterator):
        model = self._model()
        if self._function is None:
            # Made at the first call the runner finds ready: a stage that
            # cannot know (an ordered parallel map) never traces it.
            self._function = make_unrecorded(model, self._phase)
        local = _state(model).local
        local.unrecorded = True  # read by `recorded_step` while tracing
        try:
            return self._function(iterator)
        finally:
            local.unrecorded = False


def make_unrecorded(model, phase):
    """`phase`'s step on an iterator's next batch, compiled unrecorded.

    What Keras's compiled step does at `steps_per_execution=1` with one
    replica and no XLA (the only steps that record, see `step_stats`)
    without its end-of-data check: Keras hands the step's outputs out in a
    `tf.data` Optional, which costs each call two eager ops after the step
    (has_value, get_value), each dispatched from Python. The twin only
    runs on a batch the stage knows to be buffered, so its data cannot end
    there; if it did, `get_next` raises the end of the data, as Keras's
    steps did before it used the Optional.
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
        # One replica: its own results (plain tensors already, under the
        # default strategy).
        return tf.nest.map_structure(
            lambda value: strategy.experimental_local_results(value)[0],
            outputs,
        )

    if model.run_eagerly:
        return one_step
    return tf.function(one_step, reduce_retracing=True, autograph=False)


def step_stats(model, layer, phase):
    """The stats `phase`'s compiled step records in, or None.

    The step records the consumer's side of the counters itself (two ops in
    the step instead of a tf.data map on the fetch path) unless it cannot
    take timestamps: XLA-compiled steps, and several replicas each running
    it; their stages count the fetch in the pipeline.
    """
    state = _state(model)
    if (
        state.requested_jit is True
        or keras.Model.jit_compile.fget(model) is True
        or model.distribute_strategy.num_replicas_in_sync > 1
    ):
        return None
    stats = state.step_stats.get(phase)
    # Stats traced with a clock that op determinism now refuses are
    # replaced like closed ones (the traced step would fail).
    if stats is None or stats.closed or stats.clock_refused:
        if stats is not None:
            # The traced step still records in the closed stats.
            drop_traced_steps(model, phase)
        stats = layer.new_stats(f"{layer.stage_options.name}_{phase}")
        state.step_stats[phase] = stats
    return stats


# The logs key under which a recorded step returns its stage's report
# (`StageStats.report`) to its guard, which removes it before Keras sees it.
REPORT_KEY = "_keras_stage_report"


def recorded_step(model, phase, step, data):
    """Runs `step(data)`, recording its fetch where `phase` records.

    keras_stage's own train/test step returns its stage's report in its
    logs (`REPORT_KEY`): the guard accumulates the fetch's wait in Python
    and learns whether the next batch is ready, which spares the step some
    30 graph ops and the call a variable read. A step a subclass overrides
    may drop the key from the logs it returns, and only the last batch's
    outputs leave a call that runs several (`steps_per_execution`): those
    accumulate their fetches in the graph (the latter still report their
    count).
    """
    state = _state(model)
    stats = state.recording.get(phase)
    if stats is None:
        return step(data)
    if getattr(state.local, "unrecorded", False):
        return step(data)  # its batch was buffered: see `UnrecordedStep`
    fetch = stats.record_fetch(data, accumulate=False)
    outputs = step(data)
    end = stats.record_step_end(outputs)
    # Keras's own steps return dicts.
    if not own_step(model, phase) or not isinstance(outputs, dict):
        stats.accumulate(fetch)
        return outputs
    if model.steps_per_execution > 1:
        stats.accumulate(fetch)
        fetch = None
    return {**outputs, REPORT_KEY: stats.report(fetch, end)}


def own_step(model, phase):
    """Whether `phase`'s step is keras_stage's, whose logs reach the guard.

    keras_stage's steps carry `keras_stage_step` (see `own`); a subclass
    that overrides one may return other logs.
    """
    step = getattr(type(model), f"{phase}_step")
    return getattr(step, "keras_stage_step", False)


def own(step):
    """Marks a model class's step method as keras_stage's (`own_step`)."""
    step.keras_stage_step = True
    return step


def reported(outputs):
    """`(outputs, report)`: a step's outputs without its report, and it.

    `report` is None when the step returned none (see `recorded_step`).
    """
    if isinstance(outputs, dict) and REPORT_KEY in outputs:
        outputs = dict(outputs)
        return outputs, outputs.pop(REPORT_KEY)
    return outputs, None


def unpacked(model, phase, data):
    """The step's `data`, unpacked on the device if its stage packed it."""
    placement = _state(model).placements.get(phase)
    return data if placement is None else placement.unpack(data)


@contextlib.contextmanager
def calling_trunk(model, phase):
    """Within a step's trace, makes the model's call run `phase`'s trunk."""
    state = _state(model)
    split = state.active.get(phase)
    previous = getattr(state.local, "trunk", None)
    state.local.trunk = None if split is None else split.trunk
    # A step runs its Python only while it is traced: how long the trunk's
    # took is noted for `decision.calls.note_traces` (part of what tracing
    # the whole model's step costs; `guard` times that one whole).
    started = (
        None if split is None or tf.executing_eagerly() else time.perf_counter()
    )
    try:
        yield
    finally:
        state.local.trunk = previous
        if started is not None:
            learned(model).traces.append(
                (phase, "step_trace", time.perf_counter() - started)
            )


def trunk(model):
    """The trunk the model's call runs while a staged step traces, or None."""
    return getattr(_state(model).local, "trunk", None)


def call_model(model, call, inputs, **kwargs):
    """`call(inputs, **kwargs)`, or the trunk's call while a step traces it.

    `call` is the model class's own `call`. Keras's JAX step calls `call`
    itself (`stateless_call`), so the redirect to the trunk is made there
    too, not only in `__call__`. The stage hands a cut of one tensor bare
    (`StageSplit.stage_fn`); the trunk's inputs are a list.
    """
    split_trunk = trunk(model)
    if split_trunk is None:
        return call(inputs, **kwargs)
    if len(split_trunk.inputs) == 1 and not isinstance(inputs, (list, tuple)):
        inputs = [inputs]
    return split_trunk(inputs, **kwargs)
