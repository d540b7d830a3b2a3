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

A model without a `StagedInput` behaves exactly like its Keras base class.
"""

import contextlib
import warnings

import keras

from keras_stage.callbacks.prefetch_callback import PrefetchCallback
from keras_stage.data.errors import StageTimeoutError
from keras_stage.data.runner import EndOfData, SkipElement
from keras_stage.layers.staged_input import StagedInput
from keras_stage.models.inputs import stage_data

_SMART_STAGE_VALUES = (True, False)


class _StagingState:
    """Per-model run state, kept out of Keras's attribute tracking."""

    def __init__(self):
        self.smart_stage = False
        self.runners = {}


def _state(model):
    state = model.__dict__.get("_keras_stage_state")
    if state is None:
        state = _StagingState()
        # A plain object, so Keras's tracker neither tracks nor saves it.
        object.__setattr__(model, "_keras_stage_state", state)
    return state


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

    def guarded(iterator):
        runner = _state(model).runners.get(phase)
        if runner is None:
            return function(iterator)
        while True:
            try:
                return runner.call(function, iterator, check_origin=True)
            except SkipElement:
                continue
            except EndOfData:
                # Keras ends the epoch on StopIteration.
                raise StopIteration from None
            except StageTimeoutError:
                # The abandoned call still runs this compiled function, and
                # TensorFlow runs the calls of one tf.function one at a
                # time: the next fit/evaluate must trace a fresh one.
                if phase == "train":
                    model.train_function = None
                else:
                    model.test_function = None
                raise

    guarded.keras_stage_guarded = True
    return guarded


@contextlib.contextmanager
def _skips_end_epochs_early(layer):
    """Silences Keras's "ran out of data" warning when batches may be skipped.

    With `ignored_exception_types`, an epoch can end before the batch count
    Keras expects (or Keras cannot know the count); that is the policy at
    work, reported by the PrefetchCallback, not a short dataset.
    """
    with warnings.catch_warnings():
        if layer.stage_options.ignored_exception_types:
            warnings.filterwarnings(
                "ignore",
                message="Your input ran out of data",
                category=UserWarning,
            )
        yield


def _bind(prefetch, state, phase, data):
    """Hands `data`'s stage to the callback and its runner to the step guard."""
    prefetch.attach(phase, data.staged, data.adapter)
    state.runners[phase] = data.staged.runner


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
                the stage. Defaults to `False`.
            **kwargs: Passed to `keras.Model.compile`.
        """
        if smart_stage not in _SMART_STAGE_VALUES or not isinstance(
            smart_stage, bool
        ):
            raise ValueError(
                "Invalid value for argument `smart_stage`. Expected True or "
                f"False. Received: smart_stage={smart_stage!r}"
            )
        super().compile(*args, **kwargs)
        _state(self).smart_stage = smart_stage

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
        layer = find_staged_input(self)
        if layer is None:
            return super().fit(
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
        if validation_split and validation_data is None:
            from keras_stage import _compat

            (x, y, sample_weight), validation_data = (
                _compat.train_validation_split(
                    (x, y, sample_weight), validation_split
                )
            )
        callbacks, prefetch = _with_prefetch_callback(callbacks)
        state = _state(self)
        try:
            train = stage_data(
                layer,
                "train",
                x,
                y,
                sample_weight,
                batch_size=batch_size,
                steps=steps_per_epoch,
                shuffle=shuffle,
                class_weight=class_weight,
            )
            _bind(prefetch, state, "train", train)
            val_pipeline = None
            if validation_data is not None:
                val_x, val_y, val_sw = keras.utils.unpack_x_y_sample_weight(
                    validation_data
                )
                val = stage_data(
                    layer,
                    "val",
                    val_x,
                    val_y,
                    val_sw,
                    batch_size=validation_batch_size or batch_size,
                    steps=validation_steps,
                )
                _bind(prefetch, state, "test", val)
                val_pipeline = val.pipeline
            with _skips_end_epochs_early(layer):
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
            prefetch.close()

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
        layer = find_staged_input(self)
        if layer is None or kwargs.get("_use_cached_eval_dataset"):
            # Unstaged, or the validation of a staged fit (already staged).
            return super().evaluate(
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
        callbacks, prefetch = _with_prefetch_callback(callbacks)
        state = _state(self)
        # Set when evaluate runs inside fit (from a callback): the runner of
        # the fit's validation stage, restored afterwards.
        outer_runner = state.runners.get("test")
        try:
            test = stage_data(
                layer,
                "test",
                x,
                y,
                sample_weight,
                batch_size=batch_size,
                steps=steps,
            )
            _bind(prefetch, state, "test", test)
            with _skips_end_epochs_early(layer):
                return super().evaluate(
                    x=test.pipeline,
                    verbose=verbose,
                    steps=steps,
                    callbacks=callbacks,
                    return_dict=return_dict,
                    **kwargs,
                )
        finally:
            if outer_runner is None:
                state.runners.pop("test", None)
            else:
                state.runners["test"] = outer_runner
            prefetch.close()

    def predict(
        self, x, batch_size=None, verbose="auto", steps=None, callbacks=None
    ):
        layer = find_staged_input(self)
        if layer is None:
            return super().predict(
                x,
                batch_size=batch_size,
                verbose=verbose,
                steps=steps,
                callbacks=callbacks,
            )
        callbacks, prefetch = _with_prefetch_callback(callbacks)
        try:
            data = stage_data(
                layer, "predict", x, batch_size=batch_size, steps=steps
            )
            prefetch.attach("predict", data.staged, data.adapter)
            # Keras fetches predict batches in Python: the staged dataset's
            # own iterator applies the stage's policies there.
            return super().predict(
                data.staged, verbose=verbose, steps=steps, callbacks=callbacks
            )
        finally:
            prefetch.close()
