"""Errors a stage raises, and how stage errors keep their type."""

import tensorflow as tf

_MARK = "[keras_stage]"


class StageTimeoutError(tf.errors.DeadlineExceededError):
    """The consumer waited longer than the stage's `timeout` for an element.

    A subclass of `tf.errors.DeadlineExceededError`, so code that handles
    TensorFlow deadlines handles it too.
    """

    def __init__(self, message):
        super().__init__(None, None, message)


def annotate(error, stage_name, hint=None):
    """`error` re-created with the stage named in its message, of the same
    type, so `except` clauses written for plain tf.data keep working."""
    message = getattr(error, "message", None)
    if message is None or _MARK in message:
        return error
    note = f"{_MARK} raised inside stage '{stage_name}'"
    if hint:
        note += f": {hint}"
    text = f"{message}\n{note}"
    if isinstance(error, tf.errors.OpError):
        args = (error.node_def, error.op, text)
    else:
        args = (text,)
    try:
        return type(error)(*args)
    except TypeError:  # a subclass with its own signature
        return error
