"""Tests for keras_stage/models/data_adapters/staged_data.py.

What `stage_data` makes of the data. For arrays Keras's own adapter
batches (so labels stay aligned) and the stage is built for the call; a
user's `tf.data.Dataset` is staged as it is, and kept for later calls on
it; a dataset the user staged already is used as it is. The epochs a stage
runs on one iterator (`epochs=`) and every case that refuses them are
tests/models/data_adapters/epoch_plans_test.py's.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.models.backends.tensorflow import default_strategy
from keras_stage.models.data_adapters import stage_data
from keras_stage.models.data_adapters.staged_data import (
    StageCosts,
    StagedData,
)
from keras_stage.models.iterators.kept_iterators import (
    DeferredIterator,
    DeferredPipeline,
)

pytestmark = pytest.mark.timeout(60)

X = np.arange(20, dtype="float32").reshape(10, 2)
Y = np.arange(10, dtype="float32")


def _layer(**options):
    return keras_stage.layers.StagedInput(name="feed", num_threads=1, **options)


def _dataset(shuffle=False):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y))
    if shuffle:
        dataset = dataset.shuffle(10, seed=1)
    return dataset.batch(4)


def _labels(pipeline):
    return [batch[1].numpy().tolist() for batch in pipeline]


# -- arrays -----------------------------------------------------------------


def test_arrays_are_batched_by_keras_and_staged_for_the_call():
    data = stage_data(_layer(), "train", X, Y, batch_size=4)
    assert isinstance(data, StagedData)
    assert data.staged.name == "feed_train"
    assert data.owned and data.defers
    assert data.adapter.num_batches == 3
    assert data.split is None and not data.in_step
    assert not data.long_lived and data.epochs is None
    assert data.kept is None
    assert data.element_spec == (
        tf.TensorSpec((None, 2), tf.float32),
        tf.TensorSpec((None,), tf.float32),
    )
    pipeline = data.pipeline
    assert isinstance(pipeline, DeferredPipeline)
    # Keras knows the batch count of arrays: the dataset says it too.
    assert int(pipeline.cardinality()) == 3
    batches = list(pipeline)
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    for features, labels in batches:  # each label with its inputs
        np.testing.assert_array_equal(features.numpy()[:, 0], 2 * labels)
    data.end_call()


def test_shuffled_arrays_keep_labels_with_their_inputs():
    data = stage_data(_layer(), "train", X, Y, batch_size=4, shuffle=True)
    seen = []
    for features, labels in data.pipeline:
        np.testing.assert_array_equal(features.numpy()[:, 0], 2 * labels)
        seen += labels.numpy().tolist()
    assert sorted(seen) == Y.tolist()
    data.end_call()


def test_predict_reads_the_stage_in_python_through_its_own_iterator():
    data = stage_data(_layer(), "predict", X, batch_size=4)
    assert data.staged.name == "feed_predict"
    eager = data.eager_dataset
    assert isinstance(eager, DeferredPipeline)
    iterator = iter(eager)
    assert isinstance(iterator, DeferredIterator)
    assert [b.shape for b in iterator] == [(4, 2), (4, 2), (2, 2)]
    data.end_call()


def test_made_iterators_are_reported_once_each():
    made = []
    costs = StageCosts(on_iterator=made.append)
    data = stage_data(_layer(), "train", X, Y, batch_size=4, costs=costs)
    unread = iter(data.pipeline)  # Keras's next-epoch iterator
    assert isinstance(unread, DeferredIterator) and made == []
    assert len(_labels(data.pipeline)) == 3
    assert len(made) == 1
    data.end_call()


# -- datasets -----------------------------------------------------------------


def test_a_dataset_is_staged_as_it_is():
    data = stage_data(_layer(), "test", _dataset())
    assert data.owned
    assert _labels(data.pipeline) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # It draws nothing when an iterator starts: iterators made when read.
    assert data.defers
    data.end_call()


def test_a_dataset_that_draws_per_iterator_gets_iterators_made_at_once():
    data = stage_data(_layer(), "test", _dataset(shuffle=True))
    assert not data.defers
    assert isinstance(iter(data.pipeline), tf.data.Iterator)
    data.end_call()


def test_a_dataset_of_unknown_length_is_staged_without_a_count():
    dataset = _dataset().filter(lambda x, y: tf.reduce_all(y >= 0))
    data = stage_data(_layer(), "test", dataset)
    assert data.adapter.num_batches is None
    assert int(data.pipeline.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    assert len(_labels(data.pipeline)) == 3
    data.end_call()


def test_a_later_call_on_the_same_dataset_runs_the_kept_stage():
    layer, dataset, kept = _layer(), _dataset(), {}
    first = stage_data(layer, "test", dataset, kept=kept)
    assert kept == {"test": first.kept} and first.kept.in_use
    first.end_call()
    assert not first.kept.in_use
    second = stage_data(layer, "test", dataset, kept=kept)
    assert second.staged is first.staged
    assert _labels(second.pipeline) == _labels(dataset)  # gate reopened
    second.end_call()
    other = stage_data(layer, "test", _dataset(), kept=kept)
    assert other.staged is not first.staged  # another dataset object
    other.end_call()


def test_a_call_nested_in_one_running_the_kept_stage_builds_its_own():
    layer, dataset, kept = _layer(), _dataset(), {}
    outer = stage_data(layer, "test", dataset, kept=kept)
    inner = stage_data(layer, "test", dataset, kept=kept)
    assert inner.staged is not outer.staged
    assert inner.kept is None and kept["test"] is outer.kept
    inner.end_call()
    outer.end_call()


def test_arrays_are_never_kept():
    kept = {}
    data = stage_data(_layer(), "train", X, Y, batch_size=4, kept=kept)
    assert kept == {} and data.kept is None
    data.end_call()


# -- a dataset staged by the user -------------------------------------------


def test_a_user_staged_dataset_is_used_as_it_is(caplog):
    staged = keras_stage.data.stage(_dataset(), name="mine", num_threads=1)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        data = stage_data(_layer(capacity=3), "train", staged, epochs=2)
    assert data.staged is staged and not data.owned
    assert data.adapter is None
    assert data.long_lived_refusal == "the data is a user's staged dataset"
    assert "its own options are used, not those of StagedInput 'feed'" in (
        caplog.text
    )
    data.end_call()
    assert _labels(staged)[0] == [0, 1, 2, 3]  # still usable after the call
    staged.close()


@pytest.mark.parametrize(
    "y, sample_weight, received",
    [(Y, None, "y=ndarray, sample_weight=NoneType"), (None, Y, "y=NoneType")],
)
def test_labels_beside_a_user_staged_dataset_are_rejected(
    y, sample_weight, received
):
    staged = keras_stage.data.stage(_dataset(), num_threads=1)
    with pytest.raises(ValueError, match="pass labels and sample weights") as e:
        stage_data(_layer(), "train", staged, y, sample_weight)
    assert received in str(e.value)
    staged.close()


# -- strategies -------------------------------------------------------------


def test_only_the_default_strategy_iterates_through_python():
    assert default_strategy(None)
    assert default_strategy(tf.distribute.get_strategy())
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    assert not default_strategy(strategy)
    with strategy.scope():
        assert not default_strategy(tf.distribute.get_strategy())


# -- one iterator across calls ----------------------------------------------


def _read(data):
    """One epoch as Keras reads it: its view, resolved by the step."""
    view = iter(data.pipeline)
    return [
        view.get_next()[1].numpy().tolist()
        for _ in range(data.adapter.num_batches)
    ]


def test_calls_on_a_kept_stage_read_on_from_one_iterator():
    layer, dataset, kept = _layer(), _dataset(), {}
    made = []
    for _ in range(3):
        costs = StageCosts(on_iterator=made.append)
        data = stage_data(
            layer, "test", dataset, epochs=1, kept=kept, costs=costs
        )
        assert data.long_lived and data.kept.spans_calls
        assert data.carried is bool(made)  # the first call makes it
        assert _read(data) == _labels(dataset)
        assert data.end_call() is None  # nothing torn down
        assert data.kept.carries() and not data.kept.in_use
    assert len(made) == 1


def test_an_unseeded_shuffle_runs_on_with_every_example_once_an_epoch():
    layer, kept = _layer(), {}
    tf.random.set_seed(None)  # no global seed: the shuffle has none
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(10).batch(4)
    orders = []
    for _ in range(3):
        data = stage_data(layer, "train", dataset, epochs=2, kept=kept)
        assert data.kept.spans_calls
        for _ in range(2):
            epoch = sum(_read(data), [])
            assert sorted(epoch) == Y.tolist()
            orders.append(epoch)
        data.end_call()
    assert kept["train"]._shared.iterators_made == 1
    assert len({tuple(order) for order in orders}) > 1  # reshuffled


def test_a_seeded_shuffle_ends_its_iterator_with_the_call():
    # Its orders follow the iterators plain Keras makes: not run on.
    layer, kept = _layer(), {}
    data = stage_data(
        layer, "train", _dataset(shuffle=True), epochs=2, kept=kept
    )
    assert data.long_lived and not data.kept.spans_calls
    data.end_call()
    assert not data.kept.carries()


def test_a_call_that_leaves_its_epoch_early_is_not_run_on():
    layer, dataset, kept = _layer(), _dataset(), {}
    first = stage_data(layer, "test", dataset, epochs=1, kept=kept)
    view = iter(first.pipeline)
    view.get_next()  # one batch of three: the call ends early
    assert first.end_call() is not None  # its iterator torn down
    assert not first.kept.carries()
    second = stage_data(layer, "test", dataset, epochs=1, kept=kept)
    assert second.staged is first.staged and not second.carried
    assert _read(second) == _labels(dataset)  # from its start again
    second.end_call()


def test_another_dataset_retires_the_kept_iterator():
    layer, kept = _layer(), {}
    first = stage_data(layer, "test", _dataset(), epochs=1, kept=kept)
    _read(first)
    first.end_call()
    shared = first.kept._shared
    assert not shared.closed
    other = stage_data(layer, "test", _dataset(), epochs=1, kept=kept)
    assert shared.closed and kept["test"] is other.kept
    assert not first.staged.runner._gate.numpy()  # counts nothing more
    other.end_call()
