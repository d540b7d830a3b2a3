"""The history table: one row per benchmark run and workload.

`python -m benchmarks.history [FILE ...]` reads result files and adds
their rows to `benchmarks/results/history.csv`, keeping the rows already
there, so the table outlives the full result files it was built from.
With no FILE it reads every result under `benchmarks/results/`. A row
already in the table (same run, commit, workload, timing and medians) is
not added twice.

It reads the outputs of every benchmark family:

- `bench`: `benchmarks.run` (`make bench`, `make bench-quick`), one row
  per workload and kind of time: `call` (whole `fit` calls, set-up
  included) where the file has it, and `steps` (first batch to last);
- `regimes`: `benchmarks.regimes`, one row per model and regime, `call`
  and `steps`;
- `epoch_switch`: `benchmarks.epoch_switch`, whole multi-epoch fits;
- `criteo_overlap`: the table `benchmarks.criteo_overlap` prints, saved
  as a `.txt` file whose first line is `# <command>, <date>, at <commit>`.
- `jax_backend`: `benchmarks.jax_backend`, whole `fit` calls on Keras's
  JAX backend, staged and expert (plain Keras cannot fit there), `call`
  and `steps`.

Every figure is copied from the file, none computed: medians, and the
ratios the run recorded, paired (the median over rounds of the ratio
within a round) where it recorded them (`ratios` column), else the ratio
of the medians. This module imports neither TensorFlow nor Keras.
"""

import argparse
import csv
import datetime
import json
import os
import re
import subprocess
import sys

RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results"
)
HISTORY = os.path.join(RESULTS_DIR, "history.csv")

COLUMNS = (
    "date",
    "commit",
    "family",
    "run",
    "workload",
    "timing",
    "rounds",
    "size",
    "unit",
    "plain",
    "expert",
    "staged",
    "limit",
    "staged/plain",
    "staged/expert",
    "staged/limit",
    "expert/plain",
    "control/plain",
    "ratios",
    "other",
)
# What makes a row the same row when the table is appended to. Not the
# date: a file with no date of its own (epoch_switch) gets its file's,
# which changes when it is committed; its medians do not.
KEY = ("run", "commit", "workload", "timing", "plain", "staged")


def _fmt(value, digits=3):
    if value is None:
        return ""
    return f"{value:.{digits}f}"


def _commit(environment):
    commit = (environment.get("git_commit") or "")[:7]
    return commit + ("+" if commit and environment.get("git_dirty") else "")


def _run_name(path):
    path = os.path.abspath(path)
    if path.startswith(RESULTS_DIR + os.sep):
        path = os.path.relpath(path, RESULTS_DIR)
    else:
        path = os.path.basename(path)
    return os.path.splitext(path)[0]


def _file_date(path):
    """When a file with no date of its own was committed, else modified."""
    try:
        out = subprocess.run(
            ["git", "log", "--diff-filter=A", "-1", "--format=%cI", "--", path],
            cwd=os.path.dirname(os.path.abspath(path)),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
    except OSError:
        out = ""
    if out:
        return _date(out)
    stamp = os.path.getmtime(path)
    return datetime.datetime.fromtimestamp(stamp, datetime.UTC).strftime(
        "%Y-%m-%d %H:%M"
    )


def _date(created):
    """`2026-11-24T02:24:38+0000` -> `2026-11-24 02:24` (UTC as written)."""
    return created[:16].replace("T", " ")


def _bench_workload(name, config):
    latency = config.get("remote_latency")
    extras = []
    if name == "remote" and latency:
        extras.append(f"{latency * 1e3:.0f} ms reads")
    if name == "remote" and config.get("remote_read") == "python":
        extras.append("python read")
    if config.get("trunk") not in (None, "light"):
        extras.append(f"trunk {config['trunk']}")
    return name + (f" ({', '.join(extras)})" if extras else "")


# The modes with columns of their own; the others go to `other`.
_MAIN_MODES = ("plain", "expert", "staged")


def _bench_row(section, timing, time_infix, ratio_prefix):
    """The figures of one workload of a `benchmarks.run` file, one timing.

    `time_infix` selects the medians (`call_seconds_per_step` or
    `seconds_per_step`), `ratio_prefix` the ratios (`steps_` or none).
    """
    modes = section["modes"]
    paired = f"{ratio_prefix}paired_ratio_to_plain" in modes.get("staged", {})
    prefix = ratio_prefix + ("paired_" if paired else "")

    def median(mode):
        times = modes.get(mode, {}).get(f"{time_infix}seconds_per_step")
        return None if times is None else 1e3 * times["median"]

    def ratio(mode, key):
        return modes.get(mode, {}).get(prefix + key)

    limit = (section.get("limit") or {}).get(f"{time_infix}seconds_per_step")
    other = [
        f"{mode} {_fmt(median(mode), 2)} "
        f"({_fmt(ratio(mode, 'ratio_to_plain'))})"
        for mode in modes
        if mode not in _MAIN_MODES and median(mode) is not None
    ]
    return {
        "timing": timing,
        "plain": _fmt(median("plain"), 2),
        "expert": _fmt(median("expert"), 2),
        "staged": _fmt(median("staged"), 2),
        "limit": _fmt(limit and 1e3 * limit, 2),
        "staged/plain": _fmt(ratio("staged", "ratio_to_plain")),
        "staged/expert": _fmt(ratio("staged", "ratio_to_expert")),
        "staged/limit": _fmt(ratio("staged", "ratio_to_limit")),
        "expert/plain": _fmt(ratio("expert", "ratio_to_plain")),
        "control/plain": "",
        "ratios": "paired" if paired else "of medians",
        "other": "; ".join(other),
    }


def bench_rows(results, run):
    """Rows of a `benchmarks.run` results dict (`make bench`)."""
    base = {
        "date": _date(results["created"]),
        "commit": _commit(results["environment"]),
        "family": "bench",
        "run": run,
        "unit": "ms/step",
    }
    rows = []
    for name, section in results["workloads"].items():
        plain = section["modes"].get("plain", {})
        # Files from before whole calls were timed hold the steps' ratios
        # under the unprefixed keys.
        has_calls = "call_seconds_per_step" in plain
        kinds = [("call", "call_", "")] if has_calls else []
        kinds.append(("steps", "", "steps_" if has_calls else ""))
        for kind in kinds:
            rows.append(
                {
                    **base,
                    "workload": _bench_workload(name, results["config"]),
                    "rounds": len(plain.get("reps", [])) or "",
                    "size": f"{section['info']['steps']} steps of "
                    f"{section['info']['batch_size']}",
                    **_bench_row(section, *kind),
                }
            )
    return rows


def _regime_row(result, timing, key):
    """The figures of one regime of a `benchmarks.regimes` file."""
    modes = result["modes"]
    ratios = result["paired_ratios"]

    def median(mode):
        return _fmt(modes.get(mode, {}).get(f"{key}_median"))

    def ratio(mode):
        return _fmt(ratios.get(f"{mode}/plain", {}).get(key))

    return {
        "timing": timing,
        "size": result["description"],
        "plain": median("plain"),
        "expert": median("expert"),
        "staged": median("staged"),
        "staged/plain": ratio("staged"),
        "expert/plain": ratio("expert"),
        "control/plain": ratio("plain_again"),
    }


def regimes_rows(results, run):
    """Rows of a `benchmarks.regimes` results dict."""
    base = {
        "date": _date(results["created"]),
        "commit": _commit(results["environment"]),
        "family": "regimes",
        "run": run,
        "rounds": results["config"]["rounds"],
        "unit": "s",
        "limit": "",
        "staged/expert": "",
        "staged/limit": "",
        "ratios": "paired",
        "other": "",
    }
    rows = []
    for model, section in results["models"].items():
        for regime, result in section["regimes"].items():
            for timing, key in (
                ("call", "seconds"),
                ("steps", "steps_seconds"),
            ):
                rows.append(
                    {
                        **base,
                        "workload": f"{model} {regime}",
                        **_regime_row(result, timing, key),
                    }
                )
    return rows


def epoch_switch_rows(results, run, date):
    """The row of a `benchmarks.epoch_switch` results dict."""
    medians = results["median_seconds"]
    ratios = results["ratio_to_plain"]
    other = [
        f"{mode} {_fmt(medians[mode])} ({_fmt(ratios[mode])})"
        for mode in medians
        if mode not in _MAIN_MODES
    ]
    return [
        {
            "date": date,
            "commit": _commit(results.get("environment", {})),
            "family": "epoch_switch",
            "run": run,
            "workload": results["workload"],
            "timing": "call",
            "rounds": results["rounds"],
            "size": f"{results['epochs']} epochs of "
            f"{results['steps_per_epoch']} steps",
            "unit": "s",
            "plain": _fmt(medians.get("plain")),
            "expert": _fmt(medians.get("expert")),
            "staged": _fmt(medians.get("staged")),
            "limit": "",
            "staged/plain": _fmt(ratios.get("staged")),
            "staged/expert": "",
            "staged/limit": "",
            "expert/plain": _fmt(ratios.get("expert")),
            "control/plain": "",
            "ratios": "paired",
            "other": "; ".join(other),
        }
    ]


def jax_backend_rows(results, run):
    """Rows of a `benchmarks.jax_backend` results dict."""
    base = {
        "date": _date(results["created"]),
        "commit": _commit(results["environment"]),
        "family": "jax_backend",
        "run": run,
        "rounds": results["config"]["rounds"],
        "unit": "s",
        "plain": "",
        "limit": "",
        "staged/plain": "",
        "staged/limit": "",
        "expert/plain": "",
        "control/plain": "",
        "ratios": "paired",
    }
    rows = []
    for name, section in results["workloads"].items():
        modes = section["modes"]
        plain = section["plain"]
        other = [
            "plain ran"
            if plain["possible"]
            else f"plain impossible on JAX: {plain['error_type']}",
            "max |staged - expert| weight "
            f"{section['weight_check']['max_abs_difference']:.1e}",
        ]
        for timing, key in (("call", "seconds"), ("steps", "steps_seconds")):
            rows.append(
                {
                    **base,
                    "workload": name,
                    "timing": timing,
                    "size": f"{section['epochs']} epochs of "
                    f"{section['rows']} rows, batch {section['batch_size']}",
                    "expert": _fmt(modes["expert"][f"{key}_median"]),
                    "staged": _fmt(modes["staged"][f"{key}_median"]),
                    "staged/expert": _fmt(
                        section["paired_ratios"]["staged/expert"][key]
                    ),
                    "other": "; ".join(other),
                }
            )
    return rows


_HEADER = re.compile(
    r"#.*?criteo_overlap\s+(?P<reps>\d+)?.*?,\s*(?P<date>\d{4}-\d{2}-\d{2})"
    r".*?\bat\s+(?P<commit>[0-9a-f]{7,40})(?P<dirty>\s*\+)?"
)


def criteo_overlap_rows(text, run, date):
    """The row of a saved `benchmarks.criteo_overlap` table."""
    lines = text.splitlines()
    match = _HEADER.match(lines[0]) if lines else None
    table = {}
    for line in lines:
        # The printed columns: mode (34 characters), ms/step, CPU ms/step,
        # time / plain (paired), speedup over plain (paired).
        cells = line[34:].split()
        if len(cells) == 4 and not line.startswith("mode"):
            try:
                table[line[:34].strip()] = [float(c) for c in cells]
            except ValueError:
                continue
    if "plain" not in table:
        return []

    def cell(mode, column, digits):
        return _fmt(table[mode][column], digits) if mode in table else ""

    other = [
        f"{mode} {_fmt(values[0], 2)} ({_fmt(values[2])})"
        for mode, values in table.items()
        if mode not in _MAIN_MODES
    ]
    return [
        {
            "date": match["date"] if match else date,
            "commit": (match["commit"][:7] + ("+" if match["dirty"] else ""))
            if match
            else "",
            "family": "criteo_overlap",
            "run": run,
            "workload": "criteo",
            "timing": "steps",
            "rounds": (match["reps"] or "") if match else "",
            "size": "",
            "unit": "ms/step",
            "plain": cell("plain", 0, 2),
            "expert": cell("expert", 0, 2),
            "staged": cell("staged", 0, 2),
            "limit": "",
            "staged/plain": cell("staged", 2, 3),
            "staged/expert": "",
            "staged/limit": "",
            "expert/plain": cell("expert", 2, 3),
            "control/plain": "",
            "ratios": "paired",
            "other": "; ".join(other),
        }
    ]


def rows_of(path):
    """The history rows of one result file (`.json` or a saved `.txt`)."""
    run = _run_name(path)
    with open(path) as f:
        text = f.read()
    if path.endswith(".txt"):
        if "criteo_overlap" not in text.split("\n", 1)[0]:
            return []
        return criteo_overlap_rows(text, run, _file_date(path))
    results = json.loads(text)
    if results.get("family") == "jax_backend":
        return jax_backend_rows(results, run)
    if "workloads" in results:
        return bench_rows(results, run)
    if "models" in results:
        return regimes_rows(results, run)
    if "median_seconds" in results:
        return epoch_switch_rows(results, run, _file_date(path))
    return []


def result_files(root=RESULTS_DIR):
    """Every result file under `root`, sorted."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith((".json", ".txt")):
                found.append(os.path.join(folder, name))
    return sorted(found)


def read(path=HISTORY):
    """The table's rows (dicts of strings); none when there is no table."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def update(files, path=HISTORY):
    """Adds the rows of `files` missing from the table; returns how many."""
    rows = read(path)
    seen = {tuple(row[k] for k in KEY) for row in rows}
    added = 0
    for file in files:
        for row in rows_of(file):
            row = {k: str(row.get(k, "")) for k in COLUMNS}
            key = tuple(row[k] for k in KEY)
            if key not in seen:
                seen.add(key)
                rows.append(row)
                added += 1
    rows.sort(key=lambda row: (row["date"], row["family"], row["run"]))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return added


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.history", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "files",
        nargs="*",
        help="result files (default: every .json and .txt under "
        "benchmarks/results)",
    )
    parser.add_argument(
        "--out", default=HISTORY, help="the table (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    added = update(args.files or result_files(), args.out)
    print(f"{args.out}: {added} row(s) added")
    return 0


if __name__ == "__main__":
    sys.exit(main())
