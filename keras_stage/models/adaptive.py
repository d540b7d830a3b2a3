"""Adaptive staging: whether a call of a keras_stage model is staged.

With a `StagedInput(adaptive=True)`, a call on in-memory arrays that cannot
repay its stage's set-up, by the costs measured on the model's earlier
staged calls (`CallCosts`), runs the whole model in Keras's step, unstaged.
This module notes what each staged call costs and makes that choice; the
rules themselves are `call_costs.py`'s. The costs are those of every model
with the same stage (`stage_signature`), so a fresh model per trial
decides from what the earlier trials measured.
"""

import logging
import time

from keras_stage.models.call_costs import (
    fit_batches,
    may_skip_stage,
    shared_costs,
    stage_signature,
)
from keras_stage.models.inputs import (
    default_strategy,
    epochs_refusal,
    stage_data,
)
from keras_stage.models.model_state import state as model_state
from keras_stage.planner.state_access import seed_states

logger = logging.getLogger("keras_stage")


def costs(model):
    """The `CallCosts` of `model`'s stage, shared with models like it."""
    state = model_state(model)
    if state.costs is None:
        state.costs = shared_costs(stage_signature(model, state.smart_stage))
    return state.costs


def _first_costs(model, phase):
    """`(plans, traces)`: whether a staged call would plan / trace first."""
    state = model_state(model)
    if not state.smart_stage:
        return False, False
    if state.plan is None:
        return True, True
    split = state.split
    return False, split is not None and not split.traced(phase == "train")


def _random_prefix(model, phase):
    """Whether a training call stages random layers (Dropout, noise...).

    The stage draws their randomness per batch from seeds of its own (see
    `StageSplit.number`), the step from the layers' seed generators: the
    same model trained staged or unstaged would differ, so such calls are
    always staged. A model with no random layer at all is not planned for
    this.
    """
    state = model_state(model)
    if phase != "train" or not state.smart_stage:
        return False
    if state.plan is None and not seed_states(model):
        return False
    split = model._stage_plan()[1]
    return split is not None and bool(split.seed_states)


def stages(model, layer, phase, batches, iterators=1):
    """Whether a call of `phase` reading `batches` batches is staged.

    See `CallCosts.stages`; `batches` is None when not from arrays.
    """
    if not may_skip_stage(layer):
        return True
    if batches is None or _random_prefix(model, phase):
        return True  # never skipped (and the signature is not computed)
    measured = costs(model)
    first = _first_costs(model, phase)
    if measured.stages(phase, batches, iterators, *first):
        return True
    logger.info(
        "Model '%s': %s runs the whole model in Keras's step, unstaged: %s.",
        model.name,
        phase,
        measured.describe(phase, batches, iterators, *first),
    )
    return False


def staged_data(model, phase, *args, **kwargs):
    """`stage_data(*args, **kwargs)`, its costs noted for `phase`."""
    measured = costs(model)
    split = kwargs.get("split")
    traced = 0.0 if split is None else split.trace_seconds
    started = time.perf_counter()
    data = stage_data(*args, **kwargs)
    seconds = time.perf_counter() - started
    if split is not None and split.trace_seconds > traced:
        # Tracing the staged layers is paid once per model, not per call:
        # noted apart, for the first calls of models like this one.
        measured.note_trace(phase, split.trace_seconds - traced)
        seconds -= split.trace_seconds - traced
    measured.note_build(phase, seconds)

    def made(seconds):
        measured.note_iterator(phase, seconds)

    data.on_iterator = made
    data.cost_phase = phase
    snapshot = data.staged.stats.snapshot()
    data.work_before = (snapshot["busy_seconds"], snapshot["produced"])
    return data


def note_work(model, data):
    """Notes the staged work `data`'s stage did in the call ending."""
    if data.staged.stats.closed:
        return
    snapshot = data.staged.stats.snapshot()
    busy, produced = data.work_before
    costs(model).note_work(
        data.cost_phase,
        snapshot["busy_seconds"] - busy,
        snapshot["produced"] - produced,
        has_work=data.split is not None,
    )


def _iterators(model, layer, phase, batches, epochs, steps, long_lived):
    """The iterators a fit's phase makes: one if its epochs share one.

    See `inputs.stage_data(epochs=...)`; `batches` is all the epochs'.
    """
    if not long_lived or not batches or not epochs:
        return epochs
    refusal = epochs_refusal(
        layer,
        phase,
        batches // epochs,
        steps,
        epochs,
        model.steps_per_execution,
        served=False,  # `may_skip_stage`: no service
    )
    if refusal is None and default_strategy(model.distribute_strategy):
        return 1
    return epochs


def fit_stages(model, layer, x, validation_data, long_lived=True, **kwargs):
    """Whether a fit is staged: its training or its validation can pay.

    `long_lived`: whether the fit may run its epochs on one iterator.
    """
    (train, epochs), (val, runs) = fit_batches(x, validation_data, **kwargs)
    if stages(
        model,
        layer,
        "train",
        train,
        iterators=_iterators(
            model,
            layer,
            "train",
            train,
            epochs,
            kwargs["steps_per_epoch"],
            long_lived,
        ),
    ):
        return True
    return validation_data is not None and stages(
        model,
        layer,
        "test",
        val,
        iterators=_iterators(
            model,
            layer,
            "test",
            val,
            runs,
            kwargs["validation_steps"],
            long_lived,
        ),
    )
