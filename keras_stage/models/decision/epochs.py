"""Whether a staged fit's next epoch is staged: measured, epoch by epoch.

Where the stage keeps up and the cores are all busy, its threads only move
the prefix's work onto the trunk's cores, and the whole model in Keras's
step can be as fast. So a fit that may gain (`epoch_switch` says which:
the epochs must read exactly plain Keras's batches either way) runs its
first epochs staged, then one epoch unstaged (the trial, when its step
waited little for input and tracing the whole step is a small share of the
epochs left), and the faster of the two by the measured warm steps runs
the rest; the stage keeps them unless the whole model saves `MARGIN`.
docs/design.md ("How a call is decided") has the rules and their regimes.
"""

import logging
import statistics
import time

import keras

from keras_stage.data.eager_iterated import EagerIterated
from keras_stage.models.decision.calls import (
    TRACE_SHARE,
    Kind,
    compare,
    costs,
    may_skip_stage,
    trace_owed,
    traces_whole_step,
)
from keras_stage.models.decision.learned import learned
from keras_stage.models.iterators.kept_iterators import KeptIterator, resolve

logger = logging.getLogger("keras_stage")

# The most the step of a measured staged epoch may have waited for input,
# as a fraction of the epoch's step time, for the stage to be tried
# against the whole model: a step that waits is fed faster by the stage.
TRIAL_WAIT_RATIO = 0.1
# The share of the staged epochs' time the whole model must save to take
# the remaining epochs: within noise, the stage keeps them.
MARGIN = 0.03
# The fewest compiled-step calls an epoch needs to be timed.
MIN_STEPS = 8
STAGED, UNSTAGED = "staged", "unstaged"
TRAIN = "train"


def epoch_switch(model, layer, data, epochs, callbacks):
    """The `EpochSwitch` of a fit's training stage, or None.

    Args:
        model: The keras_stage model.
        layer: Its `StagedInput`.
        data: The training `StagedData`.
        epochs: The epochs the fit runs (`epochs - initial_epoch`).
        callbacks: The call's callbacks.
    """
    reason = _refusal(model, layer, data, epochs, callbacks)
    if reason is not None:
        logger.debug("%s: every epoch staged: %s.", data.staged.name, reason)
        return None
    return EpochSwitch(
        model,
        data.staged.name,
        epochs,
        data.staged.stats,
        staged_before_trial=_staged_before_trial(
            data.staged.thread_pool is not None
        ),
        shares_iterator=data.long_lived,
    )


def may_switch(model, layer, split, epochs):
    """Whether a fit of `epochs` epochs might get an `EpochSwitch`.

    Before its stage is built, from the part of `_refusal` that does not
    depend on its data (`split`: the call's SmartStage split, or None): a
    stage whose epochs cannot skip one (a fed source, see
    `kept_iterators.FedSource`) is built only where no switch could run.
    """
    adaptive = layer.stage_options.adaptive_pool
    return _model_refusal(model, layer, split, epochs, adaptive) is None


def _staged_before_trial(adaptive_pool):
    """The staged epochs measured before the trial.

    An adaptive pool is resized after the first epoch: the stage is
    measured on the pool it keeps.
    """
    return 2 if adaptive_pool else 1


def _model_refusal(model, layer, split, epochs, adaptive_pool):
    """Why no epoch of such a fit may skip its stage, whatever its data."""
    if not may_skip_stage(layer):
        return "adaptive=False, exception policies or the tf.data service"
    if split is None or not split.plan.staged_layers:
        return "no SmartStage prefix to run in the step"
    if split.seed_states:
        return "the staged layers draw random numbers"
    if epochs < _staged_before_trial(adaptive_pool) + 2:
        return "too few epochs to try the step without the stage"  # +trial
    if learned(model).switch_verdicts.get(TRAIN) == STAGED:
        return "an earlier fit of this model measured that the stage pays"
    return None


def _refusal(model, layer, data, epochs, callbacks):
    """Why a fit's epochs are all staged, or None if one may be tried."""
    adaptive = data.staged.thread_pool is not None
    reason = _model_refusal(model, layer, data.split, epochs, adaptive)
    if reason is not None:
        return reason
    if not data.epochs_skippable:
        return "its epochs run on one iterator, which cannot skip one"
    if data.strategy is not None or data.staged.device is not None:
        return "a strategy's replicas or a device buffer"
    if any(isinstance(c, keras.callbacks.BackupAndRestore) for c in callbacks):
        return "BackupAndRestore checkpoints the epoch's iterator"
    if not data.in_step:
        return "its step does not time its fetches"
    return None


class _EpochClock:
    """The steps of one epoch (one iterator read), as the guard timed them."""

    def __init__(self, mode, made_seconds, stats):
        self.mode = mode
        self.made_seconds = made_seconds
        self.steps = []
        self._stats = stats
        self._wait_before = stats.snapshot()["wait_seconds"]
        self.wait_seconds = None

    def add(self, seconds):
        self.steps.append(seconds)

    def end(self):
        """Notes the stage's wait over the epoch (NaN: not measured)."""
        self.wait_seconds = self._stats.snapshot()["wait_seconds"] - (
            self._wait_before
        )

    @property
    def timed(self):
        return len(self.steps) >= MIN_STEPS

    @property
    def warm_step(self):
        """The median step after the first (which makes the iterator and,
        once per call, traces)."""
        return statistics.median(self.steps[1:])

    def seconds(self, batches, epochs=1):
        """`epochs` such epochs at their warm pace, each making its
        iterator and `batches` steps."""
        return epochs * (self.made_seconds + batches * self.warm_step)

    @property
    def wait_ratio(self):
        """The staged step's wait for input over its steps, or None."""
        if self.wait_seconds is None or self.wait_seconds != self.wait_seconds:
            return None
        return self.wait_seconds / max(sum(self.steps[1:]), 1e-9)


class EpochSwitch:
    """Decides, measures and reports the mode of each epoch of one fit.

    See the module docstring. `decision` is None until the trial ends,
    then `STAGED` or `UNSTAGED`; `message` says why.
    """

    def __init__(
        self, model, name, epochs, stats, staged_before_trial, shares_iterator
    ):
        self._model = model
        self.model_name = model.name
        self.name = name
        self.epochs = epochs
        self._stats = stats
        self._staged_before_trial = staged_before_trial
        # Whether the staged epochs after a decision read one iterator (a
        # long-lived stage): they then make one more, not one each.
        self._shares_iterator = shares_iterator
        self._clocks = []  # of the epochs read, in order
        self.decision = None
        self.message = None
        self._announced = False
        # `(staged, whole)`: the warm step per batch of the last staged
        # epoch and of the trial, once a timed trial decided; else None.
        self.step_seconds = None

    # -- decisions ----------------------------------------------------------

    def next_mode(self):
        """The mode of the iterator Keras asks for now."""
        self._end_last()
        if self.decision is not None:
            return self.decision
        staged = [c for c in self._clocks if c.mode == STAGED]
        trial = [c for c in self._clocks if c.mode == UNSTAGED]
        if trial:
            self._decide(staged[-1], trial[-1])
            return self.decision
        if len(staged) < self._staged_before_trial:
            # Before the last staged epoch the trial waits for (the first
            # on a resized pool), the first epoch may rule it out already:
            # decided now, the epochs left read one iterator (a drawing
            # dataset's staged epochs each end theirs while the trial may
            # come: see `LongLivedIterator`).
            after_trial = self.epochs - self._staged_before_trial - 1
            if staged and self._rules_out(staged, staged[0], after_trial):
                self.decision = STAGED  # nothing tried: nothing to report
            return STAGED
        last = staged[-1]
        left = self.epochs - len(self._clocks)
        # A wait not measured (None, see the module docstring): the trial
        # then tells alone whether the stage pays.
        ratio = last.wait_ratio
        if (ratio is not None and ratio > TRIAL_WAIT_RATIO) or self._rules_out(
            staged, last, left - 1
        ):
            self.decision = STAGED  # nothing tried: nothing to report
            logger.debug(
                "%s: every epoch staged (wait ratio %s, %d steps, %d "
                "epochs left).",
                self.name,
                "not measured" if ratio is None else f"{ratio:.2f}",
                len(last.steps),
                left,
            )
            return STAGED
        return UNSTAGED

    def _rules_out(self, staged, clock, after_trial):
        """Whether `clock`'s staged epoch rules the trial out.

        Epochs too short to time, no epoch after the trial to gain, or a
        trace that would outweigh the `after_trial` epochs at its pace.
        """
        return (
            not clock.timed
            or after_trial < 1
            or self._trace_outweighs(staged, clock, after_trial)
        )

    def _trace_outweighs(self, staged, last, after_trial):
        """Whether tracing the whole model's step would cost more than
        `TRACE_SHARE` of the epochs left after the trial.

        Not traced yet (no unstaged call or epoch of the model ran it), it
        costs about what the call's first staged step took over its warm
        ones (that step traced the trunk's step, if this call did), and at
        least what the calls' decisions count it at (`calls.trace_owed`:
        measured on a model with this stage, less what its staged calls
        paid toward it). A later fit, whose trunk's step is traced, would
        otherwise read it as free and trace the whole step in a call that
        was staged because that trace outweighs it.
        """
        if not traces_whole_step(self._model, TRAIN):
            return False
        first = staged[0]
        trace = max(first.steps[0] - first.warm_step, 0.0) if first.timed else 0
        trace = max(trace, trace_owed(self._model, TRAIN, costs(self._model)))
        budget = TRACE_SHARE * self._staged_seconds(
            last, len(last.steps), after_trial
        )
        return trace > budget

    def _staged_seconds(self, clock, batches, epochs):
        """`epochs` staged epochs of `batches` steps at `clock`'s pace.

        A long-lived stage's epochs after the decision read one more
        iterator, not one each; it costs about what the slowest staged
        epoch took to start (its first made the stage's first iterator: a
        later epoch on the same iterator made none).
        """
        if not self._shares_iterator:
            return clock.seconds(batches, epochs)
        made = max(c.made_seconds for c in self._clocks if c.mode == STAGED)
        return made + epochs * batches * clock.warm_step

    def _decide(self, staged, trial):
        batches = max(len(staged.steps), len(trial.steps))
        if not trial.timed:
            self.decision = STAGED
            return
        # Over the epochs the decision runs, each making its iterator
        # unstaged, and staged one more (or one each, see `_staged_seconds`).
        left = max(self.epochs - len(self._clocks), 1)
        with_stage = self._staged_seconds(staged, batches, left)
        whole = trial.seconds(batches, left)
        per_execution = max(int(self._model.steps_per_execution), 1)
        self.step_seconds = (
            staged.warm_step / per_execution,
            trial.warm_step / per_execution,
        )
        ms = 1000.0 / (batches * left)
        figures = (
            f"{with_stage * ms:.2f} ms a step staged, {whole * ms:.2f} ms "
            "with the whole model in the step"
        )
        if compare(with_stage, whole, MARGIN) is Kind.DOES_NOT_PAY:
            self.decision = UNSTAGED
            self.message = (
                f"Stage '{self.name}' of model '{self.model_name}' does not "
                f"pay ({figures}): the step does not wait for input and the "
                "stage's threads take the trunk's cores. The rest of this "
                "fit runs the whole model in Keras's step (same results); "
                "StagedInput(adaptive=False) keeps every epoch staged."
            )
        else:
            self.decision = STAGED
            learned(self._model).switch_verdicts[TRAIN] = STAGED
            self.message = (
                f"Stage '{self.name}' of model '{self.model_name}' pays "
                f"({figures}): the rest of this fit, and later fits of "
                "this model, stay staged."
            )
        logger.info("%s", self.message)

    # -- the epochs read ----------------------------------------------------

    def begin(self, mode, made_seconds):
        """Notes that Keras reads an epoch of `mode`; returns its clock."""
        self._end_last()
        clock = _EpochClock(mode, made_seconds, self._stats)
        self._clocks.append(clock)
        return clock

    def _end_last(self):
        if self._clocks and self._clocks[-1].wait_seconds is None:
            self._clocks[-1].end()

    @property
    def last_unstaged(self):
        """Whether the epoch read last ran without the stage."""
        return bool(self._clocks) and self._clocks[-1].mode == UNSTAGED

    @property
    def report_pending(self):
        """Whether a decision was made that `report` has not told yet."""
        return self.message is not None and not self._announced

    def report(self):
        """The decision's message once, when it is made; else None."""
        if not self.report_pending:
            return None
        self._announced = True
        return self.message

    # -- Keras's view -------------------------------------------------------

    def pipeline(self, staged, raw, on_unstaged=None):
        """What Keras iterates: `staged`'s or `raw`'s epochs, as decided.

        `staged`: the stage's epochs as Keras iterates them; `raw`: one
        epoch of the source the stage stages (plain Keras's epoch), both
        datasets that make their own eager iterators. `on_unstaged()`:
        called when an epoch begins without the stage (a long-lived stage
        skips that epoch).
        """
        return SwitchPipeline(self, staged, raw, on_unstaged)


class SwitchPipeline(EagerIterated):
    """The staged pipeline, whose eager iterators are staged or unstaged.

    Each iterator Keras makes asks the `EpochSwitch` for its mode: a staged
    one reads the stage; an unstaged one reads the stage's source, for the
    whole model's step (see `tensorflow_steps.guard`).
    """

    def __init__(self, switch, staged, raw, on_unstaged=None):
        self._switch = switch
        self._staged = staged
        self._raw = raw
        self._on_unstaged = on_unstaged
        super().__init__(staged)

    def eager_iter(self):
        mode = self._switch.next_mode()
        started = time.perf_counter()
        pipeline = self._raw if mode == UNSTAGED else self._staged
        iterator = pipeline.eager_iter()
        return SwitchedIterator(
            self._switch,
            mode,
            iterator,
            time.perf_counter() - started,
            self._on_unstaged if mode == UNSTAGED else None,
        )


class SwitchedIterator(KeptIterator):
    """An epoch's iterator of a `SwitchPipeline`, timed step by step.

    `unstaged`: whether the whole model's step reads it. The step guard
    times each step (`clock`), from the first read on.
    """

    def __init__(self, switch, mode, iterator, made_seconds, on_begin=None):
        self._switch = switch
        self.unstaged = mode == UNSTAGED
        self._mode = mode
        self._iterator = iterator
        self._made_seconds = made_seconds
        self._on_begin = on_begin
        self.clock = None

    def resolve(self):
        """The real iterator; the first call begins the epoch's clock."""
        if self.clock is None:
            if self._on_begin is not None:
                self._on_begin()
            started = time.perf_counter()
            real = resolve(self._iterator)
            made = self._made_seconds + time.perf_counter() - started
            self.clock = self._switch.begin(self._mode, made)
            return real
        return resolve(self._iterator)

    @property
    def element_spec(self):
        return self._iterator.element_spec
