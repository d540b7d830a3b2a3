"""The documentation site stays whole: every page reachable, every name on it.

`make docs` builds the site with `mkdocs build --strict` (broken links and
unparsable docstrings fail there). These tests check what a build does not:
a page missing from the nav, and a public name missing from the API pages.
They read the files only (no mkdocs, no TensorFlow import; the README's
example runs in a child process), so they also run in the io environment.
"""

import ast
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"
PACKAGE = "keras_stage"

# Every option, hook and config field of DeepRec's stage documentation
# (the Stage and SmartStage pages), each of which the migration guide maps.
DEEPREC_OPTIONS = (
    "features",
    "feed_dict",
    "items",
    "feed_generator",
    "capacity",
    "num_threads",
    "num_clients",
    "timeout_millis",
    "closed_exception_types",
    "ignored_exception_types",
    "use_stage_subgraph_thread_pool",
    "stage_subgraph_thread_pool_id",
    "stage_subgraph_thread_id",
    "stage_subgraph_stream_id",
    "name",
    "tf.make_prefetch_hook()",
    "tf.train.MonitoredTrainingSession",
    "tf.train.mark_target_node",
    "do_smart_stage",
    "do_smart_stage_gpu",
    "session_stage_subgraph_thread_pool",
    "inter_op_threads_num",
    "intra_op_threads_num",
    "global_name",
    "use_multi_stream",
    "multi_stream_num",
    "stage_multi_stream",
)


def nav_pages():
    """The .md paths listed under `nav:` in mkdocs.yml."""
    lines = (ROOT / "mkdocs.yml").read_text().splitlines()
    start = lines.index("nav:")
    pages = []
    for line in lines[start + 1 :]:
        if line and not line[0].isspace():
            break  # the next top-level key
        if line.lstrip().startswith("#"):
            continue
        found = re.search(r"(\S+\.md)\s*$", line)
        if found:
            pages.append(found.group(1))
    return pages


def doc_pages():
    return sorted(
        path.relative_to(DOCS).as_posix()
        for path in DOCS.rglob("*.md")
        if "hooks" not in path.relative_to(DOCS).parts
    )


def module_path(dotted):
    """The source file of module `dotted`, or None if it is not one."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def declared_all(dotted):
    """The literal `__all__` of module `dotted` (read, not imported)."""
    tree = ast.parse(module_path(dotted).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return None


def public_names():
    """`(qualified name, is_module)` for everything public, recursively.

    A public module is the package or a module named in a public module's
    `__all__`; its public names are its `__all__`.
    """
    found = []
    pending = [PACKAGE]
    while pending:
        module = pending.pop()
        for name in declared_all(module) or ():
            qualified = f"{module}.{name}"
            is_module = module_path(qualified) is not None
            found.append((qualified, is_module))
            if is_module:
                pending.append(qualified)
    return sorted(found)


def api_directives():
    """Identifiers after `:::` on the API pages."""
    return {
        match.group(1)
        for path in API.glob("*.md")
        for match in re.finditer(r"^::: (\S+)", path.read_text(), re.M)
    }


def api_titles():
    """The `keras_stage...` module each API page is titled after."""
    return {
        match.group(1)
        for path in API.glob("*.md")
        for match in re.finditer(r"^# `(\S+)`", path.read_text(), re.M)
    }


def test_every_page_is_in_the_nav():
    orphans = sorted(set(doc_pages()) - set(nav_pages()))
    assert not orphans, (
        f"Pages under docs/ missing from mkdocs.yml's nav: {orphans}. Add "
        "them to `nav:` so the site links to them."
    )


def test_every_nav_entry_is_a_page():
    missing = [page for page in nav_pages() if not (DOCS / page).is_file()]
    assert not missing, f"mkdocs.yml's nav names missing pages: {missing}"
    duplicates = {p for p in nav_pages() if nav_pages().count(p) > 1}
    assert not duplicates, f"Pages listed twice in the nav: {duplicates}"


def test_the_nav_reads_the_api_pages():
    api_pages = {p for p in doc_pages() if p.startswith("api/")}
    assert api_pages, "no API pages under docs/api/"
    assert api_pages <= set(nav_pages())


def test_public_names_are_found():
    # The walk itself: it must see the packages api_test.py pins.
    names = dict(public_names())
    assert names["keras_stage.layers"] is True
    assert names["keras_stage.data"] is True
    assert names["keras_stage.Model"] is False
    assert "keras_stage.layers.StagedInput" in names
    assert "keras_stage.data.stage" in names


def test_every_public_name_has_an_api_entry():
    directives = api_directives()
    titles = api_titles()
    missing = [
        name
        for name, is_module in public_names()
        if name not in directives and not (is_module and name in titles)
    ]
    assert not missing, (
        f"Public names without an API entry: {missing}. Add `::: <name>` to "
        "the page of its package under docs/api/ (or a page titled "
        "`# `<module>`` for a public module)."
    )


def test_every_api_entry_is_a_public_name():
    # Internals stay importable but leave the reference: an entry for a name
    # in no `__all__` documents what users should not call.
    public = {name for name, _ in public_names()}
    internal = sorted(api_directives() - public)
    assert not internal, (
        f"API entries for names in no `__all__`: {internal}. Remove them "
        "from docs/api/, or make the name public (tests/api_test.py)."
    )


def test_every_public_module_has_a_page():
    titles = api_titles()
    modules = [name for name, is_module in public_names() if is_module]
    missing = [name for name in [PACKAGE, *modules] if name not in titles]
    assert not missing, f"Public modules without an API page: {missing}"


def test_pages_link_nothing_outside_docs():
    # A relative link out of docs/ breaks `mkdocs build --strict`; say the
    # path in words instead (the README links into docs/, not back).
    outside = []
    for page in doc_pages():
        text = (DOCS / page).read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("../") and not page.startswith("api/"):
                outside.append((page, target))
            elif target.startswith("../../"):
                outside.append((page, target))
    assert not outside, f"Links out of docs/: {outside}"


def test_the_readme_links_into_docs_resolve():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert "docs/index.md" in targets
    missing = [t for t in targets if not (ROOT / t).is_file()]
    assert not missing, f"README links to missing docs pages: {missing}"


def test_the_migration_guide_maps_every_deeprec_option():
    guide = (DOCS / "migration.md").read_text()
    # The first cell of each table row is DeepRec's side.
    first_cells = [
        line.split(" | ")[0]
        for line in guide.splitlines()
        if line.startswith("| `")
    ]
    missing = [
        option
        for option in DEEPREC_OPTIONS
        if not any(
            re.search(rf"(?<!\w){re.escape(option)}(?!\w)", cell)
            for cell in first_cells
        )
    ]
    assert not missing, (
        f"DeepRec options without a row in docs/migration.md: {missing}"
    )


def readme_sections():
    """The README's `## ` headings, in order, mapped to their text."""
    readme = (ROOT / "README.md").read_text()
    parts = re.split(r"^## (.+)$", readme, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, (
        f"README.md has {len(lines)} lines; keep it under 200 (what it is, "
        "the speed table, install, one example, links) and put the rest "
        "in docs/."
    )


def test_the_readme_reads_in_a_newcomers_order():
    headings = list(readme_sections())
    expected = ["Speed", "Install", "Example", "Documentation"]
    assert [h for h in headings if h in expected] == expected, headings


def test_the_readme_keeps_its_two_setup_commands():
    install = readme_sections()["Install"]
    assert "make demo" in install
    # `make test` says how long it takes, on the line that names it.
    assert re.search(r"make test\b.*\b\d+ minutes", install), (
        "The README's install section must say how long `make test` takes."
    )


def test_the_readme_links_the_moved_pages():
    readme = (ROOT / "README.md").read_text()
    targets = set(re.findall(r"\]\(([^)#\s]+)", readme))
    for page in ("docs/demo.md", "docs/limitations.md", "CONTRIBUTING.md"):
        assert page in targets, f"README.md does not link {page}"
        assert (ROOT / page).is_file(), f"{page} does not exist"


def test_the_readme_links_every_guide():
    # Every topic of the docs is findable from the README by its name.
    readme = (ROOT / "README.md").read_text()
    guides = [p for p in doc_pages() if not p.startswith("api/")]
    missing = [p for p in guides if f"(docs/{p}" not in readme]
    assert not missing, f"README.md does not link these pages: {missing}"
    assert "(docs/api/keras_stage.md)" in readme


def test_the_docs_index_links_every_guide():
    index = (DOCS / "index.md").read_text()
    guides = [
        p for p in doc_pages() if not p.startswith("api/") and p != "index.md"
    ]
    missing = [p for p in guides if f"]({p}" not in index]
    assert not missing, f"docs/index.md does not link these pages: {missing}"


def test_the_readme_troubleshooting_names_the_fixes():
    sections = readme_sections()
    assert "Troubleshooting" in sections, "README.md has no Troubleshooting"
    text = sections["Troubleshooting"]
    for name in ("keras_stage.Model", "smart_stage", "PrefetchCallback"):
        assert name in text, f"Troubleshooting does not name {name}"
    assert "ImportError" in text and "tensorboard" in text


def test_contributing_names_the_development_targets():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for target in (
        "make test",
        "make test-io",
        "make test-jax",
        "make test-torch",
        "make lint",
        "make docs",
        "make bench",
        ".venv-io",
        ".venv-jax",
        ".venv-torch",
    ):
        assert target in text, f"CONTRIBUTING.md does not mention {target}"


# -- the pages speak to users: what holds now, short enough to read ---------

# A commit hash: 7 to 40 hex digits standing alone, with a digit among them
# (English words such as "defaced" are letters only), not the digits of a
# decimal fraction. Only the history table of CHANGELOG.md names commits.
COMMIT_HASH = re.compile(
    r"(?<![0-9A-Za-z_.,])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])"
)
# Words about how the work was organised, not about what holds.
JOURNAL_WORDS = re.compile(
    r"\b(?:this|last|previous|next) (?:stop|session)\b"
    r"|\bstops? before\b|\breverted\b|\bworktree\b",
    re.I,
)
HISTORY_BEGIN = "<!-- history table: python -m benchmarks.history --docs -->"
HISTORY_END = "<!-- end of the history table -->"
# Lines a page may have: a user reads it whole to decide.
MAX_LINES = {"limitations.md": 200, "benchmarks.md": 350}


def user_pages():
    """`(name, text)` of every docs page and the README (the history
    table is in CHANGELOG.md, not among them)."""
    pages = [(f"docs/{p}", (DOCS / p).read_text()) for p in doc_pages()]
    pages.append(("README.md", (ROOT / "README.md").read_text()))
    return pages


def _hits(pattern, text):
    return [
        (text.count("\n", 0, m.start()) + 1, m.group())
        for m in pattern.finditer(text)
    ]


def test_the_hash_pattern_finds_hashes_not_words():
    for text in ("at `7674538`", "ab-2ba16c9.json", "(0d35fce)", "e66488d"):
        assert COMMIT_HASH.search(text), text
    for text in ("defaced", "1.2345678", "0x1f77b4ff", "3_000_000", "v2.21.0"):
        assert not COMMIT_HASH.search(text), text


def test_no_page_names_a_commit():
    found = {
        name: hits
        for name, text in user_pages()
        if (hits := _hits(COMMIT_HASH, text))
    }
    assert not found, (
        f"Commit hashes (line, hash) outside the history table of "
        f"CHANGELOG.md: {found}. Say what holds now; history goes "
        "into benchmarks/results/history.csv and that table."
    )


def test_no_page_speaks_of_how_the_work_went():
    found = {
        name: hits
        for name, text in user_pages()
        if (hits := _hits(JOURNAL_WORDS, text))
    }
    assert not found, (
        f"Words about how the work was organised: {found}. State what "
        "holds now."
    )


def test_the_pages_a_user_reads_whole_stay_short():
    for page, limit in MAX_LINES.items():
        lines = len((DOCS / page).read_text().splitlines())
        assert lines <= limit, (
            f"docs/{page} has {lines} lines; keep it to {limit}."
        )


def test_the_history_table_is_rendered_from_the_csv():
    # benchmarks.history imports neither TensorFlow nor Keras.
    from benchmarks import history

    text = (ROOT / "CHANGELOG.md").read_text()
    start = text.index(HISTORY_BEGIN) + len(HISTORY_BEGIN)
    table = text[start : text.index(HISTORY_END)].strip() + "\n"
    assert table == history.markdown(history.read()), (
        "CHANGELOG.md's history table differs from history.csv: run "
        "`python -m benchmarks.history --docs`."
    )


# -- the figures and outputs a page shows are its files' ----------------------


def test_every_table_is_rendered_from_its_result_file():
    from benchmarks import records

    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        assert records.render(text) == text, (
            f"{page.name}: a table differs from the result file it names: "
            "run `python -m benchmarks.history --docs`."
        )


@pytest.mark.timeout(300)
def test_the_readme_example_stages_and_prints_what_it_shows():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Example.*?```python\n(.*?)```", readme, re.S)[1]
    shown = re.search(r"It prints.*?```text\n(.*?)```", readme, re.S)[1]
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        check=True,
    )

    def skeleton(text):
        # Each line's start, its figures masked: the same lines in order.
        return [re.sub(r"\d+", "#", line)[:40] for line in text.splitlines()]

    assert skeleton(done.stdout) == skeleton(shown), done.stdout
    assert done.stdout.count("The call is staged") == shown.count(
        "The call is staged"
    )


def test_every_benchmark_command_of_the_docs_wrote_its_result_file():
    # Each command docs/benchmarks.md gives is the one its table's file ran.
    text = (DOCS / "benchmarks.md").read_text()
    commands = re.findall(r"-m benchmarks (\w+(?: [^\n#]*)?)", text)
    commands = [c.strip() for c in commands if not c.startswith("SCENARIO")]
    commands.append("bench")  # `make bench`
    assert len(commands) >= 10, commands
    for command in commands:
        scenario = command.split()[0]
        if scenario == "scripts" and "--help" in command:
            continue
        name = re.search(r"--name (\S+)", command)
        stem = scenario + (f"-{name[1]}" if name else "")
        path = ROOT / "benchmarks" / "results" / f"{stem}.json"
        assert path.exists(), f"`{command}`: no {path.name}; run it."
        ran = json.loads(path.read_text())["command"]
        assert ran == f"python -m benchmarks {command}", (
            f"{path.name} was written by `{ran}`, the docs give `{command}`"
        )


# -- the docs' size, and every figure of theirs from its file -----------------

# What a user reads to decide and a contributor to start: the README,
# CONTRIBUTING.md and every page of docs/ (the design doc and the API pages
# included). CHANGELOG.md's history table of figures is not prose.
WORD_BUDGET = 20_000
MAX_PAGE_LINES = 400
# A figure in prose, then the file and path it comes from (see below).
FIGURE = re.compile(r"(-?\d+(?:\.\d+)?)(?:x|%| s)?<!-- figure: (\S+) (\S+) -->")
# A ratio written in prose ("0.12x", "1.06 of plain"): it must be marked.
RATIO = re.compile(r"\b\d+\.\d+(?:x\b| of (?:plain|the))")
# `make TARGET` then, before the next target, its time in minutes.
TARGET_TIME = re.compile(
    r"make ([\w-]+)\b(?:(?!make )[^\n])*?"
    r"(?:about |in )?(\d+(?:\.\d+)?)(?:(?: to |-)(\d+(?:\.\d+)?))? minutes?"
)


def docs_texts():
    """`user_pages()` and CONTRIBUTING.md: the docs' size and figures."""
    contributing = ("CONTRIBUTING.md", (ROOT / "CONTRIBUTING.md").read_text())
    return user_pages() + [contributing]


def prose(text):
    """`text` without its code blocks and rendered tables."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"<!-- table: .*?<!-- end of table -->", "", text, flags=re.S)


def figure_value(file, path):
    """The value at `path` of a result file: `workload/metric/key[/mode]`
    in a summary file, else a `/`-separated path from its top."""
    data = json.loads((ROOT / file).read_text())
    parts = path.split("/")
    if "summaries" in data:
        workload, metric, *parts = parts
        (data,) = [
            s
            for s in data["summaries"]
            if (s["workload"], s["metric"]) == (workload, metric)
        ]
    for part in parts:
        data = data[part]
    return data


def test_the_docs_read_in_under_20000_words():
    words = {name: len(text.split()) for name, text in docs_texts()}
    total = sum(words.values())
    biggest = sorted(words.items(), key=lambda item: -item[1])[:5]
    assert total <= WORD_BUDGET, (
        f"The docs have {total} words; keep {WORD_BUDGET}. Largest: {biggest}."
    )


def test_no_user_page_is_over_400_lines():
    long = {
        name: n
        for name, text in docs_texts()
        if (n := len(text.splitlines())) > MAX_PAGE_LINES
    }
    assert not long, f"Pages over {MAX_PAGE_LINES} lines: {long}"


def test_every_marked_figure_is_its_files():
    checked = 0
    for page, text in docs_texts():
        for written, file, path in FIGURE.findall(text):
            value = figure_value(file, path)
            digits = len(written.partition(".")[2])
            assert f"{value:.{digits}f}" == written, (
                f"{page}: {written} is {value:.{digits}f} in {file} {path}"
            )
            checked += 1
    assert checked, "no figure is marked with its file"


def test_every_ratio_in_prose_is_marked_with_its_file():
    unmarked = {}
    for page, text in docs_texts():
        if page == "docs/demo.md":  # its figures are its output's (below)
            continue
        text = prose(text)
        for match in RATIO.finditer(text):
            if not FIGURE.match(text, match.start()):
                unmarked.setdefault(page, []).append(match.group())
    assert not unmarked, (
        f"Ratios in prose without `<!-- figure: FILE PATH -->` after the "
        f"number: {unmarked}"
    )


def test_the_demo_page_says_what_its_output_shows():
    text = (DOCS / "demo.md").read_text()
    shown = "".join(re.findall(r"```.*?```", text, re.S))
    said = re.findall(r"\b\d+(?:\.\d+)?(?:x|%)", prose(text))
    missing = [figure for figure in said if figure not in shown]
    assert not missing, (
        f"docs/demo.md's text gives figures its output does not: {missing}"
    )


def test_every_make_target_time_is_the_measured_one():
    measured = json.loads(
        (ROOT / "benchmarks" / "results" / "targets.json").read_text()
    )["minutes"]
    found = []
    for page, text in docs_texts():
        for target, low, high in TARGET_TIME.findall(text):
            if target not in measured:
                continue
            low, high = float(low), float(high or low)
            value = measured[target]
            # "about N": N is the measured time to the nearest minute.
            assert low - 0.5 <= value < high + 0.5, (
                f"{page}: `make {target}` takes {value} minutes "
                f"(targets.json), not {low:g}-{high:g}"
            )
            found.append(target)
    assert {"test", "demo", "bench", "bench-quick"} <= set(found), found


def test_each_api_page_names_the_files_of_its_docstrings():
    # The reference reads in the repository too: each page names the files
    # whose docstrings `make docs` renders into it.
    for page in sorted(API.glob("*.md")):
        text = page.read_text()
        line = re.search(r"^Docstrings in (.*)\(the site's pages", text, re.M)
        assert line, f"{page.name} does not say where its docstrings are"
        files = [ROOT / f for f in re.findall(r"`([\w/]+\.py)`", line[1])]
        sources = "".join(f.read_text() for f in files)
        for name in re.findall(r"^::: \S+\.(\w+)$", text, re.M):
            defined = rf"^(?:class {name}\b|def {name}\(|{name} = )"
            assert re.search(defined, sources, re.M), (
                f"{page.name}: {name} is not defined in {line[1]}"
            )


# Internal names user pages once gave; the design doc is where they belong.
INTERNAL_NAMES = re.compile(
    r"\b(?:FedSource|epoch_sources|StageStats|StageRunner|StagePool|"
    r"IDLE_CAPACITY|state_access|decision/calls\.py|live_stages|Packer)\b"
)


def test_user_pages_name_only_the_public_api():
    public = {name for name, _ in public_names()} | {PACKAGE}
    found = {}
    for name, text in user_pages():
        if name == "docs/design.md" or name.startswith("docs/api/"):
            continue
        named = re.findall(r"`(keras_stage(?:\.\w+)*)", text)
        hits = [n for n in named if n not in public]
        hits += re.findall(r"keras_stage/[\w/]+\.py", text)
        hits += INTERNAL_NAMES.findall(text)
        if hits:
            found[name] = sorted(set(hits))
    assert not found, (
        f"User pages name internals: {found}; say what the user sets and "
        "sees, and put how it works in docs/design.md."
    )
