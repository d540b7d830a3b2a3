"""Whether a call of a keras_stage model is staged, from measured costs.

With `StagedInput(adaptive=True)`, a call on in-memory data (arrays, or a
`tf.data.Dataset` of tensors in memory) that cannot repay its stage runs
the whole model in Keras's step, unstaged, with the same results. A stage
saves at most the staged work of every batch but the first, less what it
slows the steps (the host times both kinds in one unstaged call, the
trial), and costs its set-up: its pipeline, each iterator it makes, and a
model's first plan and traces. Running unstaged first traces the whole
model's step, which counts against it until the model's staged calls have
paid as much (`trace_owed`). Costs are noted per phase (`CallCosts`),
shared by models of the same stage (`stage_signature`). Data the stage
overlaps (maps, files, Python) or of unknown length is always staged.
Each call's `Decision` is a `Kind` and its figures; docs/design.md ("How a
call is decided") has the rules and the regimes each serves.
"""

import collections
import dataclasses
import enum
import functools
import logging
import statistics
import time

import keras
import tensorflow as tf

from keras_stage.data.staging import StagedDataset
from keras_stage.layers.staged_input import StagedInput
from keras_stage.models.data_adapters import datasets
from keras_stage.models.data_adapters.arrays import batch_count
from keras_stage.models.data_adapters.staged_data import (
    StageCosts,
    epochs_refusal,
    stage_data,
    strategy_refusal,
)
from keras_stage.models.decision.learned import learned
from keras_stage.models.iterators.kept_iterators import carries
from keras_stage.models.model_state import UNSTAGED_STEPS
from keras_stage.models.model_state import state as model_state
from keras_stage.planner.state_access import all_layers, seed_states

logger = logging.getLogger("keras_stage")

# The fewest warm steps (after a call's first) whose median is noted.
MIN_TIMED_STEPS = 4
# The phases whose compiled steps the host can time (`tensorflow_steps.guard`
# wraps them; predict's batches are read in Python).
TIMED_PHASES = ("train", "test")
# The most of a call's own step time that tracing the whole model's step
# for an unstaged trial may cost (as `epochs.TRACE_SHARE` for an epoch).
TRACE_SHARE = 0.1
# The staged calls of a phase (on models with its stage) after which its
# trial runs whatever tracing the whole step costs: calls that repeat (a
# loop of fits or evaluates) repay the trace, and a stage that slows their
# steps costs each of them more than its set-up says.
LOOP_CALLS = 3
# The most batches a first call from in-memory data (nothing measured on a
# model with its stage yet) may read and still run unstaged: a stage's
# set-up (plan, pipeline, traces, iterators) is repaid by in-memory
# preprocessing only over more batches than this (docs/smart-stage.md,
# calls that skip their stage). Unstaged, such a call costs what plain
# Keras's does.
FIRST_CALL_BATCHES = 32


class Kind(enum.Enum):
    """What decided a call: each kind stages it or not, and says why.

    Its value is the name the log and the verdict give it.
    """

    BY_REQUEST = "by_request"  # adaptive=False, a policy, the service
    JIT_COMPILE = "jit_compile"
    RANDOM_PREFIX = "random_prefix"
    UNBOUNDED = "unbounded"  # data the stage overlaps, or of unknown length
    ONE_BATCH = "one_batch"
    FIRST_CALL = "first_call"
    UNMEASURED = "unmeasured"
    TRIAL = "trial"
    LEARNING = "learning"  # steps timed, the whole model's not yet
    PAYS = "pays"
    DOES_NOT_PAY = "does_not_pay"
    VALIDATION_PAYS = "validation_pays"  # a fit staged for its validation
    TRAINING_LOSES = "training_loses"  # ... unless its training loses more

    @property
    def staged(self):
        return self not in _UNSTAGED_KINDS


_UNSTAGED_KINDS = frozenset(
    (
        Kind.ONE_BATCH,
        Kind.FIRST_CALL,
        Kind.TRIAL,
        Kind.DOES_NOT_PAY,
        Kind.TRAINING_LOSES,
    )
)


def _ms(seconds):
    return f"{1000 * seconds:.1f} ms"


def _unbounded(f):
    if f["source"] == "staged":
        return "its dataset is staged already (keras_stage.data.stage)"
    if f["source"] == "python":
        return (
            "its data is read in Python (a generator or a PyDataset), which "
            "the stage overlaps and which is not measured: the call keeps "
            "its stage"
        )
    why = [
        text
        for key, text in (
            ("unknown_length", "its dataset's length is unknown"),
            ("infinite", "its dataset repeats without end (no `steps`)"),
            ("maps", "its dataset runs functions or reads files"),
        )
        if f.get(key)
    ] or ["its data is read by a pipeline the stage overlaps"]
    return " and ".join(why) + (
        ", so its staged work cannot be weighed before it runs: the call "
        "keeps its stage"
    )


def _weighed(f):
    """The figures a measured call compared, signed."""

    def ms(key):
        return f"{1000 * f[key]:+.1f} ms"

    epochs = "epoch" if f["epochs"] == 1 else f"{f['epochs']} epochs"
    starts = (
        f", {ms('starts')} of Keras starting its {epochs}"
        if f["starts"]
        else ""
    )
    return (
        f"staging {f['batches']} batches saves {ms('saving')} of steps"
        f"{starts} and {ms('owed')} of tracing the whole model's step, and "
        f"costs {_ms(f['set_up'])} of set-up: {ms('gain')} in all"
    )


# Why each kind decides as it does, from its figures (`Decision.figures`).
MESSAGES = {
    Kind.BY_REQUEST: lambda f: (
        "StagedInput(adaptive=False), an exception policy or the tf.data "
        "service: every call is staged"
    ),
    Kind.JIT_COMPILE: lambda f: (
        "jit_compile=True, which its staged trunk takes and its whole "
        "model's step may not (XLA compiles no string ops or lookups)"
    ),
    Kind.RANDOM_PREFIX: lambda f: (
        "its staged random layers draw from the stage's seeds: unstaged, "
        "they would draw other numbers"
    ),
    Kind.UNBOUNDED: _unbounded,
    Kind.ONE_BATCH: lambda f: "one batch has nothing to overlap",
    Kind.FIRST_CALL: lambda f: (
        f"a first call of {f['batches']} batches from in-memory data (at "
        f"most {FIRST_CALL_BATCHES}) is too short to repay a stage's set-up; "
        "the next is staged and measured"
    ),
    Kind.UNMEASURED: lambda f: "nothing is measured on a model with its stage",
    Kind.TRIAL: lambda f: (
        "it times the whole model's steps once, against the staged steps"
    ),
    Kind.LEARNING: lambda f: (
        f"the whole model's steps are not timed yet and tracing them "
        f"({_ms(f['owed'])}) outweighs this call; its {_ms(f['set_up'])} of "
        "set-up count toward that trace"
    ),
    Kind.PAYS: _weighed,
    Kind.DOES_NOT_PAY: _weighed,
    Kind.VALIDATION_PAYS: lambda f: (
        f"its training alone would not ({f['training'].reason}), but its "
        f"validation can: {f['validation'].reason}"
    ),
    Kind.TRAINING_LOSES: lambda f: (
        "staging its validation would stage its training too, which loses "
        f"more than the validation gains ({f['validation'].reason}; its "
        f"training: {f['training'].reason})"
    ),
}


def compare(staged_seconds, whole_seconds, margin=0.0):
    """The policy's one comparison, for a call and for a fit's epochs.

    `Kind.DOES_NOT_PAY` when the whole model in Keras's step takes at most
    `1 - margin` of the staged time, else `Kind.PAYS`: within `margin`, the
    stage keeps the work.
    """
    if whole_seconds <= staged_seconds * (1.0 - margin):
        return Kind.DOES_NOT_PAY
    return Kind.PAYS


@dataclasses.dataclass(frozen=True)
class Decision:
    """How a call runs: a `Kind` and the figures (seconds) it weighed.

    Figures: `batches`, `set_up` (the stage's build, iterators, plan and
    traces the call pays), `saving` (staged steps against the whole
    model's, signed: below zero the stage slows them), `owed` (tracing
    the whole model's step, were it unstaged), `starts` (Keras's epoch
    starts unstaged), `gain` (what staging saves the call, signed) and
    `rent` (what a staged call pays over an unstaged, traced one), where
    the kind weighed them.
    """

    kind: Kind
    figures: dict = dataclasses.field(default_factory=dict)

    @property
    def staged(self):
        return self.kind.staged

    @property
    def trial(self):
        return self.kind is Kind.TRIAL

    @property
    def first_call(self):
        return self.kind is Kind.FIRST_CALL

    @property
    def gain(self):
        return self.figures.get("gain")

    @property
    def rent(self):
        """What a staged call pays toward the whole step's trace."""
        return self.figures.get("rent", 0.0)

    @property
    def reason(self):
        """Why, in a sentence (`MESSAGES`)."""
        return MESSAGES[self.kind](self.figures)


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


def call_batches(x, batch_size, steps):
    """The batches a call reads from in-memory data, or None.

    In-memory arrays, or a `tf.data.Dataset` of tensors in memory (see
    `datasets.batch_count`): data whose reading a stage cannot overlap.
    None for anything else (always staged).
    """
    if isinstance(x, tf.data.Dataset):
        return datasets.batch_count(x, steps)
    return batch_count(x, batch_size, steps)


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
    from in-memory data, see `call_batches`), and the epochs and
    validation runs, each making one iterator.
    """
    epochs, first = max(epochs - initial_epoch, 0), initial_epoch
    train = call_batches(x, batch_size, steps_per_epoch)
    train = None if train is None else train * epochs
    if validation_data is None:
        return (train, epochs), (None, 0)
    runs = validation_runs(first, first + epochs, validation_freq)
    val_x, _, _ = keras.utils.unpack_x_y_sample_weight(validation_data)
    val = call_batches(
        val_x, validation_batch_size or batch_size, validation_steps
    )
    return (train, epochs), (None if val is None else val * runs, runs)


class PhaseCosts:
    """What staging one phase (train, test, predict) cost on a model.

    The set-up and trace costs are the medians of the last `SAMPLES`
    measured (`note`): one slow build, iterator or trace (a busy moment of
    the machine) does not flip the decisions after it.
    """

    SAMPLES = 5

    def __init__(self):
        # Seconds to build a call's stage, to make one iterator of it, of
        # the first call of the whole model's step and of the trunk's (its
        # trace, graph set-up and one step), of the trunk's step's Python
        # while traced (see `note_traces`), and of what Keras spends
        # starting and ending each epoch of an unstaged fit
        # (`EpochStartClock`): the
        # last few measured.
        self._samples = {
            key: collections.deque(maxlen=self.SAMPLES)
            for key in (
                "build",
                "iterator",
                "whole_trace",
                "step_call",
                "step_trace",
                "epoch_start",
            )
        }
        # Seconds of staged work per batch; None when not measured (no
        # staged computation, or under op determinism a pipeline whose
        # tf.data model could not be read).
        self.batch_seconds = None
        # Seconds a model's first staged call of the phase spends tracing
        # its staged prefix (0 without a SmartStage split).
        self.trace_seconds = 0.0
        # The median warm step of the phase's last staged call and of its
        # unstaged trial, timed on the host, per batch: what the stage
        # saved a step (`batch_saving`).
        self.staged_step_seconds = None
        self.unstaged_step_seconds = None
        # Whether a first call of the phase ran unstaged, unmeasured (see
        # `FIRST_CALL_BATCHES`): the next short one is staged and measured.
        self.first_call_skipped = False
        # The staged calls of the phase whose work was noted (`LOOP_CALLS`).
        self.staged_calls = 0

    def _median(self, key, default=None):
        samples = self._samples[key]
        return statistics.median(samples) if samples else default

    @property
    def build_seconds(self):
        """Seconds to build a call's stage, or None."""
        return self._median("build")

    @property
    def iterator_seconds(self):
        """Seconds to make one iterator of it, or None."""
        return self._median("iterator")

    @property
    def epoch_start_seconds(self):
        """Seconds an unstaged fit's epoch takes to start and end, or None.

        Keras makes each epoch's iterator of the data (for arrays, a
        shuffled and sliced pipeline) before its first step and lets it go
        after its last; a stage whose epochs run on one iterator makes one
        for them all.
        """
        return self._median("epoch_start")

    @property
    def unstaged_trace_seconds(self):
        """Seconds the whole model's step took to trace, or None."""
        return self._median("whole_trace")

    @property
    def step_trace_seconds(self):
        """Seconds the trunk's step's Python took while traced, or 0."""
        return self._median("step_trace", 0.0)

    @property
    def step_call_seconds(self):
        """Seconds of the trunk's step's first call, or its Python's (0).

        What a staged call that compiles the step adds: its trace, graph
        set-up and first step, with the wait for the stage's first batch.
        """
        return self._median("step_call", self.step_trace_seconds)

    def note(self, **seconds):
        """Notes measured seconds: `build`, `iterator`, `whole_trace`,
        `step_call`, `step_trace`, `epoch_start` (see `__init__`)."""
        for key, value in seconds.items():
            self._samples[key].append(value)

    def batch_saving(self):
        """What staging saves per batch at most, in seconds, or None.

        The staged work per batch bounds it; what the host measured once
        both kinds of steps were timed bounds it too: the whole model's
        step less the staged step (which includes its waits for the
        stage). On cores the trunk keeps busy, the stage's threads take
        them from the trunk: that saving is then below zero, and a call
        loses by staging (signed, it is weighed as it was measured).
        """
        steps = None
        if (
            self.staged_step_seconds is not None
            and self.unstaged_step_seconds is not None
        ):
            steps = self.unstaged_step_seconds - self.staged_step_seconds
        if self.batch_seconds is None:
            return steps
        return (
            self.batch_seconds
            if steps is None
            else min(steps, self.batch_seconds)
        )

    def measured(self):
        return (
            self.build_seconds is not None
            and self.iterator_seconds is not None
            and self.batch_saving() is not None
        )

    def trial_due(self):
        """Whether the next call should run unstaged to time its steps.

        Once a staged call's steps were timed on the host, one unstaged
        call of the phase gives the other side of the comparison.
        """
        return (
            self.build_seconds is not None
            and self.iterator_seconds is not None
            and self.staged_step_seconds is not None
            and self.unstaged_step_seconds is None
        )

    def saving(self, batches):
        """The most staging `batches` batches can save, in seconds."""
        return max(batches - 1, 0) * self.batch_saving()

    def step_seconds(self, batches):
        """What `batches` warm staged steps take, or None if not timed."""
        if self.staged_step_seconds is None:
            return None
        return batches * self.staged_step_seconds

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
        self.phase(phase).note(build=seconds)

    def note_iterator(self, phase, seconds):
        self.phase(phase).note(iterator=seconds)

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
        costs.staged_calls += 1
        if not has_work:
            costs.batch_seconds = 0.0
        elif produced > 0 and busy_seconds > 0:
            costs.batch_seconds = busy_seconds / produced

    def note_steps(self, phase, seconds, staged):
        """Notes the host-timed steps of a call, seconds per batch each.

        `staged`: whether the call ran its stage. The first step (which
        makes the iterator and may trace) is left out; too few to tell
        note nothing.
        """
        warm = list(seconds)[1:]
        if len(warm) < MIN_TIMED_STEPS:
            return
        costs = self.phase(phase)
        median = statistics.median(warm)
        if staged:
            costs.staged_step_seconds = median
        else:
            costs.unstaged_step_seconds = median

    def note_step_pair(self, phase, staged, unstaged):
        """Notes a staged and a whole-model warm step, seconds per batch,
        timed in one call (an `EpochSwitch`'s staged epoch and its trial).
        """
        costs = self.phase(phase)
        costs.staged_step_seconds = staged
        costs.unstaged_step_seconds = unstaged

    def measured_like(self, phase):
        """The costs `phase`'s calls are weighed by.

        Its own; for a `predict` not measured yet, those of `test` when
        measured: the same stage of the same inference prefix, and a step
        that differs by the loss and metrics alone.
        """
        costs = self.phase(phase)
        if phase == "predict" and not costs.measured():
            test = self.phase("test")
            if test.measured():
                return test
        return costs

    def whole_trace(self, phase):
        """About what tracing the whole model's `phase` step costs.

        As measured in an unstaged call of a model with this stage (its
        step's first call: the trace, the graph's set-up and one step);
        before that, what tracing its staged prefix and the trunk's step's
        first call took (the whole step traces both and sets up a graph
        holding both). Not the trunk's trace alone: the graph's set-up is
        often more than the trace, and an estimate short of it would run a
        call unstaged to pay more than the stage it avoids.
        """
        costs = self.measured_like(phase)
        if costs.unstaged_trace_seconds is not None:
            return costs.unstaged_trace_seconds
        prefix = max(
            (other.trace_seconds for other in self._phases.values()),
            default=0.0,
        )
        return prefix + costs.step_call_seconds

    def _set_up(self, costs, iterators, plans, traces, compiles):
        """What a call pays for its stage by `costs` (see `decide`)."""
        set_up = costs.cost(iterators)
        if plans:
            set_up += self.plan_seconds
        if traces:
            set_up += costs.trace_seconds
        if compiles:
            set_up += costs.step_call_seconds
        return set_up

    def stages(self, *args, **kwargs):
        """Whether a call should be staged: `decide(...).staged`."""
        return self.decide(*args, **kwargs).staged

    def describe(self, *args, **kwargs):
        """Why `stages` decided as it did, in a sentence."""
        return self.decide(*args, **kwargs).reason

    def decide(
        self,
        phase,
        batches,
        iterators,
        plans=False,
        traces=False,
        owed=0.0,
        compiles=False,
        unstaged_epochs=0,
    ):
        """The `Decision` on a call of `phase` by the measured costs.

        `batches`: the batches it reads from in-memory data (see
        `call_batches`), or None when it reads something else (always
        staged). `iterators`: the iterators it makes (one per epoch).
        `plans` / `traces`: whether the call would also plan the model's
        SmartStage / trace its prefix for the phase (a model's first
        staged calls). `owed`: the seconds of tracing the whole model's
        step that running unstaged would add (see `trace_owed`).
        `compiles`: whether the call would trace the trunk's step (the
        model has no staged step of the phase). `unstaged_epochs`: the
        epochs Keras would start unstaged, each making its own iterator of
        the data (a fit's training; see `PhaseCosts.epoch_start_seconds`),
        which a stage's epochs on one iterator do not.
        """
        if batches is None:
            return Decision(Kind.UNBOUNDED, {"source": "pipeline"})
        if batches <= 1:
            return Decision(Kind.ONE_BATCH, {"batches": batches})
        costs = self.phase(phase)
        if costs.trial_due() and (
            owed <= TRACE_SHARE * costs.step_seconds(batches)
            or costs.staged_calls >= LOOP_CALLS
        ):
            return Decision(Kind.TRIAL, {"batches": batches, "owed": owed})
        costs = self.measured_like(phase)
        if not costs.measured():
            if costs.build_seconds is None or costs.iterator_seconds is None:
                first = self.phase(phase)
                if (
                    batches <= FIRST_CALL_BATCHES
                    and not first.first_call_skipped
                ):
                    return Decision(Kind.FIRST_CALL, {"batches": batches})
                return Decision(Kind.UNMEASURED, {"batches": batches})
            # Its staged steps are timed, its staged work is not (op
            # determinism where tf.data's model cannot be read) and the
            # trial's trace outweighs this call: the stage's set-up, which
            # an unstaged call would not pay, is rent toward that trace
            # (see `trace_owed`), so a later call runs the trial.
            set_up = self._set_up(costs, iterators, plans, traces, compiles)
            return Decision(
                Kind.LEARNING,
                # Its whole set-up is rent toward the trial's trace.
                {
                    "batches": batches,
                    "owed": owed,
                    "set_up": set_up,
                    "rent": set_up,
                },
            )
        set_up = self._set_up(costs, iterators, plans, traces, compiles)
        # Signed: staged steps slower than the whole model's lose time.
        saving = costs.saving(batches)
        starts = unstaged_epochs * (costs.epoch_start_seconds or 0.0)
        # What the call costs staged and unstaged beyond the staged steps.
        kind = compare(set_up, saving + owed + starts)
        gain = saving + owed + starts - set_up
        figures = {
            "batches": batches,
            "epochs": unstaged_epochs,
            "set_up": set_up,
            "saving": saving,
            "owed": owed,
            "starts": starts,
            "gain": gain,
        }
        if kind is Kind.PAYS:
            # Over an unstaged call, which would start its epochs too.
            figures["rent"] = max(set_up - saving - starts, 0.0)
        return Decision(kind, figures)


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


def costs(model):
    """The `CallCosts` of `model`'s stage, shared with models like it."""
    state = model_state(model)
    record = learned(model)
    if record.costs is None:
        record.costs = shared_costs(stage_signature(model, state.smart_stage))
    return record.costs


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


def stages(model, layer, phase, batches, iterators=1, x=None):
    """Whether a call of `phase` reading `batches` batches is staged.

    See `CallCosts.stages`; `batches` is None when not from in-memory
    data (`call_batches`). Why, in a sentence, is kept in the model's
    `call_decisions[phase]` for the verdict (`x`, the call's data, tells a
    dataset of unknown length from one that maps or reads files).
    """
    decision = _decide(model, layer, phase, batches, iterators, x)
    _keep(model, phase, decision)
    return decision.staged


def _keep(model, phase, decision):
    """Keeps and logs the `Decision` taken on a call of `phase`."""
    learned(model).decisions[phase] = decision
    if decision.first_call:
        # Once: a loop of short calls stages its next one and measures it.
        costs(model).phase(phase).first_call_skipped = True
    if decision.staged:
        _pay_rent(model, phase, decision.rent)
        if decision.kind is Kind.UNMEASURED:
            # A fit's training and validation plan once between them.
            plans = _first_costs(model, phase)[0]
            unmeasured = learned(model).unmeasured_rent
            unmeasured[phase] = plans and not any(unmeasured.values())
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


def trace_owed(model, phase, measured):
    """What running `phase` unstaged would add by tracing the whole step.

    Nothing once the model traced it (an unstaged call or epoch ran it);
    else about what that trace costs (`CallCosts.whole_trace`), less what
    the model's staged calls of the phase have paid over such a step so
    far (`Learned.rent`): once they have paid as much as the
    trace costs, it is paid whenever the whole step is faster.
    """
    if not traces_whole_step(model, phase):
        return 0.0
    paid = learned(model).rent.get(phase, 0.0)
    return max(measured.whole_trace(phase) - paid, 0.0)


def _decide(model, layer, phase, batches, iterators, x, unstaged_epochs=0):
    if not may_skip_stage(layer):
        return Decision(Kind.BY_REQUEST)
    if batches is None:
        # Never skipped (and the signature is not computed).
        return Decision(Kind.UNBOUNDED, _unbounded_figures(x))
    state = model_state(model)
    if state.smart_stage and state.requested_jit is True:
        return Decision(Kind.JIT_COMPILE)
    if _random_prefix(model, phase):
        return Decision(Kind.RANDOM_PREFIX)
    measured = costs(model)
    return measured.decide(
        phase,
        batches,
        iterators,
        *_first_costs(model, phase),
        trace_owed(model, phase, measured),
        not _has_staged_step(model, phase),
        unstaged_epochs=unstaged_epochs,
    )


def _has_staged_step(model, phase):
    """Whether `model` keeps a compiled staged step of `phase`."""
    return any(
        key[0] == phase and key[1] != UNSTAGED_STEPS and function is not None
        for key, function in model_state(model).staged_functions.items()
    )


def _unbounded_figures(x):
    """What makes a call on `x`, not in-memory data, keep its stage."""
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


def staged_data(model, phase, layer, role, *args, **kwargs):
    """`stage_data(layer, phase, *args, role=role, **kwargs)`, its costs
    noted for `phase` (in the `StageCosts` the `StagedData` holds)."""
    measured = costs(model)
    split = kwargs.get("split")
    traced = 0.0 if split is None else split.trace_seconds
    record = StageCosts(
        phase,
        on_iterator=functools.partial(measured.note_iterator, phase),
        # The host times the steps (`note_steps`) of a SmartStage call:
        # what a staged step costs beside the whole model's.
        step_clock=[] if split is not None and phase in TIMED_PHASES else None,
    )
    started = time.perf_counter()
    data = stage_data(layer, phase, *args, role=role, costs=record, **kwargs)
    seconds = time.perf_counter() - started
    if split is not None and split.trace_seconds > traced:
        # Tracing the staged layers is paid once per model, not per call:
        # noted apart, for the first calls of models like this one.
        measured.note_trace(phase, split.trace_seconds - traced)
        seconds -= split.trace_seconds - traced
    measured.note_build(phase, seconds)
    # This call's own set-up, for its rent if it was decided unmeasured.
    record.set_up_seconds += seconds
    return data


def iterator_cost(model, phase):
    """The measured seconds of a new iterator of a `phase` stage, or None.

    What a resized pool costs the call (the `PrefetchCallback` weighs it
    before it shrinks the pool).
    """
    measured = learned(model).costs
    if measured is None or phase is None:
        return None
    return measured.phase(phase).iterator_seconds


def resize_cost(model, data):
    """What resizing `data`'s pool before the next epoch costs, or None.

    The measured seconds of a new iterator of its stage where the next
    epoch would read on from the one it has; nothing where it makes one
    anyway (see `CallIterators.resize_makes_an_iterator`); None if not
    measured.
    """
    if not data.iterators.resize_makes_an_iterator():
        return 0.0
    return iterator_cost(model, data.cost_phase)


def note_work(model, data, switch=None):
    """Notes the staged work `data`'s stage did in the call ending.

    `switch`: the call's `EpochSwitch` of `data`'s epochs, or None.
    """
    if data.staged.stats.closed:
        return
    snapshot = data.staged.stats.snapshot()
    busy, produced = data.work_before
    busy = snapshot["busy_seconds"] - busy
    produced = snapshot["produced"] - produced
    measured = costs(model)
    note_traces(model)
    measured.note_work(
        data.cost_phase, busy, produced, has_work=data.split is not None
    )
    _note_unmeasured_rent(model, data, busy, produced)
    if switch is not None and switch.step_seconds is not None:
        # Its trial epoch ran the whole model's steps: the call's clock
        # holds both kinds, the switch's epochs tell them apart.
        measured.note_step_pair(data.cost_phase, *switch.step_seconds)
    elif data.step_clock is not None:
        measured.note_steps(data.cost_phase, data.step_clock, staged=True)


def _note_unmeasured_rent(model, data, busy, produced):
    """Adds what a call staged before anything was measured paid for its
    stage to its phase's rent (`trace_owed`).

    Decided unmeasured, it paid no rent then; what its stage cost over an
    unstaged call (its build and iterators, its model's plan if it made
    it, less the staged work of every batch but the first) is known now.
    Its traces are not counted: an unstaged first call traces too.
    """
    planned = learned(model).unmeasured_rent.pop(data.cost_phase, None)
    if planned is None:
        return
    rent = data.set_up_seconds
    if planned:
        rent += costs(model).plan_seconds
    if data.split is not None and produced > 0 and busy == busy:
        # Not timed (NaN) under op determinism: nothing known to subtract.
        rent -= busy * max(produced - 1, 0) / produced
    _pay_rent(model, data.cost_phase, max(rent, 0.0))


def _pay_rent(model, phase, seconds):
    """Adds `seconds` to what `model`'s staged `phase` calls paid toward
    tracing its whole step (`trace_owed`)."""
    rent = learned(model).rent
    rent[phase] = rent.get(phase, 0.0) + seconds


def timed_unstaged_phases(model, phases):
    """The phases of an unstaged call whose steps the host should time.

    Those of `TIMED_PHASES` whose staged calls timed their steps and
    whose unstaged step is not known yet (see `PhaseCosts.trial_due`),
    and those whose whole-model step the call traces (`traces_whole_step`):
    a call that pays that trace also tells what the whole step costs.
    """
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


def traces_whole_step(model, phase):
    """Whether an unstaged `phase` call of `model` would trace its step."""
    return (phase, UNSTAGED_STEPS) not in model_state(model).staged_functions


class EpochStartClock(keras.callbacks.Callback):
    """Times how long each epoch of an unstaged fit takes to start and end.

    From the epoch's begin to its first step's (Keras making the epoch's
    iterator of the data), and from its last step's end to its validation
    or its end (Keras letting that iterator go): what an epoch costs
    beyond its steps, which a stage whose epochs share one iterator pays
    once (`PhaseCosts.epoch_start_seconds`). Given to a fit that runs
    unstaged (`StagedCall.run_unstaged`), after the user's callbacks;
    `seconds` holds one figure per epoch, once it ended.
    """

    def __init__(self):
        super().__init__()
        self.seconds = []
        self._begun = None
        self._started = None  # this epoch's start, once its first step came
        self._stepped = None  # when this epoch's last step so far ended

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
        # The fit's validation: not the training epoch's own end.
        self._end()

    def on_epoch_end(self, epoch, logs=None):
        self._end()

    def _end(self):
        if self._started is not None and self._stepped is not None:
            ending = time.perf_counter() - self._stepped
            self.seconds.append(self._started + ending)
        self._started = self._stepped = None


def note_epoch_starts(model, seconds):
    """Notes the epochs' starts and ends an `EpochStartClock` timed.

    Their lower median: now and then an epoch's start takes several times
    the others' (the previous epoch's iterator let go, a collection), and
    a fit of two epochs would otherwise note the mean of one such and one
    usual start. Left out, those make the figure low, never high: a call
    is not staged on one slow moment of the machine.
    """
    if seconds:
        costs(model).phase("train").note(
            epoch_start=statistics.median_low(seconds)
        )


def note_unstaged_steps(model, clocks):
    """Notes the host-timed steps of an unstaged call, per phase."""
    for phase, seconds in clocks.items():
        costs(model).note_steps(phase, seconds, staged=False)
    note_traces(model)


def note_traces(model):
    """Notes how long the steps traced since the last call took to trace.

    The whole model's (an unstaged call, an unstaged epoch) and the
    trunk's (a staged call), from `Learned.traces`.
    """
    record = learned(model)
    traces, record.traces = record.traces, []
    if not traces:
        return
    measured = costs(model)
    for phase, kind, seconds in traces:
        measured.phase(phase).note(**{kind: seconds})


def iterators_made(model, role, x, default=1):
    """The iterators of its stage a call of `role` on `x` makes.

    None (0) when it reads on from the one an earlier call left (see
    `kept_iterators.carries`); else `default`.
    """
    return 0 if carries(model_state(model).stages, role, x) else default


def _iterators(model, layer, role, x, batches, epochs, steps, long_lived):
    """The iterators a fit's phase makes: one if its epochs share one.

    See `staged_data.stage_data(epochs=...)`; `batches` is all the epochs'.
    `role`: the stage's ("train" or "val"); `x`: the data it reads.
    """
    if not long_lived or not batches or not epochs:
        return epochs
    if not iterators_made(model, role, x):
        return 0
    phase = "train" if role == "train" else "test"
    refusal = epochs_refusal(
        layer,
        phase,
        batches // epochs,
        steps,
        epochs,
        model.steps_per_execution,
        served=False,  # `may_skip_stage`: no service
    )
    if refusal is None and not strategy_refusal(model.distribute_strategy, x):
        return 1
    return epochs


def fit_stages(model, layer, x, validation_data, long_lived=True, **kwargs):
    """Whether a fit is staged: its training or its validation can pay.

    A staged fit stages both, so where its training alone would not pay
    by the measured costs, its validation stages it only if what staging
    gains the validation outweighs what it loses the training; a training
    that runs unstaged to time the whole model's steps (the trial) runs
    so whatever its validation. `long_lived`: whether the fit may run its
    epochs on one iterator.
    """
    (train, epochs), (val, runs) = fit_batches(x, validation_data, **kwargs)
    training = _decide(
        model,
        layer,
        "train",
        train,
        _iterators(
            model,
            layer,
            "train",
            x,
            train,
            epochs,
            kwargs["steps_per_epoch"],
            long_lived,
        ),
        x,
        unstaged_epochs=epochs,
    )
    if training.staged or validation_data is None or training.trial:
        _keep(model, "train", training)
        return training.staged
    val_x = keras.utils.unpack_x_y_sample_weight(validation_data)[0]
    validation = _decide(
        model,
        layer,
        "test",
        val,
        _iterators(
            model,
            layer,
            "val",
            val_x,
            val,
            runs,
            kwargs["validation_steps"],
            long_lived,
        ),
        val_x,
    )
    if (
        validation.staged
        and training.gain is not None
        and (validation.gain is not None or val is not None)
        and training.gain + (validation.gain or 0.0) <= 0
    ):
        # Measured: staging the training loses more than the validation
        # gains (a validation in memory not measured yet gains nothing
        # known).
        validation = Decision(
            Kind.TRAINING_LOSES,
            {"training": training, "validation": validation},
        )
    _keep(model, "test", validation)
    if validation.staged:
        training = Decision(
            Kind.VALIDATION_PAYS,
            {"training": training, "validation": validation},
        )
    _keep(model, "train", training)
    return training.staged
