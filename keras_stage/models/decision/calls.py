"""The staging policy: whether a call runs staged, from its facts and costs.

`decide(facts)` weighs a call's facts (`call/facts.py`) and the costs
measured on models of its stage (`CallCosts`, shared by stage signature).
docs/design.md ("How a call is decided") has the rules.
"""

import collections
import dataclasses
import enum
import statistics

# The fewest warm steps (after a call's first) whose median is noted.
MIN_TIMED_STEPS = 4
# The most of a call's staged step time the trial's trace may cost.
TRACE_SHARE = 0.1
# The staged calls of a phase after which its trial runs whatever its
# trace costs: calls that repeat repay it.
LOOP_CALLS = 3
# The most of a staged step that staged work may be and the trial still
# run at once: a stage saves at most its work, and on few cores its
# threads may slow the trunk by more, so the trial finds out early.
WORK_SHARE = 0.1
# The most in-memory batches a first call (nothing measured yet) may read
# and still run unstaged: fewer do not repay a stage's set-up.
FIRST_CALL_BATCHES = 32


class Kind(enum.Enum):
    """What decided a call; its value is the name the log gives it."""

    BY_REQUEST = "by_request"  # adaptive=False, a policy, the service
    JIT_COMPILE = "jit_compile"
    RANDOM_PREFIX = "random_prefix"
    UNBOUNDED = "unbounded"  # data the stage overlaps, or of unknown length
    ONE_BATCH = "one_batch"
    FIRST_CALL = "first_call"
    UNMEASURED = "unmeasured"
    TRIAL = "trial"
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
            "the stage overlaps: the call keeps its stage"
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
    return " and ".join(why) + ": the call keeps its stage"


def _weighed(f):
    """The figures a measured call compared, signed."""

    def ms(key):
        return f"{1000 * f[key]:+.1f} ms"

    epochs = "epoch" if f["epochs"] == 1 else f"{f['epochs']} epochs"
    starts = f", {ms('starts')} of Keras starting its {epochs}"
    return (
        f"staging {f['batches']} batches saves {ms('saving')} of steps"
        f"{starts if f['starts'] else ''} and {ms('owed')} of tracing the "
        f"whole model's step, and costs {_ms(f['set_up'])} of set-up: "
        f"{ms('gain')} in all"
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
    Kind.UNMEASURED: lambda f: (
        "what staging saves is not measured yet on a model with its stage"
    ),
    Kind.TRIAL: lambda f: (
        "it times the whole model's steps once, against the staged steps"
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


@dataclasses.dataclass(frozen=True)
class Decision:
    """How a call runs: a `Kind` and the figures (seconds) it weighed.

    Figures, where the kind weighed them: `batches`, `epochs`, `set_up`,
    `saving`, `owed`, `starts` and `gain` (`saving + owed + starts -
    set_up`), as `CallCosts.decide` weighs them (docs/design.md).
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
    def reason(self):
        """Why, in a sentence (`MESSAGES`)."""
        return MESSAGES[self.kind](self.figures)


class _Median:
    """A `PhaseCosts` figure: the median of its samples noted under `key`,
    else `default` (a value, or another `_Median` to fall back on)."""

    def __init__(self, key, default=None):
        self.key = key
        self.default = default

    def __get__(self, costs, owner=None):
        samples = costs._samples[self.key]
        if samples:
            return statistics.median(samples)
        if isinstance(self.default, _Median):
            return self.default.__get__(costs)
        return self.default


class PhaseCosts:
    """What staging one phase (train, test, predict) costs on a model.

    Set-up and trace costs are the medians of the last `SAMPLES` noted:
    one busy moment of the machine does not flip the decisions after it.
    """

    SAMPLES = 5
    # Seconds to build a stage and to make one iterator of it.
    build_seconds = _Median("build")
    iterator_seconds = _Median("iterator")
    # Keras starting and ending an unstaged fit's epoch: it makes each
    # epoch's iterator, a long-lived stage one in all.
    epoch_start_seconds = _Median("epoch_start")
    # The first call of the whole model's step (trace, graph set-up, one
    # step), and the trunk's step's Python while traced.
    unstaged_trace_seconds = _Median("whole_trace")
    step_trace_seconds = _Median("step_trace", 0.0)
    # The first call of the trunk's step, or its Python's trace.
    step_call_seconds = _Median("step_call", step_trace_seconds)

    def __init__(self):
        self._samples = {
            figure.key: collections.deque(maxlen=self.SAMPLES)
            for figure in vars(PhaseCosts).values()
            if isinstance(figure, _Median)
        }
        # Staged work per batch (None: not measured, e.g. under op
        # determinism where tf.data's model cannot be read).
        self.batch_seconds = None
        # A model's first staged call's trace of its prefix.
        self.trace_seconds = 0.0
        # The median warm step of the last staged call and of the trial,
        # timed on the host.
        self.staged_step_seconds = None
        self.unstaged_step_seconds = None
        self.first_call_skipped = False  # see `FIRST_CALL_BATCHES`
        self.staged_calls = 0  # see `LOOP_CALLS`

    def note(self, **seconds):
        """Notes seconds under the `key`s of the `_Median` figures."""
        for key, value in seconds.items():
            self._samples[key].append(value)

    def batch_saving(self):
        """What staging saves per batch, signed, or None.

        The staged work per batch bounds it; once the trial timed both
        kinds of steps, so does the whole model's step less the staged
        one, below zero where the stage's threads slow the trunk.
        """
        staged, unstaged = self.staged_step_seconds, self.unstaged_step_seconds
        if staged is None or unstaged is None:
            return self.batch_seconds
        steps = unstaged - staged
        if self.batch_seconds is None:
            return steps
        return min(steps, self.batch_seconds)

    def measured(self):
        return (
            self.build_seconds is not None
            and self.iterator_seconds is not None
            and self.batch_saving() is not None
        )

    def trial_due(self):
        """Whether staged steps were timed and the whole model's not."""
        return (
            self.build_seconds is not None
            and self.iterator_seconds is not None
            and self.staged_step_seconds is not None
            and self.unstaged_step_seconds is None
        )

    def saves_little(self):
        """Whether the staged work per batch, measured, is at most
        `WORK_SHARE` of a staged step: all a stage could save."""
        return (
            self.batch_seconds is not None
            and self.batch_seconds <= WORK_SHARE * self.staged_step_seconds
        )

    def saving(self, batches):
        """What staging `batches` batches saves, signed, in seconds."""
        return max(batches - 1, 0) * self.batch_saving()

    def cost(self, iterators):
        """What a call making `iterators` iterators pays for its stage."""
        return self.build_seconds + iterators * self.iterator_seconds


class CallCosts:
    """The measured costs of a model's staged calls, per phase."""

    def __init__(self):
        self._phases = {}
        self.plan_seconds = 0.0  # a model's SmartStage plan, paid once

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
        """Notes a staged call's work per batch (`has_work`: whether the
        stage computes anything; arrays alone have nothing to overlap)."""
        costs = self.phase(phase)
        costs.staged_calls += 1
        if not has_work:
            costs.batch_seconds = 0.0
        elif produced > 0 and busy_seconds > 0:
            costs.batch_seconds = busy_seconds / produced

    def note_steps(self, phase, seconds, staged):
        """Notes the median warm step of a call's host-timed steps (the
        first left out: it makes the iterator and may trace)."""
        warm = list(seconds)[1:]
        if len(warm) < MIN_TIMED_STEPS:
            return
        if staged:
            self.phase(phase).staged_step_seconds = statistics.median(warm)
        else:
            self.phase(phase).unstaged_step_seconds = statistics.median(warm)

    def measured_like(self, phase):
        """`phase`'s costs; for a `predict` not measured yet, `test`'s when
        measured (the same stage, a step without the loss)."""
        costs = self.phase(phase)
        if phase == "predict" and not costs.measured():
            test = self.phase("test")
            if test.measured():
                return test
        return costs

    def whole_trace(self, phase):
        """About what tracing the whole model's `phase` step costs: as an
        unstaged call measured it, else the prefix's trace and the trunk's
        step's first call (which includes the graph set-up a trace omits)."""
        costs = self.measured_like(phase)
        if costs.unstaged_trace_seconds is not None:
            return costs.unstaged_trace_seconds
        prefix = max(
            (other.trace_seconds for other in self._phases.values()),
            default=0.0,
        )
        return prefix + costs.step_call_seconds

    def stages(self, *args, **kwargs):
        """Whether a call should be staged: `decide(...).staged`."""
        return self.decide(*args, **kwargs).staged

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
        """The `Decision` on a call of `phase`, by the measured costs.

        Args:
            batches: The batches it reads from in-memory data, or None.
            iterators: The iterators its stage makes.
            plans: Whether it would plan the model's SmartStage.
            traces: Whether it would trace its prefix for the phase.
            owed: The seconds of tracing the whole step running unstaged
                would add (`CallFacts.owed`).
            compiles: Whether it would trace the trunk's step.
            unstaged_epochs: The epochs Keras would start unstaged.
        """
        if batches is None:
            return Decision(Kind.UNBOUNDED, {"source": "pipeline"})
        if batches <= 1:
            return Decision(Kind.ONE_BATCH, {"batches": batches})
        own = self.phase(phase)
        trial = Decision(Kind.TRIAL, {"batches": batches, "owed": owed})
        if own.trial_due() and (
            owed <= TRACE_SHARE * (batches * own.staged_step_seconds)
            or own.staged_calls >= LOOP_CALLS
        ):
            return trial
        costs = self.measured_like(phase)
        if not costs.measured():
            if (
                (costs.build_seconds is None or costs.iterator_seconds is None)
                and batches <= FIRST_CALL_BATCHES
                and not own.first_call_skipped
            ):
                return Decision(Kind.FIRST_CALL, {"batches": batches})
            return Decision(Kind.UNMEASURED, {"batches": batches})
        set_up = costs.cost(iterators)
        set_up += self.plan_seconds if plans else 0.0
        set_up += costs.trace_seconds if traces else 0.0
        set_up += costs.step_call_seconds if compiles else 0.0
        saving = costs.saving(batches)
        starts = unstaged_epochs * (costs.epoch_start_seconds or 0.0)
        gain = saving + owed + starts - set_up
        if gain > 0 and own.trial_due() and own.saves_little():
            return trial  # staged for what it owes, it may lose its steps
        return Decision(
            Kind.PAYS if gain > 0 else Kind.DOES_NOT_PAY,
            {
                "batches": batches,
                "epochs": unstaged_epochs,
                "set_up": set_up,
                "saving": saving,
                "owed": owed,
                "starts": starts,
                "gain": gain,
            },
        )


# The costs per stage signature (`call.facts.stage_signature`), the least
# recently used dropped beyond the bound.
_SHARED = collections.OrderedDict()
_SHARED_BOUND = 64


def shared_costs(signature):
    """The `CallCosts` of every model with stage signature `signature`."""
    costs = _SHARED.pop(signature, None) or CallCosts()
    _SHARED[signature] = costs
    while len(_SHARED) > _SHARED_BOUND:
        _SHARED.popitem(last=False)
    return costs


def forget_shared_costs():
    """Forgets every measured cost (tests start from a clean process)."""
    _SHARED.clear()


def decide(facts):
    """The `Decision` on a call from its `call.facts.CallFacts`: the rules
    in order, each reading only the facts it needs, then `facts.costs`."""
    if not facts.skippable:
        return Decision(Kind.BY_REQUEST)
    if facts.batches is None:
        return Decision(Kind.UNBOUNDED, facts.unbounded)
    if facts.jit_compile:
        return Decision(Kind.JIT_COMPILE)
    if facts.random_prefix:
        return Decision(Kind.RANDOM_PREFIX)
    return facts.costs.decide(
        facts.phase,
        facts.batches,
        facts.iterators,
        facts.plans,
        facts.traces,
        facts.owed,
        facts.compiles,
        unstaged_epochs=facts.unstaged_epochs,
    )


def weighs_validation(training):
    """Whether a fit's validation may change its `training` decision: not
    when its training is staged, or due a trial (run whatever else)."""
    return not (training.staged or training.trial)


def weigh_fit(training, validation, in_memory):
    """A fit's `(training, validation)` decisions. A staged fit stages
    both: its validation stages it only if it gains more than the training
    loses; one `in_memory` not measured yet gains nothing known."""
    if (
        validation.staged
        and training.gain is not None
        and (validation.gain is not None or in_memory)
        and training.gain + (validation.gain or 0.0) <= 0
    ):
        validation = Decision(
            Kind.TRAINING_LOSES,
            {"training": training, "validation": validation},
        )
    if validation.staged:
        training = Decision(
            Kind.VALIDATION_PAYS,
            {"training": training, "validation": validation},
        )
    return training, validation
