"""`StagingMixin`: the model API of `keras_stage.Model` and `Sequential`.

`compile` takes `smart_stage`; `fit`, `evaluate` and `predict` of a model
with a `StagedInput` (or `smart_stage`) run as a `StagedCall`, unless
`decision/calls.py` runs them unstaged; the steps are the backend's. A
model with neither behaves exactly like its Keras base class.
"""

import functools
import logging
import time
import warnings

import keras

from keras_stage import _compat
from keras_stage.layers.staged_input import StagedInput
from keras_stage.models import backends
from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.call import facts
from keras_stage.models.call.staged_call import StagedCall
from keras_stage.models.data_adapters.batches import (
    call_batches,
    validation_runs,
)
from keras_stage.models.decision import learned
from keras_stage.models.iterators import kept_iterators
from keras_stage.models.model_state import state as _state
from keras_stage.planner import subclass_graph
from keras_stage.planner.planner import plan_model

logger = logging.getLogger("keras_stage")

_SMART_STAGE_VALUES = (True, False, "longest")


def find_staged_input(model):
    """The model's `StagedInput` or None, checked where it stands (kept
    until the model's layers change)."""
    layers = tuple(model.layers)
    kept = _state(model).staged_input
    if kept is not None and kept[0] == layers:
        return kept[1]
    layer = _checked_staged_input(model, layers)
    _state(model).staged_input = (layers, layer)
    return layer


def _checked_staged_input(model, layers):
    found = [layer for layer in layers if isinstance(layer, StagedInput)]
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
        if layers[0] is not layer:
            raise ValueError(
                f"StagedInput '{layer.name}' must be the first layer of "
                f"Sequential model '{model.name}'; found it at position "
                f"{layers.index(layer)}. Move it right after "
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
    layer.staged_by_model = True  # keras_stage runs its steps: see `call`
    return layer


class StagingMixin:
    """Adds staging to a Keras model class; see the module docstring."""

    def __init_subclass__(cls, **kwargs):
        # A subclass's own `call` and steps run the SmartStage trunk in a
        # staged step: Keras's JAX and torch steps call `call` directly.
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith("keras_stage."):
            return  # keras_stage's own classes run it already
        # Resolved through the bases: a mixin's methods count too.
        if not _routed(cls.call):
            cls.call = _trunk_call(cls.call)
        for phase in ("train", "test", "predict"):
            step = getattr(cls, f"{phase}_step")
            if not _routed(step):
                setattr(cls, f"{phase}_step", _trunk_step(step, phase))

    def __setattr__(self, name, value):
        # While the planner traces the call: what it sets (a side effect).
        sets = self.__dict__.get(subclass_graph.SETS_ATTRIBUTE)
        if sets is not None:
            sets.append(name)
        super().__setattr__(name, value)

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
                # The staged trunk may still take it (`_trunk_jit`).
                warnings.filterwarnings(
                    "ignore", message="Model doesn't support `jit_compile"
                )
            super().compile(*args, **kwargs)
        state.smart_stage = smart_stage
        state.plan = state.split = None
        state.steps.staged_functions.clear()
        kept_iterators.retire_all(state.stages)
        state.announced = False
        learned.forget(self)

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
            started = time.perf_counter()
            unbuilt = not self.built
            plan, split = plan_model(
                self,
                find_staged_input(self),
                smart_stage=mode,
                backend=self._stage_backend,
                input_specs=state.input_specs,
            )
            if plan.pending:
                return plan, split  # planned once its inputs are known
            state.built_by_plan = unbuilt and self.built
            state.plan, state.split = plan, split
            if state.smart_stage:
                facts.costs(self).note_plan(time.perf_counter() - started)
        return state.plan, state.split

    def _note_inputs(self, x):
        """Keeps a subclassed model's input specs, from its first data or
        call that tells them: its plan traces its call on them."""
        state = _state(self)
        if state.input_specs is not None or not _subclassed(self):
            return
        state.input_specs = subclass_graph.input_specs(x)

    def _stage_setup(self):
        """The call's `StagedInput` (a default one for SmartStage), or None."""
        state = _state(self)
        layer = find_staged_input(self)
        if layer is None and state.smart_stage:
            if state.default_input is None:
                state.default_input = StagedInput(name=f"{self.name}_stage")
            layer = state.default_input
        return layer

    def _stage_split(self, stacklevel=2):
        """The SmartStage split a staged call runs, or None; announced once
        (`stacklevel`: the user's call, as `warnings.warn` counts from the
        caller)."""
        state = _state(self)
        if not state.smart_stage:
            return None
        plan, split = self._stage_plan()
        self._stage_backend.check_plan(self, plan, state.input_specs)
        if not state.announced:
            state.announced = True
            if plan.note:
                warnings.warn(plan.note, stacklevel=stacklevel + 1)
            elif find_staged_input(self) is None:
                logger.info(
                    "smart_stage: model '%s' has no StagedInput, so the "
                    "stage starts at its inputs with default options. Add "
                    "keras_stage.layers.StagedInput after the inputs to set "
                    "them.",
                    self.name,
                )
        return split

    # -- the model's call in staged steps ---------------------------------

    def __call__(self, *args, **kwargs):
        if tensorflow_steps.active_split(self) is not None:
            return tensorflow_steps.call_model(self, None, *args, **kwargs)
        if _subclassed(self) and subclass_graph.inlines(args):
            return subclass_graph.inline_call(self, *args, **kwargs)
        if args:
            self._note_inputs(args[0])
        return super().__call__(*args, **kwargs)

    def call(self, inputs, training=None, mask=None, **kwargs):
        # Keras's JAX step calls `call` itself (`stateless_call`).
        return tensorflow_steps.call_model(
            self, super().call, inputs, training=training, mask=mask, **kwargs
        )

    call.keras_stage_routed = True

    # The steps take `(data)` on TensorFlow, `(state, data)` on JAX.

    @tensorflow_steps.own
    def train_step(self, *args):
        return self._stage_backend.step(
            self, "train", super().train_step, *args
        )

    @tensorflow_steps.own
    def test_step(self, *args):
        return self._stage_backend.step(self, "test", super().test_step, *args)

    @tensorflow_steps.own
    def predict_step(self, *args):
        return self._stage_backend.step(
            self, "predict", super().predict_step, *args
        )

    @property
    def _stage_backend(self):
        # Also what `plan_model` reads: the planner imports no model.
        return backends.for_model(self)

    @property
    def jit_compile(self):
        staged = _state(self).steps.staged_jit
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
        # Keras's own, plus smart_stage (Keras skips an overridden compile).
        config = dict(config)
        smart_stage = config.pop("smart_stage", False)
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config, smart_stage=smart_stage)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    def export(self, filepath, format="tf_saved_model", **kwargs):
        """Exports the model for inference; see `keras.Model.export`.

        Off TensorFlow, a model with string inputs is refused with how to
        export it from the TensorFlow backend.
        """
        self._stage_backend.check_exportable(self)
        return super().export(filepath, format=format, **kwargs)

    # -- compiled steps ---------------------------------------------------

    def make_train_function(self, force=False):
        make = functools.partial(super().make_train_function, force=force)
        return self._stage_backend.make_function(self, "train", make)

    def make_test_function(self, force=False):
        make = functools.partial(super().make_test_function, force=force)
        return self._stage_backend.make_function(self, "test", make)

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
        given = _given(locals())
        layer = self._stage_setup()
        if layer is None:
            return super().fit(**given)
        self._note_inputs(x)
        backend = self._stage_backend
        backend.check_supported(self, layer)
        backend.check_strategy(self)
        call = StagedCall(
            self,
            layer,
            ("train", "test"),
            callbacks,
            steps_per_epoch,
            verbose=verbose,
        )
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = (
                _compat.train_validation_split(
                    backend.host_arrays((x, y, sample_weight)),
                    validation_split,
                )
            )
            # An unstaged fit runs on the same split.
            given.update(
                x=x,
                y=y,
                sample_weight=sample_weight,
                validation_split=0.0,
                validation_data=validation_data,
            )
        # One iterator across the epochs, unless BackupAndRestore
        # checkpoints each epoch's.
        long_lived = not any(
            isinstance(cb, keras.callbacks.BackupAndRestore)
            for cb in call.callbacks
        )
        if backend.may_run_unstaged and not facts.fit_stages(
            self,
            layer,
            x,
            validation_data,
            long_lived=long_lived,
            batch_size=batch_size,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        ):
            return call.run_unstaged(functools.partial(super().fit, **given))
        call.split = self._stage_split()
        # (None, None, None) without validation data.
        val_x, val_y, val_sw = keras.utils.unpack_x_y_sample_weight(
            validation_data
        )
        left = max(epochs - initial_epoch, 0)  # the epochs this fit runs
        with call:
            train = call.stage(
                "train",
                "train",
                x,
                y,
                sample_weight,
                batch_size=batch_size,
                steps=steps_per_epoch,
                shuffle=shuffle,
                class_weight=class_weight,
                epochs=left if long_lived else None,
                steps_per_execution=self.steps_per_execution,
                alongside=() if validation_data is None else (val_x,),
            )
            val = None
            if validation_data is not None:
                runs = validation_runs(initial_epoch, epochs, validation_freq)
                val = call.stage(
                    "test",
                    "val",
                    val_x,
                    val_y,
                    val_sw,
                    batch_size=validation_batch_size or batch_size,
                    steps=validation_steps,
                    epochs=runs if long_lived else None,
                    steps_per_execution=self.steps_per_execution,
                    alongside=(x,),
                )
            return call.run(
                super().fit,
                x=call.feed(train),
                epochs=epochs,
                verbose=verbose,
                validation_data=None if val is None else call.feed(val),
                shuffle=False,
                initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch,
                validation_steps=validation_steps,
                validation_freq=validation_freq,
            )

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
        given = _given(locals())
        return self._one_phase_call(
            "test", super().evaluate, given, return_dict=return_dict, **kwargs
        )

    def predict(
        self, x, batch_size=None, verbose="auto", steps=None, callbacks=None
    ):
        given = _given(locals())
        return self._one_phase_call("predict", super().predict, given)

    def _one_phase_call(self, phase, keras_call, given, **kwargs):
        """Runs an evaluate or predict call, staged if the policy decides so.

        Args:
            phase: `"test"` or `"predict"`, also the stage's role.
            keras_call: Keras's method, bound (`super().evaluate`).
            given: The user's arguments (`_given`): the unstaged call.
            **kwargs: `keras_call`'s further arguments when staged.
        """
        x, batch_size, steps = given["x"], given["batch_size"], given["steps"]
        layer = self._stage_setup()
        if layer is None or _compat.is_fit_validation(given):
            # Unstaged, or the validation of a fit (staged with the fit).
            return keras_call(**given)
        self._note_inputs(x)
        backend = self._stage_backend
        backend.check_supported(self, layer)
        # Made first: its callbacks are checked whichever way the call runs.
        call = StagedCall(
            self,
            layer,
            (phase,),
            given["callbacks"],
            verbose=given["verbose"],
            stacklevel=3,
        )
        if backend.may_run_unstaged and not facts.stages(
            self,
            layer,
            phase,
            call_batches(x, batch_size, steps),
            iterators=facts.iterators_made(self, phase, x),
            x=x,
        ):
            return call.run_unstaged(functools.partial(keras_call, **given))
        call.split = self._stage_split(stacklevel=3)
        with call:
            data = call.stage(
                phase,
                phase,
                x,
                given.get("y"),
                given.get("sample_weight"),
                batch_size=batch_size,
                steps=steps,
                epochs=1,  # a kept stage's iterator may run on past it
                steps_per_execution=self.steps_per_execution,
            )
            return call.run(
                keras_call,
                x=call.feed(data),
                verbose=given["verbose"],
                steps=steps,
                **kwargs,
            )


def _subclassed(model):
    """Whether `model` is a subclass with its own call (not functional)."""
    return not isinstance(
        model, (keras.Sequential, _compat.keras_functional_class())
    )


def _routed(method):
    """Whether a model class's method already runs the trunk."""
    return getattr(method, "keras_stage_step", False) or getattr(
        method, "keras_stage_routed", False
    )


def _trunk_call(call):
    """A subclass's `call`, calling the trunk instead in a staged step."""

    @functools.wraps(call)
    def routed(self, *args, **kwargs):
        if tensorflow_steps.active_split(self) is None:
            return call(self, *args, **kwargs)
        return tensorflow_steps.call_model(self, None, args[0], **kwargs)

    routed.keras_stage_routed = True
    return routed


def _trunk_step(step, phase):
    """A subclass's own `phase` step, its `self(...)` running the trunk."""

    @functools.wraps(step)
    def routed(self, *args):
        with tensorflow_steps.calling_trunk(self, phase):
            return step(self, *args)

    routed.keras_stage_step = False  # not keras_stage's (`own_step`)
    routed.keras_stage_routed = True
    return routed


def _given(arguments):
    """The user's arguments to a model method, from its `locals()` on entry
    (`__class__` is there for `super()`), with its `**kwargs` spread."""
    given = dict(arguments)
    del given["self"]
    given.pop("__class__", None)
    given.update(given.pop("kwargs", {}))
    return given
