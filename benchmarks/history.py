"""The history table: one row per benchmark run, workload and metric.

`python -m benchmarks.history [FILE ...]` adds the rows of result files
(the summaries `python -m benchmarks` writes; default: every
`benchmarks/results/*.json`) to `benchmarks/results/history.csv`, keeping
the rows already there, so the table outlives the files it was built from.
A row already in the table is not added twice. Every figure is copied from
the summary: each mode's median and its paired ratio to the reference.
`--markdown` prints the history table of CHANGELOG.md; `--docs`
rewrites it and every table of the README and the docs drawn from a result
file. This module imports neither TensorFlow nor Keras.
"""

import argparse
import csv
import glob
import json
import os
import sys

from benchmarks import records

RESULTS_DIR = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results"
)
HISTORY = os.path.join(RESULTS_DIR, "history.csv")
COLUMNS = (
    "date", "commit", "family", "run", "workload", "timing", "rounds", "size",
    "unit", "plain", "expert", "staged", "limit", "staged/plain",
    "staged/expert", "staged/limit", "expert/plain", "control/plain",
    "ratios", "other",
)  # fmt: skip
# What makes a row the same row when the table is appended to.
KEY = ("run", "commit", "workload", "timing", "plain", "staged")


def _fmt(value):
    return "" if value is None else f"{value:.4g}"


def rows_of(path):
    """The history rows of one summary file."""
    with open(path) as f:
        result = json.load(f)
    if "summaries" not in result:
        return []
    env = result["environment"]
    commit = (env.get("commit") or "") + ("+" if env.get("dirty") else "")
    reference = result.get("reference", "plain")
    stem = os.path.splitext(os.path.basename(path))[0]
    rows = []
    for s in result["summaries"]:
        ratio, median = s["ratio"], s["median"]
        staged = s["staged"].get("staged")
        rows.append(
            {
                "date": result["date"],
                "commit": commit,
                "family": result["benchmark"],
                "run": f"{commit}/{stem}",
                "workload": s["workload"],
                "timing": "call" if s["metric"] == "seconds" else s["metric"],
                "rounds": s["rounds"],
                "size": result["command"],
                "unit": "s",
                "plain": _fmt(median.get("plain")),
                "expert": _fmt(median.get("expert")),
                "staged": _fmt(median.get("staged")),
                "limit": _fmt(median.get("compute_bound")),
                f"staged/{reference}": _fmt(ratio.get("staged")),
                "expert/plain": _fmt(ratio.get("expert"))
                if reference == "plain"
                else "",
                "control/plain": _fmt(s["control"]),
                "ratios": "paired",
                "other": ""
                if staged is None
                else f"ran staged {staged[0]}/{staged[1]}",
            }
        )
    return rows


def result_files(root=RESULTS_DIR):
    """Every summary under `root` (the raw rows' folder left out)."""
    # bench-quick's check runs are not kept (git ignores them too).
    found = glob.glob(os.path.join(root, "*.json"))
    return sorted(f for f in found if not f.endswith("-quick.json"))


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
            if tuple(row[k] for k in KEY) not in seen:
                seen.add(tuple(row[k] for k in KEY))
                rows.append(row)
                added += 1
    rows.sort(key=lambda row: (row["date"], row["family"], row["run"]))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return added


# The pages `--docs` rewrites: the history table (CHANGELOG.md), every block
# (`records.render`) of the README and the docs.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_PAGE = os.path.join(ROOT, "CHANGELOG.md")
README = os.path.join(ROOT, "README.md")
BEGIN = "<!-- history table: python -m benchmarks.history --docs -->"
END = "<!-- end of the history table -->"


def _feed(row):
    """How a regimes row was fed, from its description or its command."""
    if row["family"] != "regimes":
        return ""
    if "op determinism" in row["size"] or "--determinism" in row["size"]:
        return " (dataset, op determinism)"
    if "tf.data.Dataset" in row["size"] or "--feed dataset" in row["size"]:
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
        help="summary files (default: every .json in benchmarks/results)",
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
        for page in [README, *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
            with open(page) as f:
                text = f.read()
            if records.render(text) != text:
                with open(page, "w") as f:
                    f.write(records.render(text))
                print(f"{page}: tables rewritten from their result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
