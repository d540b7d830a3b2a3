"""`StagingMixin`: routes a model's fit/evaluate/predict data through a stage.

This module owns the wiring between Keras's training loop and the staging
engine for `keras_stage.Model` and `keras_stage.Sequential`:

- `compile` takes `smart_stage` and keeps it through save/load;
- `fit`, `evaluate` and `predict` of a model with a `StagedInput` stage
  their data with that layer's options and make sure a `PrefetchCallback`
  runs (first, so every other callback sees its logs) and closes the stage
  however the call ends;
- the compiled train/test steps are guarded by the stage's runner, which
  applies the exception policies and the timeout around each step.

With `compile(smart_stage=True)` the stage also runs the model's prefix
that training does not change (see `keras_stage.planner`): the stage
yields the cut tensors, and while Keras traces the train/test/predict step
the model's call runs the trunk on them. Staged and plain runs keep
separate compiled steps.

Which calls are staged is `adaptive.py`'s; what the model keeps between
calls is `model_state.py`'s.

A model without a `StagedInput` and without `smart_stage` behaves exactly
like its Keras base class.
"""

import contextlib
import logging
import warnings
import weakref

import keras
import tensorflow as tf

from keras_stage import _compat
from keras_stage.callbacks.data_backup import DataBackup
from keras_stage.callbacks.prefetch_callback import PrefetchCallback
from keras_stage.data.errors import StageTimeoutError
from keras_stage.data.runner import EndOfData, SkipElement
from keras_stage.data.stats import StageStats
from keras_stage.layers.staged_input import StagedInput
from keras_stage.models import adaptive
from keras_stage.models.call_costs import CallCosts, array_batches
from keras_stage.models.iterators import resolve
from keras_stage.models.model_state import FUNCTIONS as _FUNCTIONS
from keras_stage.models.model_state import state as _state
from keras_stage.planner.planner import plan_model
from keras_stage.planner.state_access import all_layers

logger = logging.getLogger("keras_stage")

_SMART_STAGE_VALUES = (True, False, "longest")


def find_staged_input(model):
    """The model's `StagedInput`, or None; checks where it stands."""
    found = [layer for layer in model.layers if isinstance(layer, StagedInput)]
    if not found:
        return None
    if len(found) > 1:
        names = [layer.name for layer in found]
        raise ValueError(
            f"Model '{model.name}' has {len(found)} StagedInput layers "
            f"({names}). A model has one stage boundary: pass all its inputs "
            "through one StagedInput (it takes a list or a dict)."
        )
    layer = found[0]
    if isinstance(model, keras.Sequential):
        if model.layers[0] is not layer:
            raise ValueError(
                f"StagedInput '{layer.name}' must be the first layer of "
                f"Sequential model '{model.name}'; found it at position "
                f"{model.layers.index(layer)}. Move it right after "
                "keras.Input."
            )
    elif getattr(model, "inputs", None):  # functional
        model_inputs = {id(t) for t in keras.tree.flatten(model.inputs)}
        layer_inputs = keras.tree.flatten(layer.input)
        if not all(id(t) in model_inputs for t in layer_inputs):
            raise ValueError(
                f"StagedInput '{layer.name}' must be applied to the model's "
                "keras.Input tensors (it marks where the input data enters "
                "the model). Apply it to the inputs, e.g. "
                "`x = StagedInput()(inputs)`, and build the rest on `x`."
            )
    return layer


def _guard(model, phase, function):
    """Wraps a compiled Keras step with the stage runner of `phase`."""
    unrecorded = _UnrecordedStep(model, phase)

    def guarded(iterator):
        iterator = resolve(iterator)
        state = _state(model)
        runner = state.runners.get(phase)
        if runner is None:
            return _reported(function(iterator))[0]
        _track_iterator(state, phase, iterator)
        while True:
            try:
                outputs, report = _reported(
                    runner.call(
                        function,
                        iterator,
                        check_origin=True,
                        elements=model.steps_per_execution,
                        ready_fn=unrecorded.get(),
                    )
                )
                if report is not None:
                    values = report.numpy().tolist()
                    unrecorded.reported(values)
                    runner.take_report(iterator, values)
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
                setattr(model, _FUNCTIONS[phase], None)
                raise

    guarded.keras_stage_guarded = True
    return guarded


# Calls of a guarded step that report their fetch before it makes the
# step's unrecorded twin: a second trace (a second or more for a large
# model) pays for itself only over many steps (some 50 us each here).
_UNRECORDED_AFTER = 100


class _UnrecordedStep:
    """`phase`'s compiled step without the fetch recording, made on demand.

    The recording (`_recorded_step`) costs a 1.1 ms training step some
    50-65 us here (Keras runs the step in a `tf.while_loop` and hands its
    outputs out in an Optional, where every output and every op after the
    step's outputs lengthens the call); a call whose batch is known
    to be buffered has no wait to measure, so the runner runs this twin
    instead (see `StageRunner.call`'s `ready_fn`). Its batch being there,
    the twin also skips Keras's end-of-data Optional (`_make_unrecorded`).
    Only keras_stage's own steps, one batch per call: those report each
    fetch to the guard, which counts the twin's fetches in Python.
    """

    def __init__(self, model, phase):
        self._model = weakref.ref(model)
        self._phase = phase
        self._reports = 0  # full reports (see `StageStats.report`) seen
        self._function = None

    def reported(self, values):
        """Notes a report the recorded step returned."""
        if len(values) == StageStats.REPORT_SIZE:
            self._reports += 1

    def get(self):
        """The twin for the next call, or None to record it."""
        model = self._model()
        if (
            model is None
            or self._reports < _UNRECORDED_AFTER
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
            self._function = _make_unrecorded(model, self._phase)
        local = _state(model).local
        local.unrecorded = True  # read by `_recorded_step` while tracing
        try:
            return self._function(iterator)
        finally:
            local.unrecorded = False


def _make_unrecorded(model, phase):
    """`phase`'s step on an iterator's next batch, compiled unrecorded.

    What Keras's compiled step does at `steps_per_execution=1` with one
    replica and no XLA (the only steps that record, see `_step_stats`)
    without its end-of-data check: Keras hands the step's outputs out in a
    `tf.data` Optional, which costs each call two eager ops after the step
    (has_value, get_value: 40-50 us here). The twin only runs on a batch
    the stage knows to be buffered, so its data cannot end there; if it
    did, `get_next` raises the end of the data, as Keras's steps did
    before it used the Optional.
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


@contextlib.contextmanager
def _skips_end_epochs_early(layer, built=(), callbacks=()):
    """Silences Keras's "ran out of data" warning when epochs may end early.

    With `ignored_exception_types`, an epoch can end before the batch count
    Keras expects (or Keras cannot know the count); that is the policy at
    work, reported by the PrefetchCallback, not a short dataset. So is an
    epoch resumed by `DataBackup` after its saved batch, and the epochs of
    a device buffer, whose copy to the device hides the batch count from
    Keras, and of a stage on the tf.data service in `parallel_epochs` mode
    (its count depends on the number of workers).
    """
    quiet = (
        bool(layer.stage_options.ignored_exception_types)
        or any(data.staged.device is not None for data in built)
        or any(data.staged.stage_options.service is not None for data in built)
        or any(isinstance(cb, DataBackup) for cb in callbacks)
    )
    with warnings.catch_warnings():
        if quiet:
            warnings.filterwarnings(
                "ignore",
                message="Your input ran out of data",
                category=UserWarning,
            )
        yield


def _bind(model, prefetch, state, phase, data):
    """Hands `data`'s stage to the callback and its runner to the step guard."""
    prefetch.attach(phase, data.staged, data.adapter)
    _bind_placement(model, state, phase, data.staged.placement)
    state.runners[phase] = data.staged.runner
    if data.in_step:
        state.recording[phase] = data.staged.stats
    else:
        state.recording.pop(phase, None)


def _drop_traced_steps(model, state, phase):
    """Makes `phase`'s next staged or plain call trace its step afresh."""
    setattr(model, _FUNCTIONS[phase], None)
    for key in [k for k in state.staged_functions if k[0] == phase]:
        del state.staged_functions[key]


def _bind_placement(model, state, phase, placement):
    """Makes `phase`'s step unpack what `placement` packed.

    The traced step bakes the unpacking in; tf.function retraces when the
    packed element's spec changes, but two structures can pack to the same
    spec, so a new layout also drops the phase's traced steps.
    """
    layout = None if placement.packer is None else placement.unpacked_spec
    if state.layouts.get(phase) != layout:
        _drop_traced_steps(model, state, phase)
    state.layouts[phase] = layout
    state.placements[phase] = placement


def _release_placements(model, state, phases):
    """Ends the phases' placements at the end of a call.

    A plain step that was traced unpacking packed elements (a run without
    a SmartStage split uses Keras's own step) is traced afresh next time.
    """
    for phase in phases:
        placement = state.placements.pop(phase, None)
        if placement is not None and placement.packer is not None:
            setattr(model, _FUNCTIONS[phase], None)
            state.layouts.pop(phase, None)


def _unpacked(model, phase, data):
    """The step's `data`, unpacked on the device if its stage packed it."""
    placement = _state(model).placements.get(phase)
    return data if placement is None else placement.unpack(data)


def _step_stats(model, layer, phase):
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
            _drop_traced_steps(model, state, phase)
        stats = layer.new_stats(f"{layer.stage_options.name}_{phase}")
        state.step_stats[phase] = stats
    return stats


# The logs key under which a recorded step returns its stage's report
# (`StageStats.report`) to its guard, which removes it before Keras sees it.
_REPORT_KEY = "_keras_stage_report"


def _recorded_step(model, phase, step, data):
    """Runs `step(data)`, recording its fetch where `phase` records.

    keras_stage's own train/test step returns its stage's report in its
    logs (`_REPORT_KEY`): the guard accumulates the fetch's wait in Python
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
        return step(data)  # its batch was buffered: see `_UnrecordedStep`
    fetch = stats.record_fetch(data, accumulate=False)
    outputs = step(data)
    end = stats.record_step_end(outputs)
    # Keras's own steps return dicts.
    if not _own_step(model, phase) or not isinstance(outputs, dict):
        stats.accumulate(fetch)
        return outputs
    if model.steps_per_execution > 1:
        stats.accumulate(fetch)
        fetch = None
    return {**outputs, _REPORT_KEY: stats.report(fetch, end)}


def _own_step(model, phase):
    """Whether `phase`'s step is keras_stage's, whose logs reach the guard."""
    name = f"{phase}_step"
    return getattr(type(model), name) is getattr(StagingMixin, name)


def _reported(outputs):
    """`(outputs, report)`: a step's outputs without its report, and it.

    `report` is None when the step returned none (see `_recorded_step`).
    """
    if isinstance(outputs, dict) and _REPORT_KEY in outputs:
        outputs = dict(outputs)
        return outputs, outputs.pop(_REPORT_KEY)
    return outputs, None


@contextlib.contextmanager
def _staged_steps(model, phases, splits):
    """Runs a fit/evaluate/predict call with the steps of its splits.

    `splits` maps each phase to its SmartStage split or None. While the call
    runs, the model's compiled steps of those phases are the staged ones
    (traced on the trunk), cached between calls; the plain ones are put
    back afterwards. Restores the outer call's splits, for an evaluate run
    from a callback of a staged fit.
    """
    state = _state(model)
    saved = {p: state.active.get(p) for p in phases}
    if not any(splits.values()) and not any(saved.values()):
        yield
        return
    plain = {}
    for phase in phases:
        attr = _FUNCTIONS[phase]
        plain[phase] = getattr(model, attr, None)
        key = (phase, id(splits[phase]) if splits[phase] else None)
        setattr(model, attr, state.staged_functions.get(key))
        state.active[phase] = splits[phase]
    jit = state.staged_jit
    if splits.get("train") is not None or splits.get("test") is not None:
        state.staged_jit = _trunk_jit(model, splits)
    try:
        yield
    finally:
        for phase in phases:
            attr = _FUNCTIONS[phase]
            key = (phase, id(splits[phase]) if splits[phase] else None)
            state.staged_functions[key] = getattr(model, attr, None)
            setattr(model, attr, plain[phase])
            state.active[phase] = saved[phase]
        state.staged_jit = jit


# The key of the compiled steps of calls that skip their stage.
_UNSTAGED = "unstaged"


@contextlib.contextmanager
def _unstaged_steps(model, phases):
    """Runs a call that skips its stage, with steps traced for that alone.

    They run the whole model and record nothing: a stage-only call (no
    split) records its fetches in Keras's own compiled step, which an
    unstaged call must not run. Puts the outer call's steps, runner and
    recording back afterwards (an evaluate from a callback of a fit).
    """
    state = _state(model)
    saved = {}
    for phase in phases:
        attr = _FUNCTIONS[phase]
        saved[phase] = (
            getattr(model, attr, None),
            state.active.get(phase),
            state.runners.pop(phase, None),
            state.recording.pop(phase, None),
        )
        setattr(model, attr, state.staged_functions.get((phase, _UNSTAGED)))
        state.active[phase] = None
    try:
        yield
    finally:
        for phase in phases:
            attr = _FUNCTIONS[phase]
            state.staged_functions[(phase, _UNSTAGED)] = getattr(
                model, attr, None
            )
            function, active, runner, recording = saved[phase]
            setattr(model, attr, function)
            state.active[phase] = active
            for bindings, value in (
                (state.runners, runner),
                (state.recording, recording),
            ):
                if value is not None:
                    bindings[phase] = value


def _trunk_jit(model, splits):
    """Whether staged steps are XLA-compiled, or None for Keras's choice.

    Keras turns `jit_compile=True` off for a model with a layer XLA cannot
    compile (string ops, lookups); those are usually the staged ones, so
    the trunk can honour the user's request.
    """
    requested = _state(model).requested_jit
    if requested is not True:
        return None
    for split in splits.values():
        if split is None:
            continue
        layers = all_layers(split.trunk)
        if not all(getattr(layer, "supports_jit", True) for layer in layers):
            warnings.warn(
                f"jit_compile=True: the trunk of model '{model.name}' still "
                "has a layer XLA cannot compile; its steps run without XLA.",
                stacklevel=4,
            )
            return False
    return True


@contextlib.contextmanager
def _calling_trunk(model, phase):
    """Within a step's trace, makes the model's call run `phase`'s trunk."""
    state = _state(model)
    split = state.active.get(phase)
    previous = getattr(state.local, "trunk", None)
    state.local.trunk = None if split is None else split.trunk
    try:
        yield
    finally:
        state.local.trunk = previous


def _build_for_strategy(model, data):
    """Builds metrics from the raw data when a strategy would use the cut.

    See `_compat.symbolic_build`. Without a strategy Keras builds them
    inside the traced step, where the model's call runs the trunk.
    """
    if data.split is None or data.element_spec is None:
        return
    strategy = model.distribute_strategy
    if (
        tf.distribute.has_strategy()
        or strategy is not tf.distribute.get_strategy()
    ):
        with strategy.scope():
            _compat.symbolic_build(model, data.element_spec)


def _track_iterator(state, phase, iterator):
    """Notes the iterator `phase`'s step reads; restores it first if asked.

    See `DataBackup`: a resumed epoch's iterator continues from the saved
    position before its first step.
    """
    restore = state.pending_restores.pop(phase, None)
    if restore is not None:
        restore(iterator)
    try:
        state.iterators[phase] = weakref.ref(iterator)
    except TypeError:  # not weakly referable: not checkpointable either
        state.iterators.pop(phase, None)


def _with_data_backup(model, callbacks):
    """`callbacks` with a `DataBackup` right after a `BackupAndRestore`."""
    state = _state(model)
    out = []
    for callback in callbacks:
        out.append(callback)
        if isinstance(callback, keras.callbacks.BackupAndRestore):

            def current(state=state):
                ref = state.iterators.get("train")
                return None if ref is None else ref()

            def restore_next(restore, state=state):
                state.pending_restores["train"] = restore

            out.append(DataBackup(callback, current, restore_next))
    return out


def _end_call(model, prefetch, built):
    """Ends a fit/evaluate/predict call: its stages and their threads."""
    try:
        for data in built:
            if data.owned:
                adaptive.note_work(model, data)
            data.end_call()
    finally:
        prefetch.close()


def _with_prefetch_callback(callbacks):
    """The callback list with a PrefetchCallback first, and that callback."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        raise TypeError(
            "A keras_stage model needs `callbacks` as a list, not a "
            "CallbackList, so that it can add its PrefetchCallback. "
            "Pass the list of callbacks."
        )
    callbacks = list(callbacks or [])
    found = [cb for cb in callbacks if isinstance(cb, PrefetchCallback)]
    if len(found) > 1:
        raise ValueError(
            "Pass at most one PrefetchCallback; received "
            f"{len(found)}. One callback reports the model's stage."
        )
    prefetch = found[0] if found else PrefetchCallback()
    others = [cb for cb in callbacks if cb is not prefetch]
    return [prefetch] + others, prefetch


class StagingMixin:
    """Adds staging to a Keras model class; see the module docstring."""

    # -- compile ----------------------------------------------------------

    def compile(self, *args, smart_stage=False, **kwargs):
        """Configures the model for training; see `keras.Model.compile`.

        Args:
            *args: Passed to `keras.Model.compile`.
            smart_stage: Whether fit/evaluate/predict run the longest
                prefix of the model that training does not change inside
                the stage: `True` stops before a layer that would inflate
                the tensors handed to the train step (the transfer-aware
                cut), `"longest"` stages the longest prefix regardless,
                `False` stages nothing. Defaults to `False`.
            **kwargs: Passed to `keras.Model.compile`.
        """
        # By type too: 1 == True, and NumPy values are not accepted.
        if not any(
            type(smart_stage) is type(v) and smart_stage == v
            for v in _SMART_STAGE_VALUES
        ):
            raise ValueError(
                "Invalid value for argument `smart_stage`. Expected True, "
                f'False or "longest". Received: smart_stage={smart_stage!r}'
            )
        state = _state(self)
        state.requested_jit = kwargs.get("jit_compile", "auto")
        with warnings.catch_warnings():
            if smart_stage and state.requested_jit is True:
                # Keras drops jit_compile for a model with string ops; the
                # staged trunk may still take it (see `_trunk_jit`).
                warnings.filterwarnings(
                    "ignore", message="Model doesn't support `jit_compile"
                )
            super().compile(*args, **kwargs)
        state.smart_stage = smart_stage
        state.plan = state.split = None
        state.staged_functions.clear()
        state.announced = False
        state.costs = CallCosts()

    def get_stage_plan(self):
        """The SmartStage plan of this model: what the stage runs, and why.

        Available once the model is built and compiled, whatever the
        `smart_stage` value (with `smart_stage=False` it shows what
        `smart_stage=True` would stage).

        Returns:
            A `keras_stage.StagePlan`.
        """
        return self._stage_plan()[0]

    def stage_summary(self, print_fn=None, line_length=None):
        """Prints the SmartStage plan, in the look of `model.summary()`.

        Args:
            print_fn: Called with each line; defaults to `print`.
            line_length: Total width of the tables. Defaults to 98.
        """
        self.get_stage_plan().summary(print_fn, line_length=line_length)

    def _stage_plan(self):
        state = _state(self)
        if not self.compiled:
            raise ValueError(
                f"Model '{self.name}' has no stage plan yet: call "
                "`compile(..., smart_stage=True)` first."
            )
        if state.plan is None:
            # With smart_stage=False the plan shows what True would stage.
            mode = "longest" if state.smart_stage == "longest" else True
            state.plan, state.split = plan_model(
                self, find_staged_input(self), smart_stage=mode
            )
        return state.plan, state.split

    def _stage_setup(self):
        """The stage boundary layer and SmartStage split of a run.

        Returns `(layer, split)`; `layer` is None when nothing is staged.
        """
        state = _state(self)
        layer = find_staged_input(self)
        if not state.smart_stage:
            return layer, None
        plan, split = self._stage_plan()
        if not state.announced:
            state.announced = True
            if plan.note:
                warnings.warn(plan.note, stacklevel=3)
            elif layer is None:
                logger.info(
                    "smart_stage: model '%s' has no StagedInput, so the "
                    "stage starts at its inputs with default options. Add "
                    "keras_stage.layers.StagedInput after the inputs to set "
                    "them.",
                    self.name,
                )
        if layer is None:
            if state.default_input is None:
                state.default_input = StagedInput(name=f"{self.name}_stage")
            layer = state.default_input
        return layer, split

    # -- the model's call in staged steps ---------------------------------

    def __call__(self, *args, **kwargs):
        trunk = getattr(_state(self).local, "trunk", None)
        if trunk is not None:
            return trunk(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def train_step(self, data):
        data = _unpacked(self, "train", data)
        with _calling_trunk(self, "train"):
            return _recorded_step(self, "train", super().train_step, data)

    def test_step(self, data):
        data = _unpacked(self, "test", data)
        with _calling_trunk(self, "test"):
            return _recorded_step(self, "test", super().test_step, data)

    def predict_step(self, data):
        data = _unpacked(self, "predict", data)
        with _calling_trunk(self, "predict"):
            return super().predict_step(data)

    @property
    def jit_compile(self):
        staged = _state(self).staged_jit
        if staged is not None:
            return staged
        return keras.Model.jit_compile.fget(self)

    @jit_compile.setter
    def jit_compile(self, value):
        keras.Model.jit_compile.fset(self, value)

    @property
    def smart_stage(self):
        """The `smart_stage` value given to `compile`."""
        return _state(self).smart_stage

    def get_compile_config(self):
        config = super().get_compile_config()
        if config:
            config["smart_stage"] = _state(self).smart_stage
        return config

    def compile_from_config(self, config):
        # Keras skips compile on load for models that override compile;
        # this does what Keras's own compile_from_config does, plus
        # smart_stage.
        config = dict(config)
        smart_stage = config.pop("smart_stage", False)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config, smart_stage=smart_stage)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    # -- compiled steps ---------------------------------------------------

    def make_train_function(self, force=False):
        super().make_train_function(force=force)
        if not getattr(self.train_function, "keras_stage_guarded", False):
            self.train_function = _guard(self, "train", self.train_function)
        return self.train_function

    def make_test_function(self, force=False):
        super().make_test_function(force=force)
        if not getattr(self.test_function, "keras_stage_guarded", False):
            self.test_function = _guard(self, "test", self.test_function)
        return self.test_function

    # -- fit / evaluate / predict -----------------------------------------

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
    ):
        def unstaged():
            return super(StagingMixin, self).fit(
                x=x,
                y=y,
                batch_size=batch_size,
                epochs=epochs,
                verbose=verbose,
                callbacks=callbacks,
                validation_split=validation_split,
                validation_data=validation_data,
                shuffle=shuffle,
                class_weight=class_weight,
                sample_weight=sample_weight,
                initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch,
                validation_steps=validation_steps,
                validation_batch_size=validation_batch_size,
                validation_freq=validation_freq,
            )

        layer, split = self._stage_setup()
        if layer is None:
            return unstaged()
        callbacks, prefetch = _with_prefetch_callback(callbacks)
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = (
                _compat.train_validation_split(
                    (x, y, sample_weight), validation_split
                )
            )
            validation_split = 0.0
        if not adaptive.fit_stages(
            self,
            layer,
            x,
            validation_data,
            batch_size=batch_size,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        ):
            try:
                with _unstaged_steps(self, ("train", "test")):
                    return unstaged()
            finally:
                prefetch.close()
        callbacks = _with_data_backup(self, callbacks)
        state = _state(self)
        built = []
        try:
            train = adaptive.staged_data(
                self,
                "train",
                layer,
                "train",
                x,
                y,
                sample_weight,
                batch_size=batch_size,
                steps=steps_per_epoch,
                shuffle=shuffle,
                class_weight=class_weight,
                split=split,
                stats=_step_stats(self, layer, "train"),
                strategy=self.distribute_strategy,
            )
            built.append(train)
            _bind(self, prefetch, state, "train", train)
            val_pipeline, val_split = None, None
            if validation_data is not None:
                val_x, val_y, val_sw = keras.utils.unpack_x_y_sample_weight(
                    validation_data
                )
                val = adaptive.staged_data(
                    self,
                    "test",
                    layer,
                    "val",
                    val_x,
                    val_y,
                    val_sw,
                    batch_size=validation_batch_size or batch_size,
                    steps=validation_steps,
                    split=split,
                    stats=_step_stats(self, layer, "test"),
                    strategy=self.distribute_strategy,
                )
                built.append(val)
                _bind(self, prefetch, state, "test", val)
                val_pipeline, val_split = val.pipeline, val.split
            _build_for_strategy(self, train)
            splits = {"train": train.split, "test": val_split}
            with (
                _skips_end_epochs_early(layer, built, callbacks),
                _staged_steps(self, ("train", "test"), splits),
            ):
                return super().fit(
                    x=train.pipeline,
                    epochs=epochs,
                    verbose=verbose,
                    callbacks=callbacks,
                    validation_data=val_pipeline,
                    shuffle=False,
                    initial_epoch=initial_epoch,
                    steps_per_epoch=steps_per_epoch,
                    validation_steps=validation_steps,
                    validation_freq=validation_freq,
                )
        finally:
            state.runners.clear()
            state.recording.clear()
            state.iterators.clear()
            state.pending_restores.clear()
            _release_placements(self, state, ("train", "test"))
            _end_call(self, prefetch, built)

    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict=False,
        **kwargs,
    ):
        def unstaged():
            return super(StagingMixin, self).evaluate(
                x=x,
                y=y,
                batch_size=batch_size,
                verbose=verbose,
                sample_weight=sample_weight,
                steps=steps,
                callbacks=callbacks,
                return_dict=return_dict,
                **kwargs,
            )

        layer, split = self._stage_setup()
        if layer is None or kwargs.get("_use_cached_eval_dataset"):
            # Unstaged, or the validation of a fit (staged with the fit).
            return unstaged()
        # Checked whichever way the call runs; an unstaged one gets the
        # user's callbacks as they are.
        staged_callbacks, prefetch = _with_prefetch_callback(callbacks)
        if not adaptive.stages(
            self, layer, "test", array_batches(x, batch_size, steps)
        ):
            with _unstaged_steps(self, ("test",)):
                return unstaged()
        callbacks = staged_callbacks
        state = _state(self)
        # Set when evaluate runs inside fit (from a callback): the runner of
        # the fit's validation stage, restored afterwards.
        outer_runner = state.runners.get("test")
        outer_recording = state.recording.get("test")
        outer_placement = state.placements.get("test")
        built = []
        try:
            test = adaptive.staged_data(
                self,
                "test",
                layer,
                "test",
                x,
                y,
                sample_weight,
                batch_size=batch_size,
                steps=steps,
                split=split,
                stats=_step_stats(self, layer, "test"),
                strategy=self.distribute_strategy,
            )
            built.append(test)
            _bind(self, prefetch, state, "test", test)
            _build_for_strategy(self, test)
            with (
                _skips_end_epochs_early(layer, built, callbacks),
                _staged_steps(self, ("test",), {"test": test.split}),
            ):
                return super().evaluate(
                    x=test.pipeline,
                    verbose=verbose,
                    steps=steps,
                    callbacks=callbacks,
                    return_dict=return_dict,
                    **kwargs,
                )
        finally:
            for bindings, outer in (
                (state.runners, outer_runner),
                (state.recording, outer_recording),
            ):
                if outer is None:
                    bindings.pop("test", None)
                else:
                    bindings["test"] = outer
            if outer_placement is None:
                _release_placements(self, state, ("test",))
            else:
                _bind_placement(self, state, "test", outer_placement)
            _end_call(self, prefetch, built)

    def predict(
        self, x, batch_size=None, verbose="auto", steps=None, callbacks=None
    ):
        layer, split = self._stage_setup()

        def unstaged():
            return super(StagingMixin, self).predict(
                x,
                batch_size=batch_size,
                verbose=verbose,
                steps=steps,
                callbacks=callbacks,
            )

        if layer is None:
            return unstaged()
        # Checked whichever way the call runs (see `evaluate`).
        staged_callbacks, prefetch = _with_prefetch_callback(callbacks)
        if not adaptive.stages(
            self, layer, "predict", array_batches(x, batch_size, steps)
        ):
            with _unstaged_steps(self, ("predict",)):
                return unstaged()
        callbacks = staged_callbacks
        built = []
        try:
            data = adaptive.staged_data(
                self,
                "predict",
                layer,
                "predict",
                x,
                batch_size=batch_size,
                steps=steps,
                split=split,
            )
            built.append(data)
            prefetch.attach("predict", data.staged, data.adapter)
            _bind_placement(
                self, _state(self), "predict", data.staged.placement
            )
            # Keras fetches predict batches in Python: the staged dataset's
            # own iterator applies the stage's policies there.
            with _staged_steps(self, ("predict",), {"predict": data.split}):
                return super().predict(
                    data.eager_dataset,
                    verbose=verbose,
                    steps=steps,
                    callbacks=callbacks,
                )
        finally:
            _release_placements(self, _state(self), ("predict",))
            _end_call(self, prefetch, built)
