"""The record schema, its summaries, tables and result files.

A raw row (`runner`) is `benchmark, workload, mode, round, metric, value`
and, for a keras_stage mode, `staged_calls` of its trial's `calls` and `why`
(the kinds logged for those unstaged). `summarize` makes one summary per
workload and metric: each mode's median, its paired ratio to the reference
(the median over rounds of the ratio within a round), the control's (a
second run of the reference: the noise of a ratio) and the staged calls.
Summaries go to `benchmarks/results/<benchmark>[-<name>].json` (in git), raw
rows to `benchmarks/results/raw/` (not in git).
"""

import json
import os
import platform
import re
import statistics
import subprocess
import time

from benchmarks.runner import ROOT

RESULTS = os.path.join(ROOT, "benchmarks", "results")


# A call's tear-down after its last callback is most often 1 ms and
# sometimes a second (docs/benchmarks.md): its summary keeps mean and max.
SPREAD = ("teardown",)


def shown(summaries, metrics=None):
    """The summaries a table shows: those of `metrics`; by default all but
    `teardown`, and `seconds` where `to_end` (to the last callback) is."""
    if metrics:
        return [s for s in summaries if s["metric"] in metrics]
    timed = {s["workload"] for s in summaries if s["metric"] == "to_end"}
    hidden = lambda s: s["metric"] == "seconds" and s["workload"] in timed  # noqa: E731
    return [s for s in summaries if s["metric"] != "teardown" and not hidden(s)]


def summarize(rows, reference, control):
    """One summary per `(workload, metric)` of `rows`, in their order."""
    groups = {}
    for row in rows:
        key = (row["workload"], row["metric"])
        groups.setdefault(key, {}).setdefault(row["mode"], []).append(row)
    out = []
    for (workload, metric), by_mode in groups.items():
        medians = {
            mode: statistics.median(r["value"] for r in got)
            for mode, got in by_mode.items()
        }
        each = _paired(by_mode, reference, each=True)
        ratio = {mode: statistics.median(got) for mode, got in each.items()}
        summary = {
            "workload": workload,
            "metric": metric,
            "rounds": max(len(got) for got in by_mode.values()),
            "median": medians,
            "ratio": ratio,
            "control": ratio.get(control),
            # The middle half of the control's ratios: the noise of a ratio.
            "control_range": _quartiles(each.get(control)),
            "staged": {},
            "why": {},
        }
        if metric in SPREAD:
            values = {
                m: [r["value"] for r in got] for m, got in by_mode.items()
            }
            summary["mean"] = {
                m: statistics.fmean(v) for m, v in values.items()
            }
            summary["max"] = {m: max(v) for m, v in values.items()}
        if "expert" in by_mode and reference != "expert":
            summary["to_expert"] = _paired(by_mode, "expert")
        for mode, got in by_mode.items():
            if got[0]["calls"] is not None:
                summary["staged"][mode] = [
                    sum(r["staged_calls"] for r in got),
                    sum(r["calls"] for r in got),
                ]
                reasons = sorted({w for r in got for w in r["why"]})
                if reasons:
                    summary["why"][mode] = reasons
        out.append(summary)
    return out


def _paired(by_mode, reference, each=False):
    """`{mode: median over rounds of mode / reference in the round}`; with
    `each`, `{mode: [the ratio in each round]}`."""
    base = {r["round"]: r["value"] for r in by_mode.get(reference, ())}
    out = {}
    for mode, got in by_mode.items():
        pairs = [
            r["value"] / base[r["round"]] for r in got if base.get(r["round"])
        ]
        if mode != reference and pairs:
            out[mode] = pairs if each else statistics.median(pairs)
    return out


def _quartiles(values):
    """`[first, third]` quartile of `values` (None for fewer than 2)."""
    if len(values or ()) > 1:
        return statistics.quantiles(values, n=4, method="inclusive")[::2]


def within_noise(summary, mode, bound=1.0, sign=1):
    """Whether `mode`'s ratio is at most `bound` plus the control's
    distance from 1 (two equal modes differ by that much); `sign=-1`:
    at least `bound` less that distance."""
    ratio = summary["ratio"].get(mode)
    if ratio is None:
        return None
    control = [summary["control"]] + (summary.get("control_range") or [])
    distance = max(abs(c - 1) for c in control if c is not None)
    return sign * ratio <= sign * bound + distance


def ran_staged(summary, mode):
    """`"7/7"`: of a staged mode's calls, how many ran staged ("" for
    a mode keras_stage does not decide)."""
    got = summary["staged"].get(mode)
    if got is None:
        return ""
    # Off TensorFlow every call is staged: nothing is decided or logged.
    return "every call" if got[1] == 0 else f"{got[0]}/{got[1]}"


def table(summaries, reference, control, metrics=None):
    """A markdown table: per workload (and metric, if several), the
    reference's median, each other mode's paired ratio, the control and the
    staged calls (named by mode where several modes are staged)."""
    rows = [s for s in shown(summaries, metrics) if s["ratio"]]  # no pool size
    modes = dict.fromkeys(m for s in rows for m in s["ratio"] if m != control)
    staged = dict.fromkeys(m for s in rows for m in s["staged"])
    one = len({s["metric"] for s in rows}) == 1  # then named in the head
    head = ["workload"] + ([f"{reference} {rows[0]['metric']}"] if one else [])
    head += [] if one else ["metric", reference]
    head += [f"{m}/{reference}" for m in modes]
    head += [f"control ({control})", "ran staged"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for s in rows:
        ran = ", ".join(
            f"{m} {ran_staged(s, m)}" if len(staged) > 1 else ran_staged(s, m)
            for m in s["staged"]
            if ran_staged(s, m)
        )
        cells = [s["workload"]] + ([] if one else [s["metric"]])
        cells += [_fmt(s["median"].get(reference), 3)]
        cells += [_fmt(s["ratio"].get(m)) for m in modes]
        lines.append("| " + " | ".join(cells + [_control(s), ran]) + " |")
    return "\n".join(lines)


def _control(summary):
    """The control's ratio and, in brackets, the middle half of its rounds'."""
    low_high = summary.get("control_range")
    spread = " ({:.2f}-{:.2f})".format(*low_high) if low_high else ""
    return _fmt(summary["control"]) + spread


def _fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


# A table in README.md or docs/*.md, rendered from its result file.
BLOCK = re.compile(
    r"(<!-- table: (benchmarks/results/[\w.-]+\.json)(?: ([\w,]+))? -->\n)"
    r".*?(<!-- end of table -->)",
    re.S,
)


def render(text, root=ROOT):
    """`text` with each table block rewritten from the file it names.

    A block is `<!-- table: FILE [speed|METRICS] -->` ... `<!-- end of
    table -->`; `speed` renders the README's speed table, else `table` (of
    the comma-separated METRICS only, when given).
    """

    def rendered(match):
        with open(os.path.join(root, match[2])) as f:
            result = json.load(f)
        if match[3] == "speed":
            return f"{match[1]}\n{speed_table(result)}\n{match[4]}"
        keys = ("summaries", "reference", "control")
        metrics = match[3] and match[3].split(",")
        body = table(*(result[k] for k in keys), metrics=metrics)
        return f"{match[1]}\n{body}\n\n{match[4]}"

    return BLOCK.sub(rendered, text)


def environment():
    """Versions, CPUs, load and the checkout: what makes runs comparable."""
    import keras  # imported by every scenario anyway

    versions = {"python": platform.python_version(), "keras": keras.__version__}
    for module in ("tensorflow", "jax", "torch", "keras_stage"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            pass
    return {
        **versions,
        "backend": keras.backend.backend(),
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "commit": _git("rev-parse", "--short", "HEAD"),
        # keras_stage edited but not committed: the commit alone is not it.
        "dirty": bool(_git("status", "--porcelain", "--", "keras_stage")),
    }


def _git(*args):
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def write(benchmark, name, command, rows, summaries, extra=None):
    """Writes the summary file and the raw rows; returns the summary's path."""
    stem = benchmark if not name else f"{benchmark}-{name}"
    stamp = time.strftime("%Y-%m-%d %H:%M")
    result = dict(benchmark=benchmark, name=name or "", command=command)
    result = {**result, "date": stamp, "environment": environment()}
    result = {**result, **(extra or {}), "summaries": summaries}
    path = os.path.join(RESULTS, f"{stem}.json")
    raw = os.path.join(RESULTS, "raw", f"{stem}-{stamp.replace(' ', '-')}.json")
    os.makedirs(os.path.dirname(raw), exist_ok=True)
    with open(path, "w") as f:  # a summary a line: short, diffs readable
        head = json.dumps({**result, "summaries": []}, indent=1)[:-4]
        body = ",\n  ".join(json.dumps(s) for s in summaries)
        f.write(f"{head}[\n  {body}\n ]\n}}\n")
    with open(raw, "w") as f:
        json.dump({**result, "rows": rows}, f)
    return path


# The README's speed table: what each workload's input costs per batch.
INPUT_WORK = {
    "remote": "20 ms remote read, then CSV parsing",
    "seed": "CSV parsing and hashing (DeepRec's example)",
    "none": "nothing to stage",
    "criteo": "TSV parsing and hashing, DLRM-like model",
    "images": "JPEG decoding and augmentation, small CNN",
}


# What decided a call that ran unstaged (keras_stage's log), for the notes.
UNSTAGED = {
    "trial": "a trial that times the whole model's steps once",
    "does_not_pay": "measured: the stage saves less than its set-up costs",
    "first_call": "a first call too short to repay a stage",
    "one_batch": "a call of one batch",
    "training_loses": "measured: its training loses more than staging saves",
}


def speed_table(result):
    """The README's speed table and its notes, from a `bench` summary file.

    Time ratios are paired, to plain Keras (below 1 is faster). A row whose
    staged calls ran unstaged says why, and how much of plain's time the
    input took (plain against the trunk alone): what a stage could overlap.
    """
    lines = [
        "| Workload | Input work per batch | Time vs plain Keras "
        "| Control (plain again) | Time vs hand-tuned tf.data | Calls staged |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    notes = []
    summaries = result["summaries"]
    for s in summaries:  # to each call's last callback; its tear-down: a note
        if s["metric"] != "to_end":
            continue
        name, ratio = s["workload"], s["ratio"]
        ran, calls = s["staged"]["staged"]
        reading = f"{ratio['staged']:.2f}"
        if within_noise(s, "staged") and within_noise(s, "staged", 1.0, -1):
            reading += " (plain's cost: within the control)"
        mark = ""
        if ran < calls:
            mark = f" [{len(notes) + 1}]"
            why = [UNSTAGED.get(k, k) for k in s["why"].get("staged", [])]
            notes.append(
                f"{mark[1:]} `{name}`: {calls - ran} of {calls} calls ran "
                f"unstaged ({'; '.join(why)}). The trunk alone on batches in "
                f"memory took {ratio['compute_bound']:.2f} of plain's time "
                f"(input to overlap: at most "
                f"{max(0, 1 - ratio['compute_bound']):.0%}); the hand-tuned "
                f"pipeline {ratio['expert']:.2f}."
            )
        lines.append(
            f"| `{name}` | {INPUT_WORK.get(name, '')} | {reading}{mark} "
            f"| {_control(s)} | {s['to_expert']['staged']:.2f} "
            f"| {ran} of {calls} |"
        )
    teardown = [s for s in summaries if s["metric"] == "teardown"]
    worst = {m: max(s["max"][m] for s in teardown) for m in ("plain", "staged")}
    notes.append(
        "Not in the ratios: the tear-down after each fit's last callback, up "
        f"to {worst['plain']:.2f} s in plain Keras's fits and "
        f"{worst['staged']:.2f} s in the staged model's. It is tf.data's "
        "tear-down of the iterator Keras makes per fit: a call that runs its "
        "stage keeps its iterator, one that runs unstaged pays it too."
    )
    return "\n".join(lines + [""] + notes) + "\n"
