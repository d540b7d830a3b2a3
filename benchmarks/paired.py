"""Modes side by side in one process, compared per repetition.

The comparison scripts (`thread_pool`, `remote_pipelines`,
`criteo_overlap`) answer one question each with a few modes of one
workload: every mode is built and warmed up (tracing), then the
repetitions run interleaved (A B C A B C), so a drift of the machine hits
every mode alike, and each mode's time is compared with a reference's
from the same round (a paired ratio), which cancels that drift where
medians of separate runs would not.
"""

import statistics


def run_interleaved(modes, reps, log=print):
    """Runs `reps` interleaved rounds of `modes` after one warm-up each.

    Args:
        modes: `{name: Mode}`, run in this order in every round.
        reps: Timed rounds.
        log: Called with a line after each round.

    Returns:
        `{name: [record of each round]}` (see `Mode.run`).
    """
    for mode in modes.values():
        mode.setup()
        mode.run()  # warm-up: tracing
    records = {name: [] for name in modes}
    for rep in range(reps):
        for name, mode in modes.items():
            records[name].append(mode.run())
        log(f"rep {rep + 1}/{reps} done")
    for mode in modes.values():
        mode.close()
    return records


def per_step(records, key="seconds"):
    """`record[key] / record["steps"]` of each record."""
    return [record[key] / record["steps"] for record in records]


def timed_rounds(modes, reps):
    """`run_interleaved` with its progress printed, timed per step.

    Returns:
        `(records, seconds, cpu)`: the records of `run_interleaved`, and
        per mode the seconds and CPU seconds per step of each round.
    """
    records = run_interleaved(
        modes, reps, log=lambda line: print(line, flush=True)
    )
    seconds = {name: per_step(records[name]) for name in modes}
    cpu = {name: per_step(records[name], "cpu_seconds") for name in modes}
    return records, seconds, cpu


def paired_ratio(values, reference):
    """Median over the rounds of `values[i] / reference[i]`."""
    return statistics.median(
        a / b for a, b in zip(values, reference, strict=True)
    )
