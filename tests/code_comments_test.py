"""Code comments and docstrings say why, not how fast it once was.

A timing measured on one machine goes stale in a comment and misleads the
next reader; the figures live in docs/ (benchmarks.md, engine.md, jax.md),
beside the command that reproduces them. Reads the package's source only.
"""

import ast
import io
import pathlib
import re
import tokenize

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_stage"

# A measured figure: a duration with a unit, a ratio of times, a count of
# runs or batches "measured", or a figure said to hold "here".
_FIGURE = re.compile(
    r"""
    \b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:ms|us|µs|ns)\b
    | \b\d+(?:\.\d+)?\s?(?:s|sec|seconds)\b[^.]*\b(?:measured|took|here)\b
    | \b(?:measured|took|about)\b[^.]{0,60}?\b\d+(?:\.\d+)?\s?
      (?:s|sec|seconds|ms|us|x|%|of\s(?:the|plain)|against)\b
    | \b\d+(?:\.\d+)?x\s(?:faster|slower)\b
    | \b\d\.\d+\sof\s(?:the\s)?(?:hand|plain|expert)
    | \(measured:\s?\d
    """,
    re.VERBOSE | re.IGNORECASE,
)


def _comments_and_docstrings(path):
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(
            node,
            (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef),
        ):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                line = node.body[0].lineno
                yield line, " ".join(_without_doctests(docstring).split())


def _without_doctests(docstring):
    # A doctest's output is checked by running it, so it cannot go stale.
    kept, in_example = [], False
    for text in docstring.splitlines():
        stripped = text.strip()
        if stripped.startswith(">>>"):
            in_example = True
        elif not stripped:
            in_example = False
        if not in_example:
            kept.append(text)
    return "\n".join(kept)


def _figures(text):
    return [match.group(0) for match in _FIGURE.finditer(text)]


def test_doctest_examples_are_not_read_as_timings():
    docstring = (
        "Formats a duration.\n\n"
        "    >>> _duration(0.0213)\n"
        "    '21.3 ms'\n\n"
        "It took 286 ms here.\n"
    )
    assert _figures(_without_doctests(docstring)) == ["took 286 ms"]


def test_the_pattern_finds_the_figures_it_is_for():
    for text in (
        "took 286 ms of CPU an epoch",
        "about 70 us a batch",
        "blocked for 80-500 ms in one fit",
        "measured 1.11 of the hand split's time",
        "(measured: 125 of 125 batches on one of 2 workers)",
        "staged is 3.2x faster",
        "measured 58 ms against 62 ms",
    ):
        assert _figures(text), text
    for text in (
        "Defaults to `500` (TensorFlow's default is 30 s).",
        "that waits 1 s ends the epoch.",
        "a figure that could not be measured is left out",
        "rescaled to float32 are exactly 4x and stay staged",
    ):
        assert not _figures(text), text


def test_no_machine_timings_in_comments_or_docstrings():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {figure!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in _comments_and_docstrings(path)
        for figure in _figures(text)
    ]
    assert not found, (
        "machine timings in code comments or docstrings (say why in the "
        "code; put the figures in docs/ with the command that reproduces "
        f"them): {found}"
    )
