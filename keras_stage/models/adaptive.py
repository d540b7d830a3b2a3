"""Adaptive staging: whether a call of a keras_stage model is staged.

With a `StagedInput(adaptive=True)`, a call on in-memory arrays that cannot
repay its stage's set-up, by the costs measured on the model's earlier
staged calls (`CallCosts`), runs the whole model in Keras's step, unstaged.
This module notes what each staged call costs and makes that choice; the
rules themselves are `call_costs.py`'s.
"""

import logging
import time

from keras_stage.models.call_costs import fit_batches, may_skip_stage
from keras_stage.models.inputs import stage_data
from keras_stage.models.model_state import state as model_state

logger = logging.getLogger("keras_stage")


def stages(model, layer, phase, batches, iterators=1):
    """Whether a call of `phase` reading `batches` batches is staged.

    See `CallCosts.stages`; `batches` is None when not from arrays.
    """
    if not may_skip_stage(layer):
        return True
    costs = model_state(model).costs
    if costs.stages(phase, batches, iterators):
        return True
    logger.info(
        "Model '%s': %s runs the whole model in Keras's step, unstaged: %s.",
        model.name,
        phase,
        costs.describe(phase, batches, iterators),
    )
    return False


def staged_data(model, phase, *args, **kwargs):
    """`stage_data(*args, **kwargs)`, its costs noted for `phase`."""
    costs = model_state(model).costs
    split = kwargs.get("split")
    traced = 0.0 if split is None else split.trace_seconds
    started = time.perf_counter()
    data = stage_data(*args, **kwargs)
    seconds = time.perf_counter() - started
    if split is not None:
        # Tracing the staged layers is paid once per model, not per call.
        seconds -= split.trace_seconds - traced
    costs.note_build(phase, seconds)

    def made(seconds):
        costs.note_iterator(phase, seconds)

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
    model_state(model).costs.note_work(
        data.cost_phase,
        snapshot["busy_seconds"] - busy,
        snapshot["produced"] - produced,
        has_work=data.split is not None,
    )


def fit_stages(model, layer, x, validation_data, **kwargs):
    """Whether a fit is staged: its training or its validation can pay."""
    (train, epochs), (val, runs) = fit_batches(x, validation_data, **kwargs)
    return stages(model, layer, "train", train, iterators=epochs) or (
        validation_data is not None
        and stages(model, layer, "test", val, iterators=runs)
    )
