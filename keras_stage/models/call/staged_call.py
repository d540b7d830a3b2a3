"""`StagedCall`: one fit/evaluate/predict call of a model with a stage.

It owns what lasts one call: its callbacks (a `PrefetchCallback` first),
its stages, their bindings to the compiled steps and the steps swapped in
while Keras runs; an evaluate from a fit's callback gives the fit's
bindings back when it ends.
"""

import contextlib
import functools
import warnings

import keras

from keras_stage import _compat
from keras_stage.callbacks.data_backup import DataBackup
from keras_stage.callbacks.prefetch_callback import PrefetchCallback
from keras_stage.models import backends
from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.call import measure
from keras_stage.models.decision.learned import learned
from keras_stage.models.model_state import (
    FUNCTIONS,
    UNSTAGED_STEPS,
    drop_traced_steps,
)
from keras_stage.models.model_state import state as model_state
from keras_stage.planner.state_access import all_layers


class StagedCall:
    """One call of a model with a stage; see the module docstring.

    Args:
        model: The `keras_stage` model called.
        layer: Its `StagedInput` (or SmartStage's default one).
        phases: `("train", "test")` for fit, `("test",)` for evaluate,
            `("predict",)` for predict.
        callbacks: The user's callbacks (a list, or None).
        steps_per_epoch: The fit's `steps_per_epoch`, or None.
        verbose: The call's `verbose`.
        stacklevel: Where `run`'s warnings point: the user's call, as
            `warnings.warn` counts from `run`'s caller.

    Attributes:
        split: The SmartStage split the stages run, or None; set first.
    """

    def __init__(
        self,
        model,
        layer,
        phases,
        callbacks,
        steps_per_epoch=None,
        verbose="auto",
        stacklevel=2,
    ):
        self.model = model
        self.layer = layer
        self.split = None
        self.phases = tuple(phases)
        self._stacklevel = stacklevel
        self.callbacks, self.prefetch = _with_prefetch_callback(
            callbacks, progbar=verbose != 0
        )
        self._unstaged_fit_callbacks = self.callbacks  # without DataBackup
        self._fed = {}  # per phase: the `StagedData` Keras iterates
        if "train" in self.phases:
            self.callbacks = _with_data_backup(
                model,
                self.callbacks,
                steps_per_epoch,
                self._reopen,
                self._build_metrics,
                ordered=layer.stage_options.deterministic,
            )
        self.built = []
        self._own_pools = []  # (role, pool) of stages with their own stats
        self._state = model_state(model)
        self.backend = backends.for_model(model)
        self._outer = {}  # per bound phase: the outer call's bindings

    # -- stages -----------------------------------------------------------

    def stage(self, phase, role, x, y=None, sample_weight=None, **kwargs):
        """Stages `x` (and its labels and weights) for `phase`'s step.

        `role` names the stage ("val": a fit's validation); `kwargs` go to
        `stage_data`. Returns the `StagedData`, bound to the step.
        """
        model = self.model
        stepped = self.backend.reads_in_graph(phase)
        data = measure.staged_data(
            model,
            phase,
            self.layer,
            role,
            self.backend.host_arrays(x),
            self.backend.host_arrays(y),
            sample_weight,
            split=self.split,
            stats=(
                tensorflow_steps.step_stats(model, self.layer, phase)
                if stepped
                else None
            ),
            backend=self.backend,
            strategy=model.distribute_strategy if stepped else None,
            kept=self._state.stages,
            reads_in_python=not stepped,
            feedable=self._feedable(phase),
            pool_start=None if stepped else self._state.pool_sizes.get(role),
            **kwargs,
        )
        if not stepped:
            self._own_pools.append((role, data.staged.thread_pool))
        self.built.append(data)
        self._bind(phase, data)
        return data

    def _feedable(self, phase):
        """Whether `phase`'s stage may read a fed source across calls: not
        where `BackupAndRestore` saves the iterator (a fed source's queue is
        not in a tf.data checkpoint)."""
        return phase != "train" or not any(
            isinstance(cb, DataBackup) for cb in self.callbacks
        )

    def _bind(self, phase, data):
        """Hands `data`'s stage to the callback and its runner to the step."""
        bound = self._state.bound
        if phase not in self._outer:
            self._outer[phase] = (
                bound.runners.get(phase),
                bound.recording.get(phase),
                bound.placements.get(phase),
                bound.step_clocks.get(phase),
            )
        self._fed[phase] = data
        decision = learned(self.model).decisions.pop(phase, None)
        self.prefetch.attach(
            phase,
            data.staged,
            data.adapter,
            long_lived=data.long_lived,
            pool_shrinks=self.backend.pool_shrinks,
            carried=data.carried,
            call_reason=None if decision is None else decision.reason,
            iterator_cost=functools.partial(
                measure.resize_cost, self.model, data
            ),
        )
        bind_placement(self.model, phase, data.staged.placement)
        if phase == "predict":
            return
        bound.runners[phase] = data.staged.runner
        _put(bound.step_clocks, phase, data.step_clock)
        _put(
            bound.recording, phase, data.staged.stats if data.in_step else None
        )

    # -- running Keras's call ---------------------------------------------

    def feed(self, data):
        """What Keras iterates for `data` (`Backend.feed`)."""
        return self.backend.feed(data, self.phases[0])

    def _reopen(self, phase, count=1):
        """Makes and drops `count` iterators of `phase`'s source, drawing
        the reshuffle seeds Keras's own would; not where Keras gets them
        deferred (`StagedData.defers`)."""
        data = self._fed.get(phase)
        if data is None or data.defers or data.source is None:
            return
        for _ in range(count):
            iter(data.source)

    def _build_metrics(self, phase):
        """Builds the compile metrics and loss from `phase`'s specs: a
        resumed epoch restores them before the step where Keras would."""
        data = self._fed.get(phase)
        if (
            data is None
            or data.element_spec is None
            or not self.backend.reads_in_graph(phase)
            or not _compat.builds_from_data(self.model)
        ):
            return
        with self.model.distribute_strategy.scope():
            _compat.symbolic_build(self.model, data.element_spec)

    def run(self, keras_call, **kwargs):
        """`keras_call(callbacks=..., **kwargs)` with the staged steps."""
        model = self.model
        splits = {}
        for phase in self.phases:
            data = self._fed.get(phase)
            splits[phase] = None if data is None else data.split
        with (
            _skips_end_epochs_early(self.layer, self.built, self.callbacks),
            # Below the caller: run, __enter__, _staged_steps, _trunk_jit.
            _staged_steps(model, self.phases, splits, self._stacklevel + 4),
        ):
            if self.built and "predict" not in self.phases:
                self.backend.build(model, self.built[0], self.phases[0])
            return keras_call(callbacks=self.callbacks, **kwargs)

    def run_unstaged(self, keras_call):
        """Runs `keras_call()` (the user's call as given) with no stage.

        A fit's gets `callbacks=`, the `PrefetchCallback` first to log why.
        """
        clocks = {
            phase: []
            for phase in measure.timed_unstaged_phases(self.model, self.phases)
        }
        kwargs = {}
        starts = None
        if "train" in self.phases:
            self.prefetch.attach_unstaged(
                learned(self.model).decisions["train"].reason
            )
            # What Keras's epochs cost to start, unpaid by a stage's epochs
            # on one iterator.
            starts = measure.EpochStartClock()
            kwargs["callbacks"] = [*self._unstaged_fit_callbacks, starts]
        try:
            with _unstaged_steps(self.model, self.phases, clocks):
                result = keras_call(**kwargs)
            measure.note_unstaged_steps(self.model, clocks)
            if starts is not None:
                measure.note_epoch_starts(self.model, starts.seconds)
            return result
        finally:
            self.prefetch.close()

    # -- the end ------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def close(self):
        """Ends the call's stages and gives an outer call its bindings back."""
        bound = self._state.bound
        try:
            for phase, outer in self._outer.items():
                runner, recording, placement, clock = outer
                _put(bound.runners, phase, runner)
                _put(bound.recording, phase, recording)
                _put(bound.step_clocks, phase, clock)
                if runner is None:
                    bound.iterators.pop(phase, None)
                    bound.pending_restores.pop(phase, None)
                if placement is None:
                    release_placement(self.model, phase)
                else:
                    bind_placement(self.model, phase, placement)
            self._outer.clear()
        finally:
            try:
                for role, pool in self._own_pools:
                    if pool is not None:
                        self._state.pool_sizes[role] = pool.size
                for data in self.built:
                    if data.owned:
                        measure.note_work(self.model, data)
                    data.end_call()
            finally:
                self.prefetch.close()


def _put(bindings, phase, value):
    """Binds `value` to `phase`, or unbinds it for None."""
    if value is None:
        bindings.pop(phase, None)
    else:
        bindings[phase] = value


def bind_placement(model, phase, placement):
    """Makes `phase`'s step unpack what `placement` packed; a new layout
    drops the phase's traced steps (two structures can pack to the same
    spec, so tf.function would not retrace)."""
    state = model_state(model)
    layout = None if placement.packer is None else placement.unpacked_spec
    if state.bound.layouts.get(phase) != layout:
        drop_traced_steps(model, phase)
    state.bound.layouts[phase] = layout
    state.bound.placements[phase] = placement


def release_placement(model, phase):
    """Ends `phase`'s placement; a plain step traced unpacking is dropped."""
    state = model_state(model)
    placement = state.bound.placements.pop(phase, None)
    if placement is not None and placement.packer is not None:
        setattr(model, FUNCTIONS[phase], None)
        state.bound.layouts.pop(phase, None)


@contextlib.contextmanager
def _staged_steps(model, phases, splits, stacklevel):
    """Within, the model's compiled steps are those of `splits`' trunks
    (per phase, its SmartStage split or None)."""
    steps = model_state(model).steps
    active = [steps.active.get(phase) for phase in phases]
    if not any(splits.values()) and not any(active):
        yield
        return
    keys = {
        phase: (phase, id(split) if split else None)
        for phase, split in splits.items()
    }
    with _swapped_steps(model, keys, splits):
        jit = steps.staged_jit
        if any(split is not None for split in splits.values()):
            steps.staged_jit = _trunk_jit(model, splits, stacklevel)
        try:
            yield
        finally:
            steps.staged_jit = jit


@contextlib.contextmanager
def _unstaged_steps(model, phases, clocks):
    """Within, the model's steps run the whole model and record nothing
    (Keras's own step would record a stage-only call's fetches); `clocks`:
    per phase, a list its steps' host times go to."""
    bound = model_state(model).bound
    keys = {phase: (phase, UNSTAGED_STEPS) for phase in phases}
    bindings = (bound.runners, bound.recording, bound.step_clocks)
    saved = [
        (binding, phase, binding.pop(phase, None))
        for binding in bindings
        for phase in phases
    ]
    bound.step_clocks.update(clocks)
    try:
        with _swapped_steps(model, keys, dict.fromkeys(phases), keep=True):
            yield
    finally:
        for phase in clocks:
            bound.step_clocks.pop(phase, None)
        for binding, phase, value in saved:
            if value is not None:
                binding[phase] = value


@contextlib.contextmanager
def _swapped_steps(model, keys, splits, keep=False):
    """Within, each phase's compiled step is `staged_functions[keys[phase]]`
    running `splits[phase]`; after, the step (as traced) is kept there and
    the model's own put back, unless `keep` and the model had none. Keras's
    attribute tracking costs: only what changes is set."""
    steps = model_state(model).steps
    saved = {}
    for phase, key in keys.items():
        attr = FUNCTIONS[phase]
        saved[phase] = (getattr(model, attr, None), steps.active.get(phase))
        step = steps.staged_functions.get(key)
        if saved[phase][0] is not step:
            setattr(model, attr, step)
        steps.active[phase] = splits[phase]
    try:
        yield
    finally:
        for phase, key in keys.items():
            attr = FUNCTIONS[phase]
            step = getattr(model, attr, None)
            steps.staged_functions[key] = step
            function, active = saved[phase]
            if function is not step and (function is not None or not keep):
                setattr(model, attr, function)
            steps.active[phase] = active


def _trunk_jit(model, splits, stacklevel):
    """Whether staged steps are XLA-compiled, or None for Keras's choice:
    Keras turns `jit_compile=True` off for a model with a layer XLA cannot
    compile, and those are usually staged, so the trunk can honour it."""
    requested = model_state(model).requested_jit
    if requested == "auto":
        requested = backends.for_model(model).jit_by_default
    if requested is not True:
        return None
    for split in splits.values():
        layers = () if split is None else all_layers(split.trunk)
        if not all(getattr(layer, "supports_jit", True) for layer in layers):
            warnings.warn(
                f"jit_compile=True: the trunk of model '{model.name}' still "
                "has a layer XLA cannot compile; its steps run without XLA.",
                stacklevel=stacklevel,
            )
            return False
    return True


@contextlib.contextmanager
def _skips_end_epochs_early(layer, built, callbacks):
    """Silences Keras's "ran out of data" warning where epochs end short by
    design: skipped elements, an epoch resumed by `DataBackup`, a device
    buffer (hiding the count from Keras), the tf.data service's
    `parallel_epochs`."""
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


def _with_data_backup(
    model, callbacks, steps_per_epoch, reopen, build_metrics=None, ordered=True
):
    """`callbacks` with a `DataBackup` right after a `BackupAndRestore`.

    `reopen` and `build_metrics`: `StagedCall._reopen` (the iterators Keras
    makes around epochs, `tensorflow_steps.track_iterator`) and
    `_build_metrics`. `ordered`: the stage's `deterministic`.
    """
    state = model_state(model)
    out = []
    for callback in callbacks:
        out.append(callback)
        if isinstance(callback, keras.callbacks.BackupAndRestore):

            def current():
                ref = state.bound.iterators.get("train")
                return None if ref is None else ref()

            def stage_restored(variables):
                # The restored iterator has numbered nothing yet.
                state.split.unnumbered.assign(True)

            def drew_itself(left):
                """Whether the restore drew a reshuffle seed of its own, as
                tf.data's does when the saved iterator held no more of the
                source: it had handed out the epoch's last batch (`left` 0)
                or the staged random layers' numbering `scan` had read the
                source to its end (its mark is still set)."""
                split = state.split
                if split is not None and split.unnumbered is not None:
                    drew = bool(split.unnumbered.numpy())
                    split.unnumbered.assign(False)
                    return drew
                return left == 0

            def restore_next(restore, left, epoch):
                if steps_per_epoch is not None:
                    # Keras reads one iterator across the epochs: the
                    # restored one holds the later epochs' batches too.
                    left = None
                else:
                    # Replays the seeds a run never stopped drew before
                    # this epoch's iterator (Keras makes one as each epoch
                    # begins and one after each it stepped through), so
                    # the orders match it (docs/reliability.md).
                    reopen("train", max(2 * epoch - 1, 0))

                def end():
                    # In epoch 0 a restore that drew its own seed and the
                    # epoch's iterator already made the draws before epoch 1.
                    if not (drew_itself(left) and epoch == 0):
                        reopen("train")

                state.bound.pending_restores["train"] = (restore, left, end)

            def stage_state():
                ordinal = None if state.split is None else state.split.ordinal
                return {} if ordinal is None else {"stage_ordinal": ordinal}

            data_backup = DataBackup(
                callback,
                current,
                restore_next,
                build_metrics and functools.partial(build_metrics, "train"),
                stage_state,
                ordered,
                stage_restored,
            )
            # Before BackupAndRestore loads the files, as fit begins.
            data_backup.recover()
            out.append(data_backup)
    return out


def _with_prefetch_callback(callbacks, progbar):
    """The callback list with a PrefetchCallback first, and that callback.

    Only Keras's progress bar (if `progbar`) goes before it, so that its
    epoch-end lines follow the epoch's progress line.
    """
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
    bar_class = keras.callbacks.ProgbarLogger
    bars = [cb for cb in callbacks if isinstance(cb, bar_class)]
    if progbar and not bars:
        bars = [bar_class()]
    others = [
        cb
        for cb in callbacks
        if cb is not prefetch and not isinstance(cb, bar_class)
    ]
    return bars + [prefetch] + others, prefetch
