"""Griffe extension: the stage options' `Args:` entries, from their table.

`keras_stage.data.stage`, `StagedInput` and `StageOptions` take the same
stage options, documented once in `keras_stage.data.options.OPTIONS`. Their
docstrings hold a `{stage_options}` line that `document_options` fills in
when the module is imported. griffe reads the source, not the imported
objects, so this extension fills the line in with the same function: the
site and `help()` show the same text.
"""

import griffe


def _objects(module):
    """The classes and functions defined in `module`, recursively."""
    for member in module.members.values():
        if member.is_alias:
            continue  # documented where it is defined
        if member.is_module or member.is_class:
            yield from _objects(member)
        if member.is_class or member.is_function:
            yield member


class StageOptionsDocs(griffe.Extension):
    """Fills in `{stage_options}` lines once the package is loaded."""

    def on_package(self, *, pkg, **kwargs):
        if pkg.name != "keras_stage":
            return
        # Imports TensorFlow: the table's defaults are TensorFlow's classes.
        from keras_stage.data import options

        for obj in _objects(pkg):
            text = None if obj.docstring is None else obj.docstring.value
            if text is None or options.OPTIONS_MARKER not in text:
                continue
            parameters = [p.name for p in obj.parameters]
            obj.docstring.value = options.options_docstring(text, parameters)
