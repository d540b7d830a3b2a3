"""The charts of docs/benchmarks.md, drawn from one run's result file.

`python -m benchmarks.plots RESULT.json OUT.png` draws the chart of the
file's family:

- a `benchmarks.run` file (`make bench`, `make bench-quick`): time per
  step of every mode, one panel per workload (`plot_bench`);
- a `benchmarks.regimes` file: the paired ratio to plain of staged,
  expert and, in a `--control` run, the second plain model, per regime
  and model, with each regime's target (`plot_regimes`).

Every figure is read from the file, none recomputed. This module imports
neither TensorFlow nor Keras, so the charts can be redrawn anywhere
matplotlib is installed.
"""

import argparse
import json
import os
import sys

# One colour per mode, in every chart (`benchmarks.report` uses them too).
COLORS = {
    "plain": "#7f7f7f",
    "expert": "#1f77b4",
    "staged": "#d62728",
    "staged-tuned": "#ff9896",
    "compute-bound": "#2ca02c",
    "input-bound": "#9467bd",
    "plain_again": "#c7c7c7",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _describe(results):
    env = results["environment"]
    commit = (env.get("git_commit") or "?")[:7]
    return (
        f"commit {commit}{'+' if env.get('git_dirty') else ''}, "
        f"{results['created'][:10]}; TF {env['tensorflow']}, Keras "
        f"{env['keras']}, {env['usable_cpus']} CPUs, {env['gpus']} GPUs"
    )


def plot_bench(results, path):
    """Writes a PNG of the time per step of every mode, per workload.

    One panel per workload (their steps differ by tens of times): a bar
    per mode, the median whole call per step (set-up included) with its
    min-max over the repetitions, and a black diamond at the median of the
    steps alone. Files from before whole calls were timed have the diamonds
    only.
    """
    plt = _pyplot()
    workloads = list(results["workloads"])
    columns = min(3, len(workloads))
    rows = -(-len(workloads) // columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(4.2 * columns, 2.9 * rows), squeeze=False
    )
    for ax in axes.flat[len(workloads) :]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, workloads, strict=False):
        section = results["workloads"][name]
        modes = [
            (mode, record)
            for mode, record in section["modes"].items()
            if record.get("seconds_per_step") is not None
        ]
        ys = range(len(modes))
        for y, (mode, record) in zip(ys, modes, strict=True):
            call = record.get("call_seconds_per_step")
            if call is not None:
                median = 1e3 * call["median"]
                ax.barh(
                    y,
                    median,
                    color=COLORS.get(mode),
                    xerr=[
                        [median - 1e3 * call["min"]],
                        [1e3 * call["max"] - median],
                    ],
                    error_kw={
                        "capsize": 2,
                        "elinewidth": 0.8,
                        "ecolor": "#555555",
                    },
                )
                ax.annotate(
                    f"{median:.2f}",
                    (1e3 * call["max"], y),
                    xytext=(3, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=7,
                )
            ax.plot(
                1e3 * record["seconds_per_step"]["median"],
                y,
                marker="D",
                markersize=4,
                markeredgecolor="white",
                color="black",
            )
        ax.set_yticks(list(ys))
        ax.set_yticklabels([mode for mode, _ in modes], fontsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.2)
        ax.set_xlabel("ms per step", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        info = section["info"]
        reps = len(section["modes"].get("plain", {}).get("reps", []))
        ax.set_title(
            f"{name}: {reps} reps of {info['steps']} steps of "
            f"{info['batch_size']}",
            fontsize=9,
        )
    fig.suptitle(
        f"'{results['name']}': bars = whole calls, set-up included (median,"
        f" min-max); diamonds = steps alone (median)\n{_describe(results)}",
        fontsize=8,
    )
    fig.tight_layout()
    return _save(fig, plt, path)


# The ratios of a regimes chart: (mode, label).
_REGIME_BARS = (
    ("staged", "staged / plain"),
    ("expert", "expert / plain"),
    ("plain_again", "plain again / plain (noise)"),
)


def plot_regimes(results, path):
    """Writes a PNG of the paired ratios to plain of whole calls, per regime.

    One panel per model: per regime a bar for staged, expert and, in a
    `--control` run, the second plain model (`plain_again`, whose distance
    from 1 is the run's noise), with the regime's target for staged as a
    dashed line. Above 1 is slower than plain.
    """
    plt = _pyplot()
    models = list(results["models"])
    fig, axes = plt.subplots(
        len(models), 1, figsize=(9, 3.3 * len(models)), squeeze=False
    )
    for ax, model in zip(axes.flat, models, strict=True):
        regimes = results["models"][model]["regimes"]
        bars = [
            (mode, label)
            for mode, label in _REGIME_BARS
            if any(
                f"{mode}/plain" in r["paired_ratios"] for r in regimes.values()
            )
        ]
        width = 0.8 / len(bars)
        top = 1.5
        for i, (mode, label) in enumerate(bars):
            xs, heights = [], []
            for j, regime in enumerate(regimes.values()):
                ratio = regime["paired_ratios"].get(f"{mode}/plain")
                if ratio is None:
                    continue
                xs.append(j + (i - (len(bars) - 1) / 2) * width)
                heights.append(ratio["seconds"])
            top = max([top, *heights])
            ax.bar(xs, heights, width, label=label, color=COLORS.get(mode))
            if mode != "expert":
                for x, h in zip(xs, heights, strict=True):
                    ax.annotate(
                        f"{h:.2f}",
                        (x, h),
                        xytext=(0, 2),
                        textcoords="offset points",
                        ha="center",
                        fontsize=6,
                        # Legible where a label meets a target line.
                        bbox={
                            "facecolor": "white",
                            "edgecolor": "none",
                            "alpha": 0.7,
                            "pad": 0.3,
                        },
                    )
        for j, regime in enumerate(regimes.values()):
            bound = regime["target"]["bound"]
            ax.hlines(
                bound,
                j - 0.45,
                j + 0.45,
                colors="black",
                linestyles="dashed",
                linewidth=1,
                label="target for staged" if j == 0 else None,
            )
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(regimes)))
        ax.set_xticklabels(list(regimes), fontsize=8)
        ax.set_ylabel("time / plain's", fontsize=8)
        # Room above the bars for their labels and the legend.
        ax.set_ylim(0, 1.1 * top)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_title(
            f"{model}: whole calls, paired ratio to plain (median of "
            f"{results['config']['rounds']} rounds)",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper left", ncol=4)
    fig.suptitle(f"benchmarks.regimes: {_describe(results)}", fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot(results, path):
    """Writes the chart of `results`' family (see the module docstring)."""
    if "workloads" in results:
        return plot_bench(results, path)
    if "models" in results:
        return plot_regimes(results, path)
    raise ValueError(
        "Invalid results: expected a benchmarks.run file (a 'workloads' key) "
        "or a benchmarks.regimes file (a 'models' key). Received keys: "
        f"{sorted(results)}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plots",
        description="Draws the chart of one result file.",
    )
    parser.add_argument("results", help="a benchmarks.run or regimes .json")
    parser.add_argument("out", help="the PNG file to write")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    print(plot(results, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
