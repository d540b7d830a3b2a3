"""Tests for keras_stage/data/errors.py: stage errors keep their type.

`annotate` re-creates an error with the stage named in its message (the
user's `except` clauses written for plain tf.data keep working), and
`StageTimeoutError` is a TensorFlow deadline. How the runner raises them is
tests/data/runner_test.py's.
"""

import pytest
import tensorflow as tf

from keras_stage.data import StageTimeoutError
from keras_stage.data.errors import annotate


class _MessageError(Exception):
    """A Python error carrying `message`, as some libraries' errors do."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message


class _TwoArgumentError(Exception):
    """A Python error with `message` whose constructor takes more."""

    def __init__(self, message, code):
        super().__init__(message)
        self.message = message
        self.code = code


class _OwnSignatureOpError(tf.errors.OpError):
    """An `OpError` subclass that cannot be built from (node_def, op, text)."""

    def __init__(self, message):
        super().__init__(None, None, message, tf.errors.UNKNOWN)


def test_annotated_op_error_keeps_code_node_and_original_text_first():
    error = tf.errors.ResourceExhaustedError(None, None, "out of memory")
    annotated = annotate(error, "decode")
    assert annotated is not error
    assert type(annotated) is tf.errors.ResourceExhaustedError
    assert annotated.error_code == tf.errors.RESOURCE_EXHAUSTED
    assert annotated.node_def is None and annotated.op is None
    first, note = annotated.message.split("\n")
    assert first == "out of memory"
    assert note == "[keras_stage] raised inside stage 'decode'"


def test_annotated_error_is_caught_by_the_clause_for_its_type():
    error = tf.errors.InvalidArgumentError(None, None, "bad record")
    with pytest.raises(tf.errors.InvalidArgumentError, match="'csv'.*fix"):
        raise annotate(error, "csv", hint="fix the record")


def test_an_empty_hint_adds_nothing_after_the_stage_name():
    error = tf.errors.NotFoundError(None, None, "no file")
    annotated = annotate(error, "read", hint="")
    assert annotated.message.endswith("raised inside stage 'read'")


def test_the_original_error_is_left_unchanged():
    error = tf.errors.DataLossError(None, None, "corrupt")
    annotate(error, "read", hint="re-download")
    assert error.message == "corrupt"


def test_a_python_error_with_a_message_is_annotated_with_its_type():
    annotated = annotate(_MessageError("bad row"), "parse", hint="skip it")
    assert type(annotated) is _MessageError
    assert str(annotated).startswith("bad row\n")
    assert str(annotated).endswith(
        "[keras_stage] raised inside stage 'parse': skip it"
    )


@pytest.mark.parametrize(
    "error",
    [
        _TwoArgumentError("bad row", 3),
        _OwnSignatureOpError("own signature"),
        StageTimeoutError("waited too long"),
    ],
    ids=["python", "op_error", "stage_timeout"],
)
def test_errors_that_cannot_be_recreated_are_returned_as_they_are(error):
    assert annotate(error, "parse") is error


def test_an_error_from_an_inner_stage_keeps_the_innermost_name():
    inner = annotate(tf.errors.UnknownError(None, None, "boom"), "inner")
    outer = annotate(inner, "outer")
    assert outer is inner
    assert "'inner'" in outer.message and "'outer'" not in outer.message


def test_stage_timeout_error_is_caught_as_a_tensorflow_deadline():
    with pytest.raises(tf.errors.DeadlineExceededError, match="^waited 5 s$"):
        raise StageTimeoutError("waited 5 s")
    error = StageTimeoutError("waited 5 s")
    assert isinstance(error, tf.errors.OpError)
    assert error.node_def is None and error.op is None
