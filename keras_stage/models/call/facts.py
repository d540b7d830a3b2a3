"""What a call's decision to stage is decided from, read off the model.

`stages` and `fit_stages` hand the policy (`decision/calls.py`) a call's
`CallFacts`, then keep and log its `Decision`.
"""

import logging

import keras
import tensorflow as tf

from keras_stage.data.staging import StagedDataset
from keras_stage.layers.staged_input import StagedInput
from keras_stage.models.data_adapters import datasets
from keras_stage.models.data_adapters.batches import fit_batches
from keras_stage.models.data_adapters.epoch_plans import epochs_refusal
from keras_stage.models.decision.calls import (
    decide,
    shared_costs,
    weigh_fit,
    weighs_validation,
)
from keras_stage.models.decision.learned import learned
from keras_stage.models.iterators.kept_iterators import carries
from keras_stage.models.model_state import UNSTAGED_STEPS
from keras_stage.models.model_state import state as model_state
from keras_stage.planner.state_access import all_layers, seed_states

logger = logging.getLogger("keras_stage")


def may_skip_stage(layer):
    """Whether skipping a call's stage changes nothing but its speed: not
    under an exception policy or the tf.data service (the timeout guards
    reading, which in-memory data does not do)."""
    options = layer.stage_options
    return (
        layer.adaptive
        and not options.ignored_exception_types
        and tuple(options.closed_exception_types)
        == (tf.errors.OutOfRangeError,)
        and options.service is None
    )


def stage_signature(model, smart_stage):
    """What a model's stage costs depend on, as a hashable value: the
    inputs, the layer classes in order, their non-trainable state shapes
    and the `StagedInput` options; not trainable weights (a layer training
    changes is never staged)."""
    parts = [type(model).__qualname__, repr(smart_stage)]
    try:
        inputs = keras.tree.flatten(model.inputs or [])
    except (AttributeError, ValueError):  # a subclassed model
        inputs = []
    parts.extend((tuple(t.shape), str(t.dtype)) for t in inputs)
    for layer in all_layers(model):
        entry = (
            type(layer).__module__,
            type(layer).__qualname__,
            tuple(
                (tuple(w.shape), str(w.dtype))
                for w in layer.non_trainable_weights
            ),
        )
        if isinstance(layer, StagedInput):
            config = dict(layer.get_config())
            config.pop("name", None)
            entry += (repr(sorted(config.items())),)
        parts.append(entry)
    return tuple(parts)


def costs(model):
    """The `CallCosts` of `model`'s stage, shared with models like it."""
    record = learned(model)
    if record.costs is None:
        signature = stage_signature(model, model_state(model).smart_stage)
        record.costs = shared_costs(signature)
    return record.costs


def traces_whole_step(model, phase):
    """Whether an unstaged `phase` call of `model` would trace its step."""
    steps = model_state(model).steps.staged_functions
    return (phase, UNSTAGED_STEPS) not in steps


class CallFacts:
    """What the policy decides a call of `phase` from (`CallCosts.decide`
    says what each fact is), each read when the policy asks for it: a rule
    that decides early spares the later ones (`random_prefix` may plan).
    """

    def __init__(
        self, model, layer, phase, batches, iterators, x, unstaged_epochs=0
    ):
        self._model = model
        self._state = model_state(model)
        self._layer = layer
        self._x = x
        self.phase = phase
        self.batches = batches
        self.iterators = iterators
        self.unstaged_epochs = unstaged_epochs

    @property
    def skippable(self):
        return may_skip_stage(self._layer)

    @property
    def unbounded(self):
        """What makes a call on data not in memory keep its stage."""
        x = self._x
        if isinstance(x, StagedDataset):
            return {"source": "staged"}
        if not isinstance(x, tf.data.Dataset):
            return {"source": "python"}
        count = datasets.cardinality(x)
        return {
            "source": "dataset",
            "unknown_length": count == tf.data.UNKNOWN_CARDINALITY,
            "infinite": count == tf.data.INFINITE_CARDINALITY,
            "maps": not datasets.reads_memory_only(x),
        }

    @property
    def jit_compile(self):
        return self._state.smart_stage and self._state.requested_jit is True

    @property
    def random_prefix(self):
        """Whether a training call stages random layers (Dropout, noise)."""
        if self.phase != "train" or not self._state.smart_stage:
            return False
        if self._state.plan is None and not seed_states(self._model):
            return False
        split = self._model._stage_plan()[1]
        return split is not None and bool(split.seed_states)

    @property
    def costs(self):
        return costs(self._model)

    @property
    def plans(self):
        return bool(self._state.smart_stage) and self._state.plan is None

    @property
    def traces(self):
        if not self._state.smart_stage:
            return False
        if self._state.plan is None:
            return True
        split = self._state.split
        return split is not None and not split.traced(self.phase == "train")

    @property
    def owed(self):
        """About what tracing the whole step costs, if not traced yet."""
        if not traces_whole_step(self._model, self.phase):
            return 0.0
        return self.costs.whole_trace(self.phase)

    @property
    def compiles(self):
        """Whether the model keeps no compiled staged step of the phase."""
        steps = self._state.steps.staged_functions
        return not any(
            key[0] == self.phase and key[1] != UNSTAGED_STEPS and f is not None
            for key, f in steps.items()
        )


def stages(model, layer, phase, batches, iterators=1, x=None):
    """Whether a call of `phase` reading `batches` batches is staged.

    `batches`: None when not from in-memory data (`call_batches`); `x`:
    the call's data, for the message.
    """
    decision = decide(CallFacts(model, layer, phase, batches, iterators, x))
    _keep(model, phase, decision)
    return decision.staged


def _keep(model, phase, decision):
    """Logs the `Decision` on a call of `phase`, kept for the verdict."""
    learned(model).decisions[phase] = decision
    if decision.first_call:
        # Once: a loop of short calls stages its next one and measures it.
        costs(model).phase(phase).first_call_skipped = True
    if logger.isEnabledFor(logging.INFO):  # a short call pays no message
        logger.info(
            "Model '%s': %s %s [%s]: %s.",
            model.name,
            phase,
            "is staged"
            if decision.staged
            else "runs the whole model in Keras's step, unstaged",
            decision.kind.value,
            decision.reason,
        )


def iterators_made(model, role, x, default=1):
    """The iterators of its stage a call of `role` on `x` makes: none when
    it reads on from the one an earlier call left, else `default`."""
    return 0 if carries(model_state(model).stages, role, x) else default


def _iterators(model, layer, phase, role, x, batches, epochs, steps):
    """The iterators a fit's `role` of `phase` makes: one if its epochs
    share one (see `stage_data(epochs=...)`); `batches`: all the epochs'."""
    if not batches or not epochs:
        return epochs
    if not iterators_made(model, role, x):
        return 0
    refusal = epochs_refusal(
        layer,
        phase,
        batches // epochs,
        steps,
        epochs,
        model.steps_per_execution,
        served=False,  # `may_skip_stage`: no service
        strategy=model.distribute_strategy,
        dataset=x,
    )
    return epochs if refusal else 1


def fit_stages(model, layer, x, validation_data, long_lived=True, **kwargs):
    """Whether a fit is staged: its training or its validation can pay
    (`calls.weigh_fit`); both decisions are kept and logged."""
    (train, epochs), (val, runs) = fit_batches(x, validation_data, **kwargs)

    def decide_half(phase, role, data, batches, count, steps, **extra):
        iterators = count
        if long_lived:
            iterators = _iterators(
                model, layer, phase, role, data, batches, count, steps
            )
        return decide(
            CallFacts(model, layer, phase, batches, iterators, data, **extra)
        )

    training = decide_half(
        "train",
        "train",
        x,
        train,
        epochs,
        kwargs["steps_per_epoch"],
        unstaged_epochs=epochs,
    )
    if validation_data is None or not weighs_validation(training):
        _keep(model, "train", training)
        return training.staged
    val_x = keras.utils.unpack_x_y_sample_weight(validation_data)[0]
    validation = decide_half(
        "test", "val", val_x, val, runs, kwargs["validation_steps"]
    )
    training, validation = weigh_fit(training, validation, val is not None)
    _keep(model, "test", validation)
    _keep(model, "train", training)
    return training.staged
