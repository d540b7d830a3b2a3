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
- `jax_backend`, `torch_backend`: `benchmarks.jax_backend`, whole `fit`
  calls on Keras's JAX or torch backend, staged and expert (plain Keras
  cannot fit there), `call` and `steps`; the control (`expert_again`
  against expert, paired) in `other`.
- `jax_scale`: `benchmarks.jax_scale`, whole `fit` calls on Keras's JAX
  backend in one process with one device, with two devices and in two
  processes, staged and hand (in `expert`), one row per configuration
  and workload (`criteo 1x2`: 1 process x 2 devices); the control (hand
  against itself), the examples per second and the steady state's
  longer fits (their ratios and examples per second) in `other`.
- `first_calls`: `benchmarks.first_calls`, one row per timed call of a
  model's first calls, and with `--scripts` one row per script and timed
  part (`script`, `fit`, `evaluate`, `predict`, `process`), in seconds;
- `across_calls`, `strategy_calls`, `service_calls`, `jax_calls`: the
  calls on one dataset object, one row per workload, in ms per call;
- `determinism_verdict`: what `PrefetchCallback` reported per workload
  and clock, in `other`;
- a saved `benchmarks.regimes` console log (`.log`), one row per model
  and regime from its printed table.

Every figure is copied from the file, none computed: medians, and the
ratios the run recorded, paired (the median over rounds of the ratio
within a round) where it recorded them (`ratios` column), else the ratio
of the medians. The one exception is `determinism_verdict`, whose files
hold only rounds: its figures are their medians.

`python -m benchmarks.history --markdown` prints the history table of
docs/benchmarks.md, rendered from the CSV (`markdown`). This module
imports neither TensorFlow nor Keras.
"""

import argparse
import csv
import datetime
import json
import os
import re
import statistics
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
    """Rows of a `benchmarks.jax_backend` results dict (either backend)."""
    backend = results["environment"]["keras_backend"]
    backend = "JAX" if backend == "jax" else backend
    base = {
        "date": _date(results["created"]),
        "commit": _commit(results["environment"]),
        "family": results["family"],
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
            else f"plain impossible on {backend}: {plain['error_type']}",
            "max |staged - expert| weight "
            f"{section['weight_check']['max_abs_difference']:.1e}",
        ]
        ratios = section["paired_ratios"]
        for timing, key in (("call", "seconds"), ("steps", "steps_seconds")):
            control = ratios.get("expert_again/expert", {}).get(key)
            control = [] if control is None else [f"control {control:.3f}"]
            rows.append(
                {
                    **base,
                    "workload": name,
                    "timing": timing,
                    "size": f"{section['epochs']} epochs of "
                    f"{section['rows']} rows, batch {section['batch_size']}",
                    "expert": _fmt(modes["expert"][f"{key}_median"]),
                    "staged": _fmt(modes["staged"][f"{key}_median"]),
                    "staged/expert": _fmt(ratios["staged/expert"][key]),
                    "other": "; ".join(other + control),
                }
            )
    return rows


def jax_scale_rows(results, run):
    """Rows of a `benchmarks.jax_scale` results dict (process 0's figures)."""
    rows = []
    for config, section in results["configs"].items():
        if "processes" not in section:
            continue
        workloads = section["processes"][0]["workloads"]
        for name, cell in section["summary"].items():
            modes = workloads[name]["modes"]
            eps = cell["examples_per_second"]
            other = [
                f"control hand2/hand {cell['hand2/hand']:.3f}",
                f"hand2 {modes['hand2']['seconds_median']:.3f}",
                "examples/s "
                + ", ".join(
                    f"{mode} {value:.0f}" for mode, value in eps.items()
                ),
                "max |staged - hand| weight "
                f"{cell['max_abs_weight_difference']:.1e}",
            ]
            steady = cell.get("steady")
            if steady:
                other.append(
                    f"steady state, fit(epochs={steady['epochs']}): "
                    f"staged/hand {steady['staged/hand']:.3f}, control "
                    f"hand2/hand {steady['hand2/hand']:.3f}, examples/s "
                    + ", ".join(
                        f"{mode} {value:.0f}"
                        for mode, value in steady["examples_per_second"].items()
                    )
                )
            rows.append(
                _row(
                    date=_date(results["created"]),
                    commit=_commit(results["environment"]),
                    family="jax_scale",
                    run=run,
                    workload=f"{name} {config}",
                    timing="call",
                    rounds=results["config"]["rounds"],
                    size=f"{workloads[name]['epochs']} epochs of "
                    f"{workloads[name]['rows']} rows, batch "
                    f"{workloads[name]['batch_size']}",
                    unit="s",
                    expert=_fmt(modes["hand"]["seconds_median"]),
                    staged=_fmt(modes["staged"]["seconds_median"]),
                    ratios="paired",
                    other="; ".join(other),
                    **{"staged/expert": _fmt(cell["staged/hand"])},
                )
            )
    return rows


def _row(**fields):
    """A row with every column, the missing ones empty."""
    return {k: fields.get(k, "") for k in COLUMNS}


def _name_commit(run):
    """The commit a run's name starts with or ends with (`d2dfa21`, ...)."""
    found = re.search(r"(?:^|[/-])([0-9a-f]{7})(?:-|$)", run)
    return found.group(1) if found else ""


def first_calls_rows(results, run, date):
    """Rows of a `benchmarks.first_calls` results dict (either mode)."""
    if results.get("kind") == "scripts":
        package = results["environment"].get("package", {})
        base = {
            "date": _date(results["created"]),
            "commit": _commit(package),
            "rounds": results["config"]["processes"],
        }
        sections = {
            name: section["summary"]
            for name, section in results["scripts"].items()
            if "summary" in section
        }
        label = "{} script {}"
    else:
        base = {"date": date, "commit": _name_commit(run), "rounds": ""}
        sections = {results["model"]: results["summary"]}
        base["rounds"] = len(results["runs"]["plain"])
        label = "{} first calls {}"
    rows = []
    for name, summary in sections.items():
        for part, figures in summary.items():
            medians = figures["median_seconds"]
            paired = figures["paired"]
            rows.append(
                _row(
                    **base,
                    family="first_calls",
                    run=run,
                    workload=label.format(name, part),
                    timing="call",
                    size="fresh processes",
                    unit="s",
                    plain=_fmt(medians.get("plain")),
                    staged=_fmt(medians.get("staged")),
                    **{
                        "staged/plain": _fmt(paired.get("staged/plain")),
                        "control/plain": _fmt(paired.get("plain_again/plain")),
                    },
                    ratios="paired",
                )
            )
    return rows


# The benchmarks that time calls on one dataset object, by folder.
CALLS_FAMILIES = (
    "across_calls",
    "strategy_calls",
    "service_calls",
    "jax_calls",
)


def calls_rows(results, run, family, date):
    """Rows of an `across_calls`-like results dict, one per workload."""
    rows = []
    for workload, section in results.items():
        if not isinstance(section, dict) or "summary" not in section:
            continue
        summary = section["summary"]
        calls = len(section.get("staged", []))

        def median(mode, summary=summary):
            return _fmt(summary.get(f"{mode}_ms"), 2)

        def ratio(pair, summary=summary):
            return _fmt(summary.get(f"paired_{pair}"))

        rows.append(
            _row(
                date=date,
                commit=_name_commit(run),
                family=family,
                run=run,
                workload=workload,
                timing="call",
                rounds=calls,
                size=f"{calls} calls",
                unit="ms/call",
                plain=median("plain"),
                expert=median("expert"),
                staged=median("staged"),
                ratios="paired",
                **{
                    "staged/plain": ratio("staged/plain"),
                    "staged/expert": ratio("staged/expert"),
                    "control/plain": ratio("plain_again/plain"),
                },
            )
        )
    return rows


def determinism_verdict_rows(results, run, date):
    """Rows of a `benchmarks.determinism_verdict` results dict."""
    rows = []
    for workload, clocks in results.items():
        other = []
        for clock, reports in clocks.items():
            bound = sum(bool(r["input_bound"]) for r in reports)
            wait = statistics.median(r["wait_ratio"] for r in reports)
            fill = statistics.median(r["buffer_fill"] for r in reports)
            other.append(
                f"{clock}: input-bound {bound}/{len(reports)}, "
                f"wait {wait:.2f}, fill {fill:.2f}"
            )
        rows.append(
            _row(
                date=date,
                commit=_name_commit(run),
                family="determinism_verdict",
                run=run,
                workload=workload,
                timing="verdict",
                rounds=len(next(iter(clocks.values()))),
                other="; ".join(other),
            )
        )
    return rows


def regimes_log_rows(text, run, date):
    """Rows of a saved `benchmarks.regimes` console log's printed table.

    A table row: the regime, then whole and steps seconds of plain, staged
    and expert, then staged/plain, expert/plain and plain_again/plain,
    each whole and steps (`-` where a mode did not run).
    """
    rows = []
    model = ""
    rounds = re.search(r"round \d+/(\d+)", text)
    described = dict(re.findall(r"^  (\w+): (.+)$", text, re.M))
    for line in text.splitlines():
        found = re.match(r"(\w+) \(batch \d+\):", line)
        if found:
            model = found.group(1)
            continue
        cells = line.split()
        if len(cells) < 13 or not re.fullmatch(r"[a-z_0-9]+", cells[0]):
            continue
        values = cells[1:13]
        if not all(re.fullmatch(r"-|\d+\.\d+", v) for v in values):
            continue
        values = ["" if v == "-" else v for v in values]
        for timing, offset in (("call", 0), ("steps", 1)):
            rows.append(
                _row(
                    date=date,
                    commit=_name_commit(run),
                    family="regimes",
                    run=run,
                    workload=f"{model} {cells[0]}",
                    timing=timing,
                    rounds=rounds.group(1) if rounds else "",
                    size=described.get(cells[0], ""),
                    unit="s",
                    plain=values[3 * offset],
                    staged=values[3 * offset + 1],
                    expert=values[3 * offset + 2],
                    ratios="paired",
                    **{
                        "staged/plain": values[6 + offset],
                        "expert/plain": values[8 + offset],
                        "control/plain": values[10 + offset],
                    },
                )
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
    if path.endswith(".log"):
        return regimes_log_rows(text, run, _file_date(path))
    results = json.loads(text)
    family = run.split("/")[0] if "/" in run else ""
    if family == "first_calls":
        return first_calls_rows(results, run, _file_date(path))
    if family in CALLS_FAMILIES:
        return calls_rows(results, run, family, _file_date(path))
    if family == "determinism_verdict":
        return determinism_verdict_rows(results, run, _file_date(path))
    if results.get("family") in ("jax_backend", "torch_backend"):
        return jax_backend_rows(results, run)
    if results.get("family") == "jax_scale":
        return jax_scale_rows(results, run)
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
            if name.endswith((".json", ".txt", ".log")):
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


# The block of docs/benchmarks.md that `--docs` rewrites.
DOCS_PAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "docs",
    "benchmarks.md",
)
BEGIN = "<!-- history table: python -m benchmarks.history --docs -->"
END = "<!-- end of the history table -->"


def _feed(row):
    """How a regimes row was fed, from its description."""
    if row["family"] != "regimes":
        return ""
    if "op determinism" in row["size"]:
        return " (dataset, op determinism)"
    if "tf.data.Dataset" in row["size"]:
        return " (dataset)"
    return " (arrays)"


def _headline(row):
    """`(name, value)`: staged/plain, or staged/expert where no plain ran."""
    if row["staged/plain"]:
        return "staged/plain", row["staged/plain"]
    if row["staged/expert"]:
        return "staged/expert", row["staged/expert"]
    return "", ""


def _when(row, value):
    commit = row["commit"] or "-"
    return f"{value} ({row['date'][:10]}, {commit})"


def markdown(rows):
    """The history table of docs/benchmarks.md, from the CSV's rows.

    One line per family, workload (and feed, for regimes) and timing: how
    many runs measured it, the first and the last run's ratio (staged to
    plain, or to expert where plain Keras cannot run) with its date and
    commit, and the lowest and highest. Whole calls (`call`) are the
    headline; the steps alone get a line where more runs timed them than
    whole calls (the suite timed only steps at first). Of the first
    calls, only a script's or a model's total time gets a line (the
    workloads ending in `script` or `total`). Runs of one date
    keep the table's order, except that a run named `before` comes first
    (a before/after pair committed together). Rows without a ratio (the
    determinism verdicts) are left out; the CSV has them.
    """
    groups = {}
    for row in rows:
        name, value = _headline(row)
        if not value:
            continue
        if row["family"] == "first_calls" and not row["workload"].endswith(
            (" script", " total")
        ):
            continue
        key = (row["family"], row["workload"] + _feed(row), row["timing"])
        groups.setdefault(key, []).append((row, name, value))
    lines = [
        "| family | workload | time | ratio | runs | first run | last run "
        "| lowest - highest |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in sorted(groups):
        family, workload, timing = key
        calls = groups.get((family, workload, "call"), [])
        if timing == "steps" and len(groups[key]) <= len(calls):
            continue
        found = sorted(
            groups[key],
            key=lambda item: (item[0]["date"], "before" not in item[0]["run"]),
        )
        name = found[-1][1]
        found = [(row, value) for row, _, value in found]
        values = [float(value) for _, value in found]
        lines.append(
            f"| {family} | {workload} | {timing} | {name} | {len(found)} "
            f"| {_when(*found[0])} | {_when(*found[-1])} "
            f"| {min(values):.3f} - {max(values):.3f} |"
        )
    return "\n".join(lines) + "\n"


def update_docs(rows, page=DOCS_PAGE):
    """Rewrites the history table between `BEGIN` and `END` in `page`."""
    with open(page) as f:
        text = f.read()
    start = text.index(BEGIN) + len(BEGIN)
    end = text.index(END)
    text = text[:start] + "\n\n" + markdown(rows) + "\n" + text[end:]
    with open(page, "w") as f:
        f.write(text)


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
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the history table of docs/benchmarks.md and stop",
    )
    parser.add_argument(
        "--docs",
        action="store_true",
        help="after adding the rows, rewrite that table in the page",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(read(args.out)), end="")
        return 0
    added = update(args.files or result_files(), args.out)
    print(f"{args.out}: {added} row(s) added")
    if args.docs:
        update_docs(read(args.out))
        print(f"{DOCS_PAGE}: history table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
