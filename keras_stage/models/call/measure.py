"""What a staged or unstaged call measures for the policy, which decides
from these costs (`facts.costs(model)`): its stage's build and iterators,
its steps' host times and traces and, unstaged, Keras's epoch starts.
"""

import functools
import statistics
import time

import keras

from keras_stage.models.call.facts import costs, traces_whole_step
from keras_stage.models.data_adapters import stage_data
from keras_stage.models.data_adapters.staged_data import StageCosts
from keras_stage.models.decision.learned import learned

# The phases whose compiled steps the host times (`tensorflow_steps.guard`).
TIMED_PHASES = ("train", "test")


def staged_data(model, phase, layer, role, *args, **kwargs):
    """`stage_data(layer, phase, *args, role=role, **kwargs)`, its build,
    trace and iterators noted."""
    measured = costs(model)
    split = kwargs.get("split")
    traced = 0.0 if split is None else split.trace_seconds
    record = StageCosts(
        phase,
        on_iterator=functools.partial(measured.note_iterator, phase),
        # The host times a SmartStage call's steps (`note_work`).
        step_clock=[] if split is not None and phase in TIMED_PHASES else None,
    )
    started = time.perf_counter()
    data = stage_data(layer, phase, *args, role=role, costs=record, **kwargs)
    seconds = time.perf_counter() - started
    if split is not None and split.trace_seconds > traced:
        # Tracing the prefix is paid once per model: noted apart.
        measured.note_trace(phase, split.trace_seconds - traced)
        seconds -= split.trace_seconds - traced
    measured.note_build(phase, seconds)
    return data


def iterator_cost(model, phase):
    """The measured seconds of a new iterator of a `phase` stage, or None."""
    measured = learned(model).costs
    if measured is None or phase is None:
        return None
    return measured.phase(phase).iterator_seconds


def resize_cost(model, data):
    """What resizing `data`'s pool before the next epoch costs, or None:
    a new iterator where the next epoch would read on from its own."""
    if not data.iterators.resize_makes_an_iterator():
        return 0.0
    return iterator_cost(model, data.cost_phase)


def note_work(model, data):
    """Notes the work and steps of `data`'s stage in the call ending."""
    if data.staged.stats.closed:
        return
    snapshot = data.staged.stats.snapshot()
    busy, produced = data.work_before
    measured = costs(model)
    note_traces(model)
    measured.note_work(
        data.cost_phase,
        snapshot["busy_seconds"] - busy,
        snapshot["produced"] - produced,
        has_work=data.split is not None,
    )
    if data.step_clock is not None:
        measured.note_steps(data.cost_phase, data.step_clock, staged=True)


def timed_unstaged_phases(model, phases):
    """The phases of an unstaged call whose steps the host should time:
    those whose trial is due or whose whole step the call traces."""
    measured = learned(model).costs
    if measured is None:
        return ()
    return tuple(
        phase
        for phase in phases
        if phase in TIMED_PHASES
        and (
            measured.phase(phase).trial_due() or traces_whole_step(model, phase)
        )
    )


class EpochStartClock(keras.callbacks.Callback):
    """Times each epoch of an unstaged fit outside its steps: from its begin
    to its first step (Keras making its iterator), and from its last step
    to its validation or end (letting it go). `seconds`: one per epoch.
    """

    def __init__(self):
        super().__init__()
        self.seconds = []
        self._begun = None
        self._started = None  # the epoch's start, once its first step came
        self._stepped = None  # when its last step so far ended

    def on_epoch_begin(self, epoch, logs=None):
        self._begun = time.perf_counter()
        self._started = self._stepped = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._begun is not None:
            self._started = time.perf_counter() - self._begun
            self._begun = None

    def on_train_batch_end(self, batch, logs=None):
        self._stepped = time.perf_counter()

    def on_test_begin(self, logs=None):
        self._end()  # the fit's validation: not the epoch's own end

    def on_epoch_end(self, epoch, logs=None):
        self._end()

    def _end(self):
        if self._started is not None and self._stepped is not None:
            ending = time.perf_counter() - self._stepped
            self.seconds.append(self._started + ending)
        self._started = self._stepped = None


def note_epoch_starts(model, seconds):
    """Notes the mean of an `EpochStartClock`'s epochs. Keras lets each
    epoch's iterator go as the next starts, and tf.data's tear-down of it
    now and then waits up to seconds for its autotuner's thread (criteo, 6
    epochs: half the starts waited 0.5-1.3 s); a stage's one iterator does
    not. An expected cost, so the mean (the noted calls' median guards
    against one busy call)."""
    if seconds:
        costs(model).phase("train").note(epoch_start=statistics.fmean(seconds))


def note_unstaged_steps(model, clocks):
    """Notes the host-timed steps of an unstaged call, per phase."""
    for phase, seconds in clocks.items():
        costs(model).note_steps(phase, seconds, staged=False)
    note_traces(model)


def note_traces(model):
    """Notes the steps' traces timed since the last call (`Learned.traces`)."""
    record = learned(model)
    traces, record.traces = record.traces, []
    if not traces:
        return
    measured = costs(model)
    for phase, kind, seconds in traces:
        measured.phase(phase).note(**{kind: seconds})
