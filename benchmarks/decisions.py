"""What keras_stage decided for each call a benchmark made, from its log.

keras_stage logs one INFO line per call it decides (staged, or the whole
model in Keras's step, and why: `keras_stage.models.decision.calls`). The
same work should get the same decision every time: `benchmarks.first_calls`
compares the staged processes of a script, `benchmarks.regimes` the rounds
of a regime.

Example:

>>> import logging
>>> with decisions_logged() as decisions:
...     logging.getLogger("keras_stage").info(
...         "Model 'm': train is staged: nothing is measured yet.")
...     for _ in range(2):
...         logging.getLogger("keras_stage").info(
...             "Model 'm': train runs the whole model in Keras's step, "
...             "unstaged: it cannot repay its set-up.")
>>> compact(decisions)
'train staged, train unstaged x2'
>>> agree(["a", "a", "b"])
{'sequences': ['a', 'b'], 'counts': [2, 1], 'same': False}
"""

import contextlib
import logging
import re

# keras_stage's log line for each call it decides (`call.facts.stages`).
_DECISION = re.compile(
    r"^Model '[^']*': (\w+) (is staged|runs the whole model in Keras's step,"
    r" unstaged)(?: \[(\w+)\])?: (.*)$",
    re.DOTALL,
)


@contextlib.contextmanager
def decisions_logged():
    """The calls keras_stage decides within, in the list once it ends.

    As `{"phase", "staged", "kind", "why"}`, from the `keras_stage`
    logger's INFO line for each.
    """
    decisions = []
    # Read once the block ends: a call timed within pays for the record
    # alone, not for formatting and parsing it.
    records = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record)

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
                decisions.append(
                    {
                        "phase": phase,
                        "staged": verb == "is staged",
                        "kind": kind,
                        "why": why,
                    }
                )


def compact(decisions):
    """`decisions_logged`'s list as one line.

    "train staged, train unstaged x3": each call's phase and decision, in
    order, a run of equal ones counted.
    """
    calls = [
        f"{d['phase']} {'staged' if d['staged'] else 'unstaged'}"
        for d in decisions
    ]
    runs = []
    for call in calls:
        if runs and runs[-1][0] == call:
            runs[-1][1] += 1
        else:
            runs.append([call, 1])
    return ", ".join(
        call if count == 1 else f"{call} x{count}" for call, count in runs
    )


def agree(sequences):
    """Whether runs of the same work decided alike.

    Args:
        sequences: One entry per run (a process, a round): anything
            comparable with `==`, such as a `compact` line or a list of
            `[phase, staged]`.

    Returns:
        `{"sequences": [...], "counts": [n, ...], "same": bool}`: each
        distinct sequence, how many runs made it, and whether all made the
        same one.
    """
    distinct, counts = [], []
    for sequence in sequences:
        if sequence in distinct:
            counts[distinct.index(sequence)] += 1
        else:
            distinct.append(sequence)
            counts.append(1)
    return {"sequences": distinct, "counts": counts, "same": len(counts) <= 1}
