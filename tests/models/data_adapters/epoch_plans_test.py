"""Tests for keras_stage/models/data_adapters/epoch_plans.py.

Which calls' epochs share one iterator: the refusals of a strategy here;
the epochs a stage runs on one iterator and every case that refuses them
are tests/models/data_adapters/epoch_sources_test.py's, through
`stage_data(epochs=...)`.
"""

import pytest
import tensorflow as tf

from keras_stage.models.data_adapters.epoch_plans import strategy_refusal

pytestmark = pytest.mark.timeout(60)


class _Replicas:
    """What `strategy_refusal` reads of a strategy of several replicas."""

    num_replicas_in_sync = 2


def test_which_strategies_let_keras_read_views_of_one_iterator():
    plain = tf.data.Dataset.range(8).batch(2)
    assert strategy_refusal(None, plain) is None
    assert "one replica" in strategy_refusal(
        tf.distribute.OneDeviceStrategy("/cpu:0"), plain
    )
    assert strategy_refusal(_Replicas(), plain) is None
    assert strategy_refusal(_Replicas(), None) is None  # in-memory arrays
    # An order that follows the iterators made: Keras's extra one a call
    # would take a draw.
    seeded = tf.data.Dataset.range(8).shuffle(8, seed=1).batch(2)
    assert "seeded draws" in strategy_refusal(_Replicas(), seeded)
    # No seed at all (the suite's global one cleared): no order to keep.
    tf.random.set_seed(None)
    unseeded = tf.data.Dataset.range(8).shuffle(8).batch(2)
    assert strategy_refusal(_Replicas(), unseeded) is None
