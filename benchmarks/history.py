"""The history table: one row per benchmark run, workload and metric.

`python -m benchmarks.history [FILE ...]` adds the rows of summary files
(default: every `benchmarks/results/*.json`) missing from
`benchmarks/results/history.csv`, which so outlives them; each mode's median
and paired ratio are copied from the summary. `--markdown` prints the
history table of CHANGELOG.md; `--docs` rewrites it and every table of the
README and the docs drawn from a result file. Imports no TensorFlow, Keras.
"""

import argparse
import csv
import glob
import json
import os
import sys

from benchmarks import records

RESULTS_DIR, ROOT = records.RESULTS, records.ROOT
HISTORY = os.path.join(RESULTS_DIR, "history.csv")
COLUMNS = tuple(
    "date commit family run workload timing rounds size unit plain expert"
    " staged limit staged/plain staged/expert staged/limit expert/plain"
    " control/plain ratios other".split()
)
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
    plain = reference == "plain"
    stem = os.path.splitext(os.path.basename(path))[0]
    rows = []
    for s in result["summaries"]:
        if s["metric"] in records.SPREAD:  # in its file: mean and maximum
            continue
        ratio, median = s["ratio"], s["median"]
        staged = s["staged"].get("staged")
        other = "" if staged is None else f"ran staged {staged[0]}/{staged[1]}"
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
                "expert/plain": _fmt(ratio.get("expert") if plain else None),
                "control/plain": _fmt(s["control"]),
                "ratios": "paired",
                "other": other,
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
    before, seen = len(rows), {tuple(row[k] for k in KEY) for row in rows}
    for file in files:
        for row in rows_of(file):
            row = {k: str(row.get(k, "")) for k in COLUMNS}
            if tuple(row[k] for k in KEY) not in seen:
                seen.add(tuple(row[k] for k in KEY))
                rows.append(row)
    rows.sort(key=lambda row: (row["date"], row["family"], row["run"]))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return len(rows) - before


# The pages `--docs` rewrites: the history table (CHANGELOG.md), every block
# (`records.render`) of the README and the docs.
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
    for name in ("staged/plain", "staged/expert"):
        if row[name]:
            return name, row[name]
    return "", ""


def _when(row, value, _name):
    return f"{value} ({row['date'][:10]}, {row['commit'] or '-'})"


def markdown(rows):
    """The history table of CHANGELOG.md, from the CSV's rows.

    One line per family, workload (and feed, for regimes) and timing: its
    runs, the first and last run's ratio (staged to plain, else to expert)
    with date and commit, the lowest and highest. Steps get a line only
    where more runs timed them than whole calls; first calls only for a
    script's or model's total. Of one date's runs, `before` comes first.
    Rows without a ratio (determinism verdicts) are left out.
    """
    groups = {}
    for row in rows:
        name, value = _headline(row)
        total = row["workload"].endswith((" script", " total"))
        if not value or (row["family"] == "first_calls" and not total):
            continue
        key = (row["family"], row["workload"] + _feed(row), row["timing"])
        groups.setdefault(key, []).append((row, value, name))
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
        values = [float(value) for _, value, _ in found]
        lines.append(
            f"| {family} | {workload} | {timing} | {found[-1][2]} "
            f"| {len(found)} | {_when(*found[0])} | {_when(*found[-1])} "
            f"| {min(values):.3f} - {max(values):.3f} |"
        )
    return "\n".join(lines) + "\n"


def update_docs(rows, page=DOCS_PAGE):
    """Rewrites the history table between `BEGIN` and `END` in `page`."""
    with open(page) as f:
        text = f.read()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    text = text[:start] + "\n\n" + markdown(rows) + "\n" + text[end:]
    with open(page, "w") as f:
        f.write(text)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.history", description=__doc__.split("\n")[0]
    )
    add = parser.add_argument
    add("files", nargs="*", help="summary files (default: every result)")
    add("--out", default=HISTORY, help="the table (default: %(default)s)")
    add("--markdown", action="store_true", help="print CHANGELOG.md's table")
    add("--docs", action="store_true", help="rewrite it and the docs' tables")
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
