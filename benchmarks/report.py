"""The outputs of a run: the JSON file, the printed table, the PNG chart.

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

_COLORS = {
    "plain": "#7f7f7f",
    "expert": "#1f77b4",
    "staged": "#d62728",
    "staged-tuned": "#ff9896",
    "compute-bound": "#2ca02c",
    "input-bound": "#9467bd",
}


def target_checks(results):
    """The staged mode's numbers against the project's targets.

    `met` judges the ratio of medians (`key`); `paired_value` is the
    same ratio paired by round (`paired_<key>`, see
    `benchmarks.harness.add_ratios`) and `paired_met` judges it.

    Returns:
        A list of dicts: `workload`, `mode`, `target`, `key`, `value`,
        `bound`, `met` (None when the value is missing), `paired_value`,
        `paired_met`, for the workloads present in `results`.
    """
    checks = []
    for workload, key, op, bound, wording in TARGETS:
        section = results["workloads"].get(workload)
        if section is None:
            continue
        staged = section["modes"].get("staged", {})
        value = staged.get(key)
        paired = staged.get(f"paired_{key}")
        checks.append(
            {
                "workload": workload,
                "mode": "staged",
                "target": wording,
                "key": key,
                "value": value,
                "bound": f"{op} {bound:.3g}",
                "met": _meets(value, op, bound),
                "paired_value": paired,
                "paired_met": _meets(paired, op, bound),
            }
        )
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
        waits = sorted(r["stage_wait_ratio"] for r in mode["reps"])
        notes.append(f"wait {waits[len(waits) // 2]:.2f}")
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


def format_table(results):
    """The results as text: one block per workload, one row per mode."""
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
    header = (
        f"  {'mode':<14}{'steps/s':>8}{'min-max':>14}{'ms/step':>8}"
        f"{'x plain':>8}{'t/expert':>9}{'t/limit':>8}{'cores':>6}"
        f"{'fit+s':>6}{'gc s':>6}  notes"
    )
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
        limit = section["limit"]
        if limit is not None:
            lines.append(
                f"  limit {1e3 * limit['seconds_per_step']:.2f} ms/step "
                f"({limit['bound_by']}): trunk alone "
                f"{1e3 * limit['compute_bound_seconds_per_step']:.2f}, "
                "preprocessing alone "
                f"{1e3 * limit['input_bound_seconds_per_step']:.2f}, "
                "one after the other "
                f"{1e3 * limit['sequential_seconds_per_step']:.2f} ms/step"
            )
        lines.append(header)
        for mode_name in MODE_ORDER:
            mode = section["modes"].get(mode_name)
            if mode is None:
                continue
            sps = mode.get("steps_per_second")
            if sps is None:
                lines.append(
                    f"  {mode_name:<14}{'-':>8}{'-':>14}{'-':>8}{'-':>8}"
                    f"{'-':>9}{'-':>8}{'-':>6}{'-':>6}{'-':>6}  "
                    f"{_notes(mode_name, mode)}"
                )
                continue
            spread = f"{sps['min']:.1f}-{sps['max']:.1f}"
            outside = mode.get("outside_seconds", {}).get("median")
            lines.append(
                f"  {mode_name:<14}{sps['median']:>8.1f}{spread:>14}"
                f"{1e3 / sps['median']:>8.2f}"
                f"{_num(mode['speedup_vs_plain'], '.2f'):>7}x"
                f"{_num(mode['ratio_to_expert'], '.2f'):>9}"
                f"{_num(mode['ratio_to_limit'], '.2f'):>8}"
                f"{_num(mode['cores']['median'], '.2f'):>6}"
                f"{_num(outside, '.2f'):>6}"
                f"{_num(mode['cleanup_seconds']['median'], '.2f'):>6}"
                f"  {_notes(mode_name, mode)}"
            )
    checks = target_checks(results)
    if checks:
        lines.append("")
        lines.append("Targets for staged (informational, 2-core machine):")
        for check in checks:
            status = _STATUS[check["met"]]
            paired = check.get("paired_value")
            lines.append(
                f"  {check['workload']:<8}{check['target']:<30}"
                f"{check['key']} = {_num(check['value'], '.2f')} "
                f"({check['bound']}): {status}; paired "
                f"{_num(paired, '.3f')}: {_STATUS[check.get('paired_met')]}"
            )
    lines.append("")
    legend = (
        "x plain: speedup over plain (ratio of median steps/s). t/expert, "
        "t/limit: time per step over expert's, over the limit's (the slower "
        "of compute-bound and input-bound); below 1 is faster. Targets: "
        "paired is the median over the rounds of the same ratio within each "
        "round (the modes run in turn every round). cores: CPU "
        "time of the process over wall time in the timed window (median). "
        "fit+s: seconds of each fit call outside the timed window (set-up "
        "and tear-down; median). gc s: seconds of the garbage collection "
        "run after each repetition, untimed (freeing the mode's pipelines; "
        "median)."
    )
    lines.extend(textwrap.wrap(legend, width=79))
    return "\n".join(lines)


def plot_chart(results, path):
    """Writes a PNG bar chart: speedup vs plain and time / limit per mode.

    Bars are medians, whiskers the min-max over the repetitions.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"])
    modes = [
        m
        for m in MODE_ORDER
        if any(
            "steps_per_second" in results["workloads"][w]["modes"].get(m, {})
            for w in workloads
        )
    ]
    fig, axes = plt.subplots(
        1, 2, figsize=(max(8, 2.2 * len(workloads) + 4), 4.5), squeeze=False
    )
    panels = (
        (axes[0][0], "speedup vs plain (higher is faster)", _speedup),
        (axes[0][1], "time per step / limit (1 = at the limit)", _to_limit),
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
                color=_COLORS.get(mode),
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


def _reference(section, name):
    mode = section["modes"].get(name, {})
    return mode.get("steps_per_second", {}).get("median")


def _speedup(section, mode_name):
    sps = section["modes"].get(mode_name, {}).get("steps_per_second")
    plain = _reference(section, "plain")
    if sps is None or plain is None:
        return None
    return sps["median"] / plain, sps["min"] / plain, sps["max"] / plain


def _to_limit(section, mode_name):
    sps = section["modes"].get(mode_name, {}).get("steps_per_second")
    if sps is None or section["limit"] is None:
        return None
    limit = section["limit"]["steps_per_second"]
    # Time ratios: the fastest repetition gives the lowest ratio.
    return limit / sps["median"], limit / sps["max"], limit / sps["min"]
