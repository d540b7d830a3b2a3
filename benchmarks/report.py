"""The outputs of a run: the JSON file, the printed table, the PNG chart.

The charts of the docs, drawn from a results file, are `benchmarks.plots`.

This module owns how results are presented; it computes nothing that is
not derived from the results dict of `benchmarks.harness.run_benchmark`,
except the informational target checks (`target_checks`), which compare
the staged modes with the project's goals on the 2-core reference machine
and are recorded next to the numbers, never used to size a workload.
"""

import json
import os
import textwrap

from benchmarks.modes import MODE_ORDER
from benchmarks.plots import COLORS

# The project's goals for `staged` on the 2-core reference machine
# (issue 4): (workload, ratio key, comparison, bound, wording).
TARGETS = (
    ("remote", "ratio_to_limit", "<=", 1.3, "within 1.3x of the limit"),
    ("remote", "speedup_vs_plain", ">=", 4.0, ">= 4x faster than plain"),
    ("remote", "ratio_to_expert", "<=", 1 / 1.5, ">= 1.5x faster than expert"),
    ("criteo", "speedup_vs_plain", ">=", 1.3, ">= 1.3x faster than plain"),
    ("criteo", "ratio_to_expert", "<=", 1.05, "no slower than expert"),
    ("images", "speedup_vs_plain", ">=", 1.3, ">= 1.3x faster than plain"),
    ("images", "ratio_to_expert", "<=", 1.05, "no slower than expert"),
    ("none", "ratio_to_plain", "<=", 1.03, "within 3% of plain"),
)


def target_checks(results):
    """The staged mode's numbers against the project's targets.

    Targets are judged on whole calls (the headline ratios, see
    `benchmarks.harness.add_ratios`): `met` judges the ratio of medians
    (`key`); `paired_value` is the same ratio paired by round
    (`paired_<key>`) and `paired_met` judges it. The same two figures of
    the steps alone (`steps_<key>`, `steps_paired_<key>`) are judged
    beside them (`steps_value`, `steps_met`, `steps_paired_value`,
    `steps_paired_met`).

    Returns:
        A list of dicts: `workload`, `mode`, `target`, `key`, `value`,
        `bound`, `met` (None when the value is missing), `paired_value`,
        `paired_met`, `steps_value`, `steps_met`, `steps_paired_value`,
        `steps_paired_met`, for the workloads present in `results`.
    """
    checks = []
    for workload, key, op, bound, wording in TARGETS:
        section = results["workloads"].get(workload)
        if section is None:
            continue
        staged = section["modes"].get("staged", {})
        check = {
            "workload": workload,
            "mode": "staged",
            "target": wording,
            "key": key,
            "bound": f"{op} {bound:.3g}",
        }
        for prefix in ("", "steps_"):
            value = staged.get(f"{prefix}{key}")
            paired = staged.get(f"{prefix}paired_{key}")
            check[f"{prefix}value"] = value
            check[f"{prefix}met"] = _meets(value, op, bound)
            check[f"{prefix}paired_value"] = paired
            check[f"{prefix}paired_met"] = _meets(paired, op, bound)
        checks.append(check)
    return checks


def _meets(value, op, bound):
    if value is None:
        return None
    return value <= bound if op == "<=" else value >= bound


def write_json(results, path):
    """Writes `results` (with its target checks) to `path` as JSON."""
    results = {**results, "targets": target_checks(results)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    return path


_STATUS = {True: "met", False: "NOT met", None: "n/a"}


def _num(value, fmt):
    return "-" if value is None else format(value, fmt)


def _notes(name, mode):
    if "error" in mode:
        return "FAILED: " + mode["error"].splitlines()[-1][:60]
    settings = mode.get("settings", {})
    notes = []
    if name == "staged-tuned" and "num_threads" in settings:
        notes.append(
            f"num_threads={settings['num_threads']}, "
            f"capacity={settings['capacity']}"
        )
    if name.startswith("staged") and mode.get("reps"):
        waits = sorted(
            r["stage_wait_ratio"]
            for r in mode["reps"]
            if r.get("stage_wait_ratio") is not None
        )
        if waits:
            notes.append(f"wait {waits[len(waits) // 2]:.2f}")
        unstaged = sum(1 for r in mode["reps"] if r.get("unstaged"))
        if unstaged:
            # Calls the package ran without their stage (decision/calls.py).
            notes.append(f"{unstaged} unstaged")
        pools = sorted(
            {
                r["verdict"].get("thread_pool_size")
                for r in mode["reps"]
                if r.get("verdict", {}).get("thread_pool_size") is not None
            }
        )
        if pools:
            # The adaptive pool of an "auto" stage: the sizes its timed
            # repetitions ran on.
            notes.append("pool " + "/".join(str(p) for p in pools))
    if mode.get("warnings"):
        notes.append(f"{len(mode['warnings'])} warning(s)")
    return "; ".join(notes)


def _row(mode_name, cells, notes):
    return f"  {mode_name:<14}" + "".join(cells) + f"  {notes}"


# The table's columns after the mode: (header, width).
_COLUMNS = (
    ("ms/call", 8),
    ("min-max", 12),
    ("x plain", 8),
    ("t/expert", 9),
    ("t/limit", 8),
    ("steps/s", 9),
    ("ms/step", 8),
    ("x plain", 8),
    ("t/expert", 9),
    ("t/limit", 8),
    ("cores", 6),
    ("out s", 6),
    ("gc s", 6),
)


def _cells(values):
    return [f"{v:>{w}}" for v, (_, w) in zip(values, _COLUMNS, strict=True)]


def _mode_cells(mode):
    """The table's cells of a mode that ran (see `_COLUMNS`)."""
    call = mode.get("call_seconds_per_step")
    sps = mode["steps_per_second"]
    outside = mode.get("outside_seconds", {}).get("median")
    return _cells(
        [
            _num(call and 1e3 * call["median"], ".2f"),
            "-"
            if call is None
            else f"{1e3 * call['min']:.2f}-{1e3 * call['max']:.2f}",
            _num(mode.get("speedup_vs_plain"), ".2f") + "x",
            _num(mode.get("ratio_to_expert"), ".2f"),
            _num(mode.get("ratio_to_limit"), ".2f"),
            f"{sps['median']:.1f}",
            f"{1e3 / sps['median']:.2f}",
            _num(mode.get("steps_speedup_vs_plain"), ".2f") + "x",
            _num(mode.get("steps_ratio_to_expert"), ".2f"),
            _num(mode.get("steps_ratio_to_limit"), ".2f"),
            _num(mode["cores"]["median"], ".2f"),
            _num(outside, ".2f"),
            _num(mode["cleanup_seconds"]["median"], ".2f"),
        ]
    )


def _limit_lines(limit):
    """The limit of the whole calls and of the steps, one line each."""
    lines = []
    kinds = (
        ("whole calls", "call_", "call_bound_by"),
        ("steps only", "", "bound_by"),
    )
    for label, infix, bound_by in kinds:
        if limit.get(f"{infix}seconds_per_step") is None:
            continue
        lines.append(
            f"  limit, {label}: "
            f"{1e3 * limit[f'{infix}seconds_per_step']:.2f} ms/step "
            f"({limit[bound_by]}): trunk alone "
            f"{1e3 * limit[f'compute_bound_{infix}seconds_per_step']:.2f}, "
            "preprocessing alone "
            f"{1e3 * limit[f'input_bound_{infix}seconds_per_step']:.2f}, "
            "one after the other "
            f"{1e3 * limit[f'sequential_{infix}seconds_per_step']:.2f}"
        )
    return lines


def format_table(results):
    """The results as text: one block per workload, one row per mode.

    The first columns are of whole calls (the headline), the next of the
    steps alone.
    """
    env = results["environment"]
    config = results["config"]
    lines = [
        f"keras_stage benchmarks '{results['name']}': TensorFlow "
        f"{env['tensorflow']}, Keras {env['keras']}, keras_stage "
        f"{env['keras_stage']}, Python {env['python']}; {env['usable_cpus']}"
        f" CPUs, {env['gpus']} GPUs; commit "
        f"{(env['git_commit'] or '?')[:10]}"
        f"{' (dirty)' if env['git_dirty'] else ''}",
        f"{config['reps']} timed reps per mode, interleaved, after a warm-up;"
        f" trunk={config['trunk']}; {results['wall_seconds']:.0f} s in all",
    ]
    groups = (
        f"  {'':<14}{'whole call (fit, set-up included), per step':<45}"
        f"{'steps only (first batch to last)':<42}"
    )
    header = _row("mode", [f"{h:>{w}}" for h, w in _COLUMNS], "notes")
    for name, section in results["workloads"].items():
        info = section["info"]
        load = section["load"]
        lines.append("")
        lines.append(
            f"{name}: batch {info['batch_size']}, {info['steps']} steps per "
            f"rep; load average {load['loadavg_before'][0]:.2f} -> "
            f"{load['loadavg_after'][0]:.2f}"
            + (
                f", steal {load['steal_fraction']:.1%}, other processes "
                f"{load['other_cpu_seconds']:.1f} CPU-s"
                if "steal_fraction" in load
                else ""
            )
        )
        lines.extend(
            textwrap.wrap(
                info["description"],
                width=79,
                initial_indent="  ",
                subsequent_indent="  ",
            )
        )
        if section["limit"] is not None:
            lines.extend(_limit_lines(section["limit"]))
        lines.append(groups.rstrip())
        lines.append(header.rstrip())
        for mode_name in MODE_ORDER:
            mode = section["modes"].get(mode_name)
            if mode is None:
                continue
            if mode.get("steps_per_second") is None:
                cells = _cells(["-"] * len(_COLUMNS))
            else:
                cells = _mode_cells(mode)
            lines.append(
                _row(mode_name, cells, _notes(mode_name, mode)).rstrip()
            )
    checks = target_checks(results)
    if checks:
        lines.append("")
        lines.append(
            "Targets for staged (informational, 2-core machine), judged on "
            "whole calls; the steps alone after 'steps':"
        )
        for check in checks:
            lines.append(
                f"  {check['workload']:<8}{check['target']:<30}"
                f"{check['key']} = {_num(check['value'], '.2f')} "
                f"({check['bound']}): {_STATUS[check['met']]}; paired "
                f"{_num(check.get('paired_value'), '.3f')}: "
                f"{_STATUS[check.get('paired_met')]}; steps "
                f"{_num(check.get('steps_value'), '.2f')}: "
                f"{_STATUS[check.get('steps_met')]}, paired "
                f"{_num(check.get('steps_paired_value'), '.3f')}: "
                f"{_STATUS[check.get('steps_paired_met')]}"
            )
    lines.append("")
    legend = (
        "Whole call: each repetition's fit call from its start to its "
        "return, set-up and tear-down included (input-bound: making the "
        "iterator, the pass, dropping it); ms/call is its median time per "
        "step, min-max its range. Steps only: from the first batch's "
        "beginning to the last one's end (input-bound: the first next() to "
        "the last); steps/s and ms/step are medians. x plain: speedup over "
        "plain (ratio of medians). t/expert, t/limit: time per step over "
        "expert's, over the limit's (the slower of compute-bound and "
        "input-bound, of the same kind); below 1 is faster. Targets: paired "
        "is the median over the rounds of the same ratio within each round "
        "(the modes run in turn every round). cores: CPU time of the process "
        "over wall time in the steps window (median). out s: seconds of "
        "each call outside the steps window (set-up and tear-down; median). "
        "gc s: seconds of the garbage collection run after each repetition, "
        "untimed (freeing the mode's pipelines; median)."
    )
    lines.extend(textwrap.wrap(legend, width=79))
    return "\n".join(lines)


def plot_chart(results, path):
    """Writes a PNG bar chart: speedup vs plain and time / limit per mode.

    Of whole calls (the headline ratios). Bars are the ratios of medians,
    whiskers the min-max over the repetitions.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"])
    modes = [
        m
        for m in MODE_ORDER
        if any(
            "call_seconds_per_step"
            in results["workloads"][w]["modes"].get(m, {})
            for w in workloads
        )
    ]
    fig, axes = plt.subplots(
        1, 2, figsize=(max(8, 2.2 * len(workloads) + 4), 4.5), squeeze=False
    )
    panels = (
        (
            axes[0][0],
            "whole calls: speedup vs plain (higher is faster)",
            _speedup,
        ),
        (
            axes[0][1],
            "whole calls: time / limit (1 = at the limit)",
            _to_limit,
        ),
    )
    width = 0.8 / max(len(modes), 1)
    for ax, title, values in panels:
        for i, mode in enumerate(modes):
            xs, heights, low, high = [], [], [], []
            for j, workload in enumerate(workloads):
                got = values(results["workloads"][workload], mode)
                if got is None:
                    continue
                median, lo, hi = got
                xs.append(j + (i - (len(modes) - 1) / 2) * width)
                heights.append(median)
                low.append(median - lo)
                high.append(hi - median)
            ax.bar(
                xs,
                heights,
                width,
                yerr=[low, high],
                capsize=2,
                label=mode,
                color=COLORS.get(mode),
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads)
        ax.set_title(title, fontsize=10)
    axes[0][0].legend(fontsize=8)
    env = results["environment"]
    fig.suptitle(
        f"keras_stage benchmarks '{results['name']}' (TF {env['tensorflow']},"
        f" Keras {env['keras']}, {env['usable_cpus']} CPUs; medians, "
        f"min-max of {results['config']['reps']} reps)",
        fontsize=10,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _call_times(section, name):
    """A mode's whole-call seconds per step {median, min, max}, or None."""
    return section["modes"].get(name, {}).get("call_seconds_per_step")


def _speedup(section, mode_name):
    times = _call_times(section, mode_name)
    plain = _call_times(section, "plain")
    if times is None or plain is None:
        return None
    plain = plain["median"]
    # The fastest repetition gives the highest speedup.
    return plain / times["median"], plain / times["max"], plain / times["min"]


def _to_limit(section, mode_name):
    times = _call_times(section, mode_name)
    limit = section["limit"]
    if times is None or limit is None or limit["call_seconds_per_step"] is None:
        return None
    limit = limit["call_seconds_per_step"]
    return times["median"] / limit, times["min"] / limit, times["max"] / limit
