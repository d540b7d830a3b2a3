"""`StagedCall`: one fit/evaluate/predict call of a model with a stage.

A staged call lives from the model API's entry (`StagingMixin.fit` and
the others) to its return, and owns everything that lasts exactly that
long: the call's callbacks (a `PrefetchCallback` first), the stages it
builds from the call's data (`stage`), what binds each stage to its
phase's compiled step (runner, recording, placement), the compiled steps
swapped in while Keras runs (staged or unstaged), and their end. An
evaluate run from a callback of a staged fit is a call of its own: it
saves the fit's bindings of its phase and gives them back when it ends.

What outlives calls (the plan, the traced prefix, the compiled steps, the
stats the steps record in, the measured costs) is the model's
(`model_state.py`); the steps themselves are the backend's (`backends/`).

Example (what `StagingMixin.evaluate` does, `keras_evaluate` being
`keras.Model.evaluate` bound to the model):

    call = StagedCall(model, layer, ("test",), callbacks)
    if not calls.stages(model, layer, "test", batches):
        return call.run_unstaged(lambda: keras_evaluate(x, y, ...))
    call.split = split  # the SmartStage split, or None
    with call:
        data = call.stage("test", "test", x, y, batch_size=32)
        return call.run(keras_evaluate, x=data.pipeline)
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
from keras_stage.models.decision import calls
from keras_stage.models.decision.learned import learned
from keras_stage.models.model_state import (
    FUNCTIONS,
    UNSTAGED_STEPS,
    drop_traced_steps,
    set_aside,
)
from keras_stage.models.model_state import state as model_state
from keras_stage.planner.state_access import all_layers


class StagedCall:
    """One call of a model with a stage; see the module docstring.

    Args:
        model: The `keras_stage` model called.
        layer: Its `StagedInput` (or the default one of a SmartStage
            model without it).
        phases: The phases the call runs: `("train", "test")` for fit,
            `("test",)` for evaluate, `("predict",)` for predict.
        callbacks: The user's callbacks (a list, or None).
        steps_per_epoch: The fit's `steps_per_epoch`, or None.
        verbose: The call's `verbose`: whether Keras shows a progress bar.

    Attributes:
        split: The SmartStage split whose prefix the call's stages run, or
            None; set before the first `stage` (a call that runs unstaged
            never needs it).
    """

    def __init__(
        self,
        model,
        layer,
        phases,
        callbacks,
        steps_per_epoch=None,
        verbose="auto",
    ):
        self.model = model
        self.layer = layer
        self.split = None
        self.phases = tuple(phases)
        self.user_callbacks = callbacks
        self.callbacks, self.prefetch = _with_prefetch_callback(
            callbacks, progbar=verbose != 0
        )
        # A fit run unstaged gets these: its PrefetchCallback logs why.
        self._unstaged_fit_callbacks = self.callbacks
        # Per phase: the `StagedData` Keras iterates (its split is the one
        # the phase's step runs; see also `_reopen`).
        self._fed = {}
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
        # The roles and pools of the stages counting in stats of their own.
        self._own_pools = []
        self._state = model_state(model)
        self.backend = backends.for_model(model)
        # Per bound phase: the outer call's (runner, recording, placement).
        self._outer = {}

    # -- stages -----------------------------------------------------------

    def stage(
        self,
        phase,
        role,
        x,
        y=None,
        sample_weight=None,
        **kwargs,
    ):
        """Stages `x` (and its labels and weights) for `phase`'s step.

        `role` names the stage ("train", "val", "test", "predict"); `kwargs`
        go to `staged_data.stage_data` (batch size, steps, shuffle,
        class_weight). Returns the `StagedData`, bound to the step: its
        pipeline is what Keras must iterate.
        """
        model = self.model
        stepped = self.backend.reads_in_graph(phase)
        data = calls.staged_data(
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
            # A compiled step's stats keep their pool across calls.
            pool_start=None if stepped else self._state.pool_sizes.get(role),
            **kwargs,
        )
        if not stepped:
            self._own_pools.append((role, data.staged.thread_pool))
        self.built.append(data)
        self._bind(phase, data)
        return data

    def _feedable(self, phase):
        """Whether `phase`'s stage may read a fed source across calls.

        A fed source's queue is not in a tf.data checkpoint: not for a
        compiled training step that `BackupAndRestore` saves.
        """
        return phase != "train" or not any(
            isinstance(cb, DataBackup) for cb in self.callbacks
        )

    def _bind(self, phase, data):
        """Hands `data`'s stage to the callback and its runner to the step."""
        state = self._state
        if phase not in self._outer:
            self._outer[phase] = (
                state.runners.get(phase),
                state.recording.get(phase),
                state.placements.get(phase),
                state.step_clocks.get(phase),
            )
        self._fed[phase] = data
        self.prefetch.attach(
            phase,
            data.staged,
            data.adapter,
            long_lived=data.long_lived,
            pool_shrinks=self.backend.pool_shrinks,
            carried=data.carried,
            call_reason=_reason(learned(self.model).decisions.pop(phase, None)),
            iterator_cost=functools.partial(
                calls.resize_cost, self.model, data
            ),
        )
        bind_placement(self.model, phase, data.staged.placement)
        if phase == "predict":
            return
        state.runners[phase] = data.staged.runner
        if data.step_clock is not None:
            state.step_clocks[phase] = data.step_clock
        else:
            state.step_clocks.pop(phase, None)
        if data.in_step:
            state.recording[phase] = data.staged.stats
        else:
            state.recording.pop(phase, None)

    # -- running Keras's call ---------------------------------------------

    def feed(self, data):
        """What Keras iterates for `data` (a `StagedData` of this call).

        The backend's feed (`Backend.feed`); a fit's phases are fed alike.
        """
        return self.backend.feed(data, self.phases[0])

    def _reopen(self, phase, count=1):
        """Makes and drops `count` iterators of `phase`'s source.

        The draws Keras's own iterators make of a source that draws per
        iterator (a reshuffling `shuffle`: each iterator takes the next
        seed of its sequence); nothing for one whose iterators Keras gets
        deferred (they draw nothing, see `StagedData.defers`). An iterator
        of the source draws what one of the stage's pipeline over it draws,
        without instantiating the staged computation.
        """
        data = self._fed.get(phase)
        if data is None or data.defers or data.source is None:
            return
        for _ in range(count):
            iter(data.source)

    def _build_metrics(self, phase):
        """Builds the model's compile metrics and loss from `phase`'s specs.

        Keras builds them as it traces the first step (without a strategy);
        a resumed epoch gives them their saved values before that step.
        """
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
        fed = {phase: self._fed.get(phase) for phase in self.phases}
        splits = {
            phase: None if data is None else data.split
            for phase, data in fed.items()
        }
        with (
            _skips_end_epochs_early(self.layer, self.built, self.callbacks),
            _staged_steps(model, self.phases, splits),
        ):
            if self.built and "predict" not in self.phases:
                self.backend.build(model, self.built[0], self.phases[0])
            return keras_call(callbacks=self.callbacks, **kwargs)

    def run_unstaged(self, keras_call):
        """Runs `keras_call()` (the user's call as given) with no stage.

        The whole model runs in Keras's step (see `decision/calls.py`). A
        fit's is given `callbacks=`, the user's with the call's
        `PrefetchCallback` first, which logs its epochs as unstaged and
        says why (`PrefetchCallback.attach_unstaged`); the callback is
        closed after.
        """
        clocks = {
            phase: []
            for phase in calls.timed_unstaged_phases(self.model, self.phases)
        }
        kwargs = {}
        starts = None
        if "train" in self.phases:
            self.prefetch.attach_unstaged(
                learned(self.model).decisions["train"].reason
            )
            # What Keras's epochs cost to start (their iterators), which a
            # stage's epochs on one iterator would not pay.
            starts = calls.EpochStartClock()
            kwargs["callbacks"] = [*self._unstaged_fit_callbacks, starts]
        try:
            with _unstaged_steps(self.model, self.phases, clocks):
                result = keras_call(**kwargs)
            calls.note_unstaged_steps(self.model, clocks)
            if starts is not None:
                calls.note_epoch_starts(self.model, starts.seconds)
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
        state = self._state
        try:
            for phase, outer_bindings in self._outer.items():
                runner, recording, placement, clock = outer_bindings
                for bindings, outer in (
                    (state.runners, runner),
                    (state.recording, recording),
                    (state.step_clocks, clock),
                ):
                    if outer is None:
                        bindings.pop(phase, None)
                    else:
                        bindings[phase] = outer
                if runner is None:
                    state.iterators.pop(phase, None)
                    state.pending_restores.pop(phase, None)
                if placement is None:
                    release_placement(self.model, phase)
                else:
                    bind_placement(self.model, phase, placement)
            self._outer.clear()
        finally:
            try:
                for role, pool in self._own_pools:
                    if pool is not None:
                        state.pool_sizes[role] = pool.size
                for data in self.built:
                    if data.owned:
                        calls.note_work(self.model, data)
                    data.end_call()
            finally:
                self.prefetch.close()


def _reason(decision):
    """Why `decision` (a `calls.Decision`, or None) staged the call."""
    return None if decision is None else decision.reason


def bind_placement(model, phase, placement):
    """Makes `phase`'s step unpack what `placement` packed.

    The traced step bakes the unpacking in; tf.function retraces when the
    packed element's spec changes, but two structures can pack to the same
    spec, so a new layout also drops the phase's traced steps.
    """
    state = model_state(model)
    layout = None if placement.packer is None else placement.unpacked_spec
    if state.layouts.get(phase) != layout:
        drop_traced_steps(model, phase)
    state.layouts[phase] = layout
    state.placements[phase] = placement


def release_placement(model, phase):
    """Ends `phase`'s placement at the end of a call.

    A plain step that was traced unpacking packed elements (a run without
    a SmartStage split uses Keras's own step) is traced afresh next time.
    """
    state = model_state(model)
    placement = state.placements.pop(phase, None)
    if placement is not None and placement.packer is not None:
        setattr(model, FUNCTIONS[phase], None)
        state.layouts.pop(phase, None)


@contextlib.contextmanager
def _staged_steps(model, phases, splits):
    """Runs a call with the compiled steps of its splits.

    `splits` maps each phase to its SmartStage split or None. While the call
    runs, the model's compiled steps of those phases are the staged ones
    (traced on the trunk), cached between calls; the plain ones are put
    back afterwards. Restores the outer call's splits, for an evaluate run
    from a callback of a staged fit.
    """
    state = model_state(model)
    saved = {p: state.active.get(p) for p in phases}
    if not any(splits.values()) and not any(saved.values()):
        yield
        return
    plain = {}
    for phase in phases:
        attr = FUNCTIONS[phase]
        plain[phase] = getattr(model, attr, None)
        key = (phase, id(splits[phase]) if splits[phase] else None)
        setattr(model, attr, state.staged_functions.get(key))
        state.active[phase] = splits[phase]
    jit = state.staged_jit
    if any(split is not None for split in splits.values()):
        state.staged_jit = _trunk_jit(model, splits)
    try:
        yield
    finally:
        for phase in phases:
            attr = FUNCTIONS[phase]
            key = (phase, id(splits[phase]) if splits[phase] else None)
            state.staged_functions[key] = getattr(model, attr, None)
            setattr(model, attr, plain[phase])
            state.active[phase] = saved[phase]
        state.staged_jit = jit


@contextlib.contextmanager
def _unstaged_steps(model, phases, clocks=None):
    """Runs a call that skips its stage, with steps traced for that alone.

    They run the whole model and record nothing: a stage-only call (no
    split) records its fetches in Keras's own compiled step, which an
    unstaged call must not run. Puts the outer call's steps, runner,
    recording and step clocks back afterwards (an evaluate from a callback
    of a fit); where the model held no step, its unstaged one stays set.
    `clocks`: per phase, a list its steps' host times go to.
    """
    state = model_state(model)
    saved = {}
    clocks = clocks or {}
    with contextlib.ExitStack() as stack:
        for phase in phases:
            attr = FUNCTIONS[phase]
            saved[phase] = (getattr(model, attr, None), state.active.get(phase))
            stack.enter_context(
                set_aside(
                    phase, state.runners, state.recording, state.step_clocks
                )
            )
            if phase in clocks:
                state.step_clocks[phase] = clocks[phase]
            unstaged = state.staged_functions.get((phase, UNSTAGED_STEPS))
            # Setting a compiled step goes through Keras's attribute
            # tracking, a cost on every short call: set only what changes.
            if saved[phase][0] is not unstaged:
                setattr(model, attr, unstaged)
            state.active[phase] = None
        try:
            yield
        finally:
            for phase in clocks:
                state.step_clocks.pop(phase, None)
            for phase in phases:
                attr = FUNCTIONS[phase]
                unstaged = getattr(model, attr, None)
                state.staged_functions[(phase, UNSTAGED_STEPS)] = unstaged
                function, active = saved[phase]
                # Where the model held no step, the unstaged one stays for
                # the next unstaged call (a staged call sets its own).
                if function is not None and function is not unstaged:
                    setattr(model, attr, function)
                state.active[phase] = active


def _trunk_jit(model, splits):
    """Whether staged steps are XLA-compiled, or None for Keras's choice.

    Keras turns `jit_compile=True` off for a model with a layer XLA cannot
    compile (string ops, lookups); those are usually the staged ones, so
    the trunk can honour the user's request.
    """
    requested = model_state(model).requested_jit
    if requested == "auto":
        requested = backends.for_model(model).jit_by_default
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
                stacklevel=6,
            )
            return False
    return True


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


def _with_data_backup(
    model,
    callbacks,
    steps_per_epoch=None,
    reopen=None,
    build_metrics=None,
    ordered=True,
):
    """`callbacks` with a `DataBackup` right after a `BackupAndRestore`.

    `reopen(phase)`: makes the iterator Keras makes at the end of an epoch
    it stepped through (`StagedCall._reopen`), for a resumed epoch that
    ends before Keras's count of its steps (see
    `tensorflow_steps.track_iterator`). `build_metrics(phase)`: builds the
    metrics the resumed epoch restores (`StagedCall._build_metrics`).
    `ordered`: the stage's `deterministic`.
    """
    state = model_state(model)
    out = []
    for callback in callbacks:
        out.append(callback)
        if isinstance(callback, keras.callbacks.BackupAndRestore):

            def current(state=state):
                ref = state.iterators.get("train")
                return None if ref is None else ref()

            def stage_restored(variables, state=state):
                # `variables` hold their saved values; the restored
                # iterator has numbered nothing yet.
                state.split.unnumbered.assign(True)

            def drew_itself(left, state=state):
                """Whether the restore drew a reshuffle seed of its own.

                It does (measured with tf.data alone) when the saved
                iterator held no more of the source: when it had handed
                out the epoch's last batch (`left` 0), or, with the staged
                random layers' numbering `scan` before the stage, when the
                stage had read the source to its end (the restored scan
                then numbered nothing: the mark is still set).
                """
                split = state.split
                if split is not None and split.unnumbered is not None:
                    drew = bool(split.unnumbered.numpy())
                    split.unnumbered.assign(False)
                    return drew
                return left == 0

            def restore_next(restore, left, epoch, state=state):
                if steps_per_epoch is not None:
                    # Keras reads one iterator across the epochs: the
                    # restored one holds the later epochs' batches too.
                    left = None
                elif reopen is not None:
                    # A run never stopped drew 2 * epoch times from a
                    # reshuffling source before this epoch's iterator
                    # (Keras makes one as each epoch begins and one after
                    # each it stepped through). The restore usually sets
                    # the sequence's state itself; when it draws one of
                    # its own instead (`drew_itself`), as this epoch's new
                    # iterator makes one, these draws come first. In epoch
                    # 0 those two already are the two a run never stopped
                    # makes before epoch 1, and the epoch's end makes none
                    # (measured: the uninterrupted run's orders, see
                    # docs/reliability.md).
                    reopen("train", max(2 * epoch - 1, 0))
                end = None
                if reopen is not None:

                    def end(epoch=epoch, left=left, drew_itself=drew_itself):
                        if not (drew_itself(left) and epoch == 0):
                            reopen("train")

                state.pending_restores["train"] = (restore, left, end)

            def stage_state(state=state):
                ordinal = None if state.split is None else state.split.ordinal
                return {} if ordinal is None else {"stage_ordinal": ordinal}

            build = None
            if build_metrics is not None:
                build = functools.partial(build_metrics, "train")
            data_backup = DataBackup(
                callback,
                current,
                restore_next,
                build,
                stage_state,
                ordered,
                stage_restored,
            )
            # Before BackupAndRestore loads the files, as fit begins.
            data_backup.recover()
            out.append(data_backup)
    return out


def _with_prefetch_callback(callbacks, progbar=False):
    """The callback list with a PrefetchCallback first, and that callback.

    Only Keras's progress bar goes before it (`progbar`: the call shows
    one), so that what the PrefetchCallback prints at an epoch's end
    follows the epoch's progress line instead of landing inside it. Keras
    appends the bar it adds after the callbacks it is given, and uses the
    one it is given instead.
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
    bars = [
        cb for cb in callbacks if isinstance(cb, keras.callbacks.ProgbarLogger)
    ]
    if progbar and not bars:
        bars = [keras.callbacks.ProgbarLogger()]
    others = [
        cb
        for cb in callbacks
        if cb is not prefetch and not any(cb is bar for bar in bars)
    ]
    return bars + [prefetch] + others, prefetch
