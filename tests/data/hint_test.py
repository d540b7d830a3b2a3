"""The hint an error from a stage carries: skip it only if one record's.

`ignored_exception_types` skips the batches that raise an error; the hint
suggests it only for the types a bad record raises (a malformed value, a
corrupt record), never for errors every batch would hit again.
"""

import pytest
import tensorflow as tf

from keras_stage.data import stage

pytestmark = pytest.mark.timeout(60)


def _first(staged_fn, name, rows=("1.5", "x")):
    """Iterates a stage of `staged_fn` over `rows` until it fails."""
    staged = stage(
        tf.data.Dataset.from_tensor_slices(list(rows)),
        staged_fn,
        capacity=1,
        num_threads=1,
        name=name,
    )
    try:
        for _ in staged:
            pass
    finally:
        staged.close()


def _skip_hint(error_type, stage_name):
    return (
        rf"\[keras_stage\] raised inside stage '{stage_name}': to skip the "
        rf"batches that fail like this, add tf\.errors\.{error_type} to the "
        r"stage's ignored_exception_types$"
    )


def _no_hint(stage_name):
    # The note ends with the stage's name: nothing suggested.
    return rf"\[keras_stage\] raised inside stage '{stage_name}'$"


def test_a_malformed_value_suggests_skipping_its_batches():
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=_skip_hint("InvalidArgumentError", "numbers"),
    ):
        _first(tf.strings.to_number, "numbers")


def test_a_corrupt_record_suggests_skipping_its_batches():
    def inflate(record):
        return tf.io.decode_compressed(record, compression_type="ZLIB")

    with pytest.raises(
        tf.errors.DataLossError, match=_skip_hint("DataLossError", "inflate")
    ):
        _first(inflate, "inflate", rows=("not zlib data",))


def test_a_failed_precondition_suggests_no_skipping():
    # A variable never initialized: every batch would fail alike.
    with tf.init_scope():
        handle = tf.raw_ops.VarHandleOp(
            dtype=tf.float32, shape=[], shared_name="keras_stage_never_set"
        )

    def read(line):
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)

    with pytest.raises(
        tf.errors.FailedPreconditionError, match=_no_hint("uninitialized")
    ):
        _first(read, "uninitialized")


def test_a_missing_resource_or_file_suggests_no_skipping():
    with pytest.raises(tf.errors.NotFoundError, match=_no_hint("files")):
        _first(tf.io.read_file, "files", rows=("/no/such/file.txt",))


def test_an_error_of_unknown_kind_suggests_no_skipping():
    def fail(line):
        # tf.py_function makes a RuntimeError an UnknownError (a ValueError
        # or TypeError an InvalidArgumentError, like a malformed value).
        raise RuntimeError("the parser's remote service is down")

    def parse(line):
        return tf.py_function(fail, [line], tf.float32)

    with pytest.raises(tf.errors.UnknownError, match=_no_hint("python")):
        _first(parse, "python")


def test_the_stages_own_closed_assertion_suggests_no_skipping():
    staged = stage(
        tf.data.Dataset.range(4), lambda x: x + 1, capacity=1, name="shut"
    )
    staged.runner.close_gate()
    try:
        with pytest.raises(
            tf.errors.InvalidArgumentError, match=_no_hint("shut")
        ) as info:
            next(iter(staged))
        # tf.data quotes the assertion's text, quotes escaped.
        assert "Stage \\'shut\\' was closed" in info.value.message
    finally:
        staged.close()
