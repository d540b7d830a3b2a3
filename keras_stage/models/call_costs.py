"""Whether a staged call can pay for its stage, from measured costs.

A stage saves at most the staged work of every batch but the first (the
first batch is waited for however it is made), and costs its set-up: the
pipeline it builds and each iterator it makes (instantiating the staged
computation). `CallCosts` keeps both as measured on the model's earlier
staged calls, per phase, and `stages` answers, before a call, whether
staging it can be faster than running the whole model in Keras's own step
(the same results either way). A call is never skipped on a guess: only
what was measured counts, on this model or on one with the same stage
(`stage_signature`: a fresh model per trial pays its stage once per
process, not once per model), and what cannot be bounded (data from a
`tf.data.Dataset`, a generator or a `PyDataset`, whose reading the stage
also overlaps) is always staged. A model's first staged call also pays
its SmartStage plan and the trace of its prefix, once per model: those
are noted apart and added only for a model that has not paid them yet.
"""

import collections
import math

import keras
import numpy as np
import tensorflow as tf

from keras_stage.layers.staged_input import StagedInput
from keras_stage.planner.state_access import all_layers

# Keras's batch size when fit/evaluate/predict get arrays and none is given.
_KERAS_DEFAULT_BATCH_SIZE = 32


def array_batches(x, batch_size, steps):
    """The batch count of a call on in-memory arrays, or None.

    None for data whose reading a stage may overlap (a dataset, generator
    or PyDataset) or whose length is not known.
    """
    if steps is not None:
        return steps if in_memory(x) else None
    if not in_memory(x):
        return None
    leaves = _leaves(x)
    if not leaves:
        return None
    rows = len(leaves[0])
    return math.ceil(rows / (batch_size or _KERAS_DEFAULT_BATCH_SIZE))


def _leaves(x):
    if isinstance(x, dict):
        return [leaf for value in x.values() for leaf in _leaves(value)]
    if isinstance(x, (list, tuple)):
        return [leaf for value in x for leaf in _leaves(value)]
    return [x]


def in_memory(x):
    """Whether `x` is arrays (NumPy, tensors) or nested lists/dicts of them."""
    leaves = _leaves(x)
    return bool(leaves) and all(
        isinstance(leaf, np.ndarray) or _is_tensor(leaf) for leaf in leaves
    )


def _is_tensor(value):
    # Tensors of any backend: they have a shape and a dtype and are not
    # datasets (a tf.data.Dataset has neither).
    return hasattr(value, "shape") and hasattr(value, "dtype")


def may_skip_stage(layer):
    """Whether skipping a call's stage changes nothing but its speed.

    `layer`: the call's `StagedInput`. Exception policies and the tf.data
    service change what a call does; the timeout guards reading, which
    in-memory arrays do not do.
    """
    options = layer.stage_options
    return (
        layer.adaptive
        and not options.ignored_exception_types
        and tuple(options.closed_exception_types)
        == (tf.errors.OutOfRangeError,)
        and options.service is None
    )


def validation_runs(initial_epoch, epochs, validation_freq):
    """How many of a fit's epochs run validation (as Keras's fit decides)."""
    return sum(
        1
        for epoch in range(initial_epoch, epochs)
        if (
            (epoch + 1) % validation_freq == 0
            if isinstance(validation_freq, int)
            else epoch + 1 in validation_freq
        )
    )


def fit_batches(
    x,
    validation_data,
    batch_size,
    epochs,
    initial_epoch,
    steps_per_epoch,
    validation_steps,
    validation_batch_size,
    validation_freq,
):
    """A fit's `((batches, epochs), (batches, runs))`.

    For its training and its validation: batches in all (None when not
    from arrays, see `array_batches`), and the epochs and validation runs,
    each making one iterator.
    """
    epochs, first = max(epochs - initial_epoch, 0), initial_epoch
    train = array_batches(x, batch_size, steps_per_epoch)
    train = None if train is None else train * epochs
    if validation_data is None:
        return (train, epochs), (None, 0)
    runs = validation_runs(first, first + epochs, validation_freq)
    val_x, _, _ = keras.utils.unpack_x_y_sample_weight(validation_data)
    val = array_batches(
        val_x, validation_batch_size or batch_size, validation_steps
    )
    return (train, epochs), (None if val is None else val * runs, runs)


class PhaseCosts:
    """What staging one phase (train, test, predict) cost on a model."""

    def __init__(self):
        # Seconds to build a call's stage, and to make one iterator of it.
        self.build_seconds = None
        self.iterator_seconds = None
        # Seconds of staged work per batch; None when not measured (no
        # staged computation, or timing off under op determinism).
        self.batch_seconds = None
        # Seconds a model's first staged call of the phase spends tracing
        # its staged prefix (0 without a SmartStage split).
        self.trace_seconds = 0.0

    def measured(self):
        return (
            self.build_seconds is not None
            and self.iterator_seconds is not None
            and self.batch_seconds is not None
        )

    def saving(self, batches):
        """The most staging `batches` batches can save, in seconds."""
        return max(batches - 1, 0) * self.batch_seconds

    def cost(self, iterators):
        """What a call making `iterators` iterators pays for its stage."""
        return self.build_seconds + iterators * self.iterator_seconds


class CallCosts:
    """The measured costs of a model's staged calls, per phase."""

    def __init__(self):
        self._phases = {}
        # Seconds a model's SmartStage plan took (paid once per model).
        self.plan_seconds = 0.0

    def phase(self, phase):
        if phase not in self._phases:
            self._phases[phase] = PhaseCosts()
        return self._phases[phase]

    def note_build(self, phase, seconds):
        self.phase(phase).build_seconds = seconds

    def note_iterator(self, phase, seconds):
        self.phase(phase).iterator_seconds = seconds

    def note_trace(self, phase, seconds):
        self.phase(phase).trace_seconds = seconds

    def note_plan(self, seconds):
        self.plan_seconds = seconds

    def note_work(self, phase, busy_seconds, produced, has_work):
        """Notes the staged work a call did: its busy seconds per batch.

        `has_work`: whether the stage computes anything (a SmartStage
        prefix); a stage of in-memory arrays that computes nothing has
        nothing to overlap.
        """
        costs = self.phase(phase)
        if not has_work:
            costs.batch_seconds = 0.0
        elif produced > 0 and busy_seconds > 0:
            costs.batch_seconds = busy_seconds / produced

    def stages(self, phase, batches, iterators, plans=False, traces=False):
        """Whether a call of `batches` batches in all should be staged.

        `batches`: the batches it reads from in-memory arrays, or None
        when it reads something else (always staged). `iterators`: the
        iterators it makes (one per epoch). `plans` / `traces`: whether
        the call would also plan the model's SmartStage / trace its
        prefix for the phase (a model's first staged calls).
        """
        return self._decide(phase, batches, iterators, plans, traces)[0]

    def describe(self, phase, batches, iterators, plans=False, traces=False):
        """Why `stages` decided as it did, in a sentence."""
        return self._decide(phase, batches, iterators, plans, traces)[1]

    def _decide(self, phase, batches, iterators, plans, traces):
        if batches is None:
            return True, "its data is not in-memory arrays"
        if batches <= 1:
            return False, "a call of one batch has nothing to overlap"
        costs = self.phase(phase)
        if not costs.measured():
            return True, "nothing is measured on a model with this stage yet"
        set_up = costs.cost(iterators)
        if plans:
            set_up += self.plan_seconds
        if traces:
            set_up += costs.trace_seconds
        if costs.saving(batches) <= set_up:
            return False, (
                f"staging {batches} batches can save at most "
                f"{1000 * costs.saving(batches):.1f} ms of staged work, "
                f"less than the {1000 * set_up:.1f} ms its stage costs to "
                "set up (measured on a model with this stage)"
            )
        return True, (
            f"staging {batches} batches can save up to "
            f"{1000 * costs.saving(batches):.1f} ms of staged work, more "
            f"than the {1000 * set_up:.1f} ms its stage costs to set up"
        )


def stage_signature(model, smart_stage):
    """What a model's stage costs depend on, as a hashable value.

    Two models with the same signature stage the same computation on the
    same data: the same inputs, the same layer classes in the same order,
    the same non-trainable state shapes (what a staged prefix may hold:
    adapted statistics, frozen weights) and the same `StagedInput`
    options. Trainable weights are left out: a layer that training changes
    is never staged, so a trunk's widths do not change the stage.
    """
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


# The costs measured per stage signature in this process (see
# `shared_costs`), the least recently used dropped beyond the bound.
_SHARED = collections.OrderedDict()
_SHARED_BOUND = 64


def shared_costs(signature):
    """The `CallCosts` of every model with stage signature `signature`."""
    costs = _SHARED.pop(signature, None)
    if costs is None:
        costs = CallCosts()
    _SHARED[signature] = costs
    while len(_SHARED) > _SHARED_BOUND:
        _SHARED.popitem(last=False)
    return costs


def forget_shared_costs():
    """Forgets every measured cost (tests start from a clean process)."""
    _SHARED.clear()
