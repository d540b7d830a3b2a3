"""Op determinism for one test, and the process as it was afterwards.

`tf.config.experimental.enable_op_determinism()` is process-wide and takes
no argument: TensorFlow's public API cannot turn it off. Its own tests do
with the private `tensorflow.python.framework.config` functions (see
`test_util.deterministic_ops`), as `op_determinism` does, so that the rest
of the suite runs as it would alone.
"""

import contextlib

import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

from keras_stage.data import pipeline_model, stats


def enabled():
    """Whether op determinism is on (TensorFlow's private getter)."""
    return tf_config.is_op_determinism_enabled()


@contextlib.contextmanager
def op_determinism(note_again=True):
    """Op determinism on within; off after, unless it was on before.

    With `note_again`, the stats' once-per-process note is logged again
    within (`stats.NO_CLOCK_NOTE`), so a test can look for it.
    """
    was = enabled()
    noted = stats._no_clock_noted
    if note_again:
        stats._no_clock_noted = False
    tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        if not was:
            tf_config.disable_op_determinism()
        stats._no_clock_noted = noted


# Figures under op determinism come from tf.data's model of the stage's
# iterators, which TensorFlow 2.16 (the tfio venv) cannot read: there they
# stay not measured (`pipeline_model.AVAILABLE`, whose own test fails if a
# later TensorFlow loses it).
needs_tf_data_model = pytest.mark.skipif(
    not pipeline_model.AVAILABLE,
    reason="tf.data.experimental.get_model_proto needs TensorFlow 2.17+",
)
