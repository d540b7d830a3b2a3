"""Griffe extension: Keras-style `Example:` sections as doctest examples.

keras_stage writes examples the Keras way (STYLE.md): an `Example:` line,
a blank line, then `>>>` lines at the docstring's own indentation. Google
style, as griffe parses it, wants an indented `Examples:` section, and
reads the Keras form as an admonition of Markdown text, where `>>>` turns
into quotes and `[[1, 2]]` into a broken link. This extension rewrites the
docstring text before it is parsed (the source files are not touched): the
header becomes `Examples:` and the doctest paragraphs after it are
indented under it, so they render as Python console blocks.
"""

import griffe

_HEADER = "Example:"
_PROMPT = ">>>"


def keras_examples_to_google(text):
    """`text` with each Keras-style example indented under `Examples:`."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if line.strip() != _HEADER:
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out[-1] = f"{indent}Examples:"
        # Doctest paragraphs: each starts with a prompt and ends at a blank
        # line (doctest's own rule); prose after them stays where it is.
        while True:
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j == len(lines) or not lines[j].lstrip().startswith(_PROMPT):
                break
            out.extend(lines[i:j])
            while j < len(lines) and lines[j].strip():
                out.append(f"{indent}    {lines[j][len(indent) :]}")
                j += 1
            i = j
    return "\n".join(out)


class KerasExamples(griffe.Extension):
    """Rewrites `Example:` sections of every docstring griffe loads."""

    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = keras_examples_to_google(obj.docstring.value)
