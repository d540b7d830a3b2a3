"""The one paired runner: modes side by side, their order rotated per round.

A `Scenario` says what one trial of a mode is (`setup` once, `trial` per
round). Every mode of every case runs `rounds` rounds, the order rotated by
one each round (A B C, B C A, C A B) so drift hits every mode alike, and each
trial is compared with the reference's of the same round (a paired ratio).
`Scenario.process` says where:

- `"same"`: this process; every mode set up, then warmed up (`warm` untimed
  trials: a traced model's first step is slow again after another model was
  traced), a `gc.collect()` untimed after each trial;
- `"round"`: each trial in a fresh process (nothing warm), also timed whole;
- `"case"`: each case in fresh processes (several, joined:
  `case_processes`), its modes side by side within.

A staged trial records which calls keras_stage staged (its INFO log lines).
"""

import contextlib
import functools
import gc
import json
import logging
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = "BENCHMARK-RECORDS "  # starts a child's line of results
_DECISION = re.compile(
    r"^Model '[^']*': (\w+) (is staged|runs the whole model in Keras's step,"
    r" unstaged) \[(\w+)\]: (.*)$",
    re.DOTALL,
)


class Scenario:
    """One benchmark family: its cases, modes and what a trial runs.

    Subclasses set the attributes and implement `cases`, `setup` and
    `trial`. `trial(state)` runs one round's work; the runner times it as
    `seconds`, and any metrics it returns (a dict) are recorded beside.
    Where its calls go through `Built.call`, it also records `teardown`,
    their seconds after their last callback, and `to_end`, `seconds` less
    that (docs/benchmarks.md, "What a call's time is").
    """

    name = ""
    modes = ("plain", "staged", "plain_again")
    reference = "plain"
    control = "plain_again"
    process = "same"
    warm = 1
    rounds = 7
    quick_rounds = 3
    timeout = 1800  # seconds a child process may take

    def arguments(self, parser):
        """Adds the scenario's own command-line options."""

    def cases(self, args):
        """The cases (workloads, regimes) a run covers, by name."""
        raise NotImplementedError

    def setup(self, case, mode, args):
        """Builds one mode of one case (untimed); returns its state."""
        raise NotImplementedError

    def trial(self, state):
        """One timed round of a mode; may return `{metric: value}`."""
        raise NotImplementedError

    def close(self, state):
        """Releases a mode's state."""

    def case_modes(self, case, args):
        """The modes `case` runs, by name (`--modes` unless narrowed)."""
        return args.modes

    def warmups(self, case):
        """Untimed trials per mode before the rounds of `case`."""
        return self.warm

    def case_processes(self, case, args):
        """`process = "case"`: the environments of its processes."""
        return [{}]


@contextlib.contextmanager
def decisions_logged():
    """keras_stage's decisions within: `[(phase, staged, kind, reason)]`."""
    decisions, records = [], []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record)  # parsed after the timed block

    logger = logging.getLogger("keras_stage")
    handler, level = Handler(logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield decisions
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        for record in records:
            match = _DECISION.match(record.getMessage())
            if match:
                phase, verb, kind, why = match.groups()
                decisions.append((phase, verb == "is staged", kind, why))


def timed(scenario, state, staged):
    """One trial: `{"metrics", "staged_calls", "calls", "why"}`."""
    from benchmarks.modes import TEARDOWN

    TEARDOWN.clear()
    with decisions_logged() as decisions:
        started = time.perf_counter()
        metrics = scenario.trial(state) or {}
        seconds = time.perf_counter() - started
    gc.collect()  # untimed, so no trial pays for another's garbage
    out = {"metrics": {"seconds": seconds, **metrics}}
    if TEARDOWN:  # its calls went through `Built.call`
        teardown = sum(TEARDOWN)
        out["metrics"].update(to_end=seconds - teardown, teardown=teardown)
    if staged:
        out.update(
            staged_calls=sum(d[1] for d in decisions),
            calls=len(decisions),
            # What decided each unstaged call (the log's kind).
            why=sorted({d[2] for d in decisions if not d[1]}),
        )
    return out


def rotated(items, round_index):
    """`items` rotated left by `round_index`."""
    shift = round_index % len(items)
    return list(items[shift:]) + list(items[:shift])


def _rows(benchmark, case, mode, index, trial):
    """A trial as the record schema's rows, one per metric."""
    head = dict(benchmark=benchmark, workload=case, mode=mode, round=index)
    calls = {key: trial.get(key) for key in ("staged_calls", "calls", "why")}
    return [
        {**head, "metric": metric, "value": value, **calls}
        for metric, value in trial["metrics"].items()
    ]


def run_same(scenario, case, args, rounds, log=print):
    """Every mode of `case` side by side in this process; the rows."""
    from benchmarks.modes import MODES

    modes = [MODES[name] for name in scenario.case_modes(case, args)]
    states = {mode.name: scenario.setup(case, mode, args) for mode in modes}
    try:
        for _ in range(scenario.warmups(case)):
            for mode in modes:
                scenario.trial(states[mode.name])
        gc.collect()
        rows = []
        for index in range(rounds):
            for mode in rotated(modes, index):
                trial = timed(scenario, states[mode.name], mode.staged)
                rows += _rows(scenario.name, case, mode.name, index, trial)
            log(f"{scenario.name} {case}: round {index + 1}/{rounds}")
        return rows
    finally:
        for state in states.values():
            scenario.close(state)


def run(scenario, args, log=print):
    """All rows of a run of `scenario` with the parsed `args`."""
    rounds = args.rounds or (
        scenario.quick_rounds if args.quick else scenario.rounds
    )
    rows = []
    for case in scenario.cases(args):
        if scenario.process == "same":
            rows += run_same(scenario, case, args, rounds, log)
        elif scenario.process == "case":
            rows += _case_in_processes(scenario, case, args, rounds, log)
        else:
            for index in range(rounds):  # process = "round"
                for mode in rotated(scenario.case_modes(case, args), index):
                    argv = [*args.argv, "--child", case, mode]
                    trial, seconds = _child(argv, {}, scenario.timeout)
                    trial["metrics"]["process"] = seconds
                    rows += _rows(scenario.name, case, mode, index, trial)
                log(f"{scenario.name} {case}: round {index + 1}/{rounds}")
    return rows


def _python(argv, env):
    """The arguments of a `python -m benchmarks ARGV` process."""
    command = [sys.executable, "-m", "benchmarks", *argv]
    return dict(args=command, cwd=ROOT, env={**os.environ, **env}, text=True)


def _child(argv, env, timeout):
    """Runs `python -m benchmarks ARGV`; its records and wall seconds."""
    started = time.perf_counter()
    done = subprocess.run(
        **_python(argv, env), capture_output=True, timeout=timeout
    )
    seconds = time.perf_counter() - started
    lines = [s for s in done.stdout.splitlines() if s.startswith(RECORDS)]
    if done.returncode or not lines:
        raise RuntimeError(
            f"`python -m benchmarks {' '.join(argv)}` failed "
            f"({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len(RECORDS) :]), seconds


def _case_in_processes(scenario, case, args, rounds, log):
    argv = [*args.argv, "--child", case, "", "--rounds", str(rounds)]
    envs = scenario.case_processes(case, args)
    pipe = subprocess.PIPE
    procs = [
        subprocess.Popen(**_python(argv, env), stdout=pipe, stderr=pipe)
        for env in envs[1:]
    ]
    try:
        rows, _ = _child(argv, envs[0], scenario.timeout)
    except BaseException:
        for proc in procs:  # else they wait for process 0 in a collective
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.communicate(timeout=scenario.timeout)  # drains their pipes
    log(f"{scenario.name} {case}: {rounds} rounds in {len(envs)} process(es)")
    return rows


def child(scenario, args, case, mode):
    """What a child process runs: prints its records' line."""
    if mode:  # process = "round": one trial of one mode, nothing warm
        from benchmarks.modes import MODES

        state = scenario.setup(case, MODES[mode], args)
        out = timed(scenario, state, MODES[mode].staged)
        scenario.close(state)
    else:  # process = "case": the modes side by side in this process
        log = functools.partial(print, file=sys.stderr, flush=True)
        out = run_same(scenario, case, args, args.rounds, log)
    print(RECORDS + json.dumps(out), flush=True)
