"""Tests for keras_stage/models/iterators/kept_iterators.py, on plain pipelines.

The iterators a staged call hands Keras: deferred ones (made when first
read) and the epoch views of one long-lived iterator (whose own rules are
tests/data/epochs_test.py's). Here they run on small `range` pipelines,
with no stage; the same iterators behind `stage_data` and a real `fit` are
tests/models/data_adapters/epoch_plans_test.py's.
"""

import pytest
import tensorflow as tf

from keras_stage.data.eager_iterated import EagerIterated
from keras_stage.models.iterators import kept_iterators
from keras_stage.models.iterators.kept_iterators import (
    DeferredIterator,
    DeferredPipeline,
    DistributedEpochPipeline,
    EpochPipeline,
    EpochView,
    KeptIterator,
    resolve,
)
from tests.data.epochs_test import (
    BATCHES,
    EPOCHS,
    _epochs_source,
    _read,
    _shared,
)

pytestmark = pytest.mark.timeout(60)


# -- KeptIterator and the deferred iterators ---------------------------


class _Fixed(KeptIterator):
    def __init__(self, values):
        self.real = iter(tf.data.Dataset.from_tensor_slices(values))
        self.resolved = 0

    def resolve(self):
        self.resolved += 1
        return self.real


def test_a_resolving_iterator_reads_what_it_resolves_to():
    iterator = _Fixed([5, 6, 7])
    assert iter(iterator) is iterator
    assert int(next(iterator)) == 5
    assert int(iterator.get_next()) == 6
    assert resolve(iterator) is iterator.real
    assert iterator.resolved == 3
    with pytest.raises(NotImplementedError):
        KeptIterator().resolve()


def test_resolve_passes_other_iterators_through():
    real = iter(tf.data.Dataset.range(2))
    assert resolve(real) is real
    assert resolve(None) is None


def test_a_deferred_iterator_is_made_once_when_first_read():
    made = []
    iterator = DeferredIterator(tf.data.Dataset.range(3), made.append)
    assert iterator.element_spec == tf.TensorSpec((), tf.int64)
    assert made == []  # the spec needs no iterator
    real = iterator.resolve()
    assert iterator.resolve() is real
    assert [int(v) for v in iterator] == [0, 1, 2]
    assert len(made) == 1 and made[0] >= 0.0


def test_a_deferred_pipeline_is_an_eager_iterated_dataset():
    made = []
    pipeline = DeferredPipeline(tf.data.Dataset.range(4), made.append)
    assert isinstance(pipeline, EagerIterated)
    assert isinstance(iter(pipeline), DeferredIterator)
    assert made == []
    # Transformed, it is the pipeline itself and makes no deferred iterator.
    assert [int(v) for v in pipeline.map(lambda v: v + 1)] == [1, 2, 3, 4]
    assert made == []


def test_without_defer_the_real_iterator_is_made_and_timed_at_once():
    made = []
    pipeline = DeferredPipeline(
        tf.data.Dataset.range(2), made.append, defer=False
    )
    iterator = iter(pipeline)
    assert isinstance(iterator, tf.data.Iterator)
    assert len(made) == 1
    assert [int(v) for v in iterator] == [0, 1]


# -- EpochView and EpochPipeline --------------------------------------------


def test_an_epoch_view_reads_one_batch_per_python_read():
    shared, _ = _shared(steps_per_execution=3)
    view = EpochView(shared, "spec")
    assert iter(view) is view and view.element_spec == "spec"
    assert int(view.get_next()) == 0
    assert int(next(view)) == 1
    assert shared.read_batches == 2


def test_python_reads_of_a_view_end_with_its_epoch():
    shared, made = _shared()
    view = EpochView(shared, None)
    assert _read(view, BATCHES) == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(view)
    with pytest.raises(tf.errors.OutOfRangeError):
        view.get_next()
    assert shared.read_batches == BATCHES  # nothing of the next epoch
    assert _read(EpochView(shared, None), BATCHES) == [3, 4, 5]
    assert len(made) == 1


def _one_batch_ahead(iterator):
    # Keras's JAX trainer on an accelerator (`JAXEpochIterator.
    # _one_batch_ahead_iterator`): it reads the batch after the one it
    # yields, so it reads once past an epoch's last batch.
    ahead = None
    for batch in iterator:
        if ahead is not None:
            yield ahead
        ahead = batch
    if ahead is not None:
        yield ahead


def test_a_reader_one_batch_ahead_gets_each_epoch_whole():
    shared, made = _shared()
    pipeline = EpochPipeline(shared, _epochs_source())
    epochs = []
    for _ in range(EPOCHS):
        # Keras takes the epoch's batch count, then makes the next.
        reader = _one_batch_ahead(iter(pipeline))
        epochs.append([int(next(reader)) for _ in range(BATCHES)])
    assert epochs == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert len(made) == 1


def test_an_epoch_pipeline_is_one_epoch_to_keras():
    shared, made = _shared()
    pipeline = EpochPipeline(shared, _epochs_source())
    assert int(pipeline.cardinality()) == BATCHES
    assert pipeline.element_spec == tf.TensorSpec((), tf.int64)
    first, second = iter(pipeline), iter(pipeline)
    assert isinstance(first, EpochView)
    assert made == []  # views make nothing until read
    assert _read(first, BATCHES) == [0, 1, 2]
    assert _read(second, BATCHES) == [3, 4, 5]
    # Transformed, it is the first epoch of the long-lived pipeline.
    assert [int(v) for v in pipeline.map(lambda v: v)] == [0, 1, 2]


def test_a_long_lived_iterators_epoch_pipeline_is_built_once():
    # A later call reading on from the iterator builds no dataset.
    shared, _ = _shared()
    source = _epochs_source()
    first = kept_iterators._epoch_pipeline(shared, source)
    assert isinstance(first, EpochPipeline)
    assert kept_iterators._epoch_pipeline(shared, source) is first
    assert kept_iterators._epoch_pipeline(shared, _epochs_source()) is not first


# -- distributed epochs (a strategy of several replicas) --------------------


def test_a_distributed_views_first_python_read_is_a_peek_of_zeros():
    # Keras under a strategy reads one batch of each call's first
    # iterator in Python to build the model, then drops it: that read
    # takes nothing from the shared iterator, which the step reads next.
    shared, made = _shared()
    spec = {
        "ids": tf.TensorSpec((None, 2), tf.int64),
        "text": tf.TensorSpec((None,), tf.string),
        "ragged": tf.RaggedTensorSpec((None, None), tf.float32),
    }
    peeked = next(EpochView(shared, None, spec))
    assert peeked["ids"].shape == (0, 2) and peeked["ids"].dtype == tf.int64
    assert peeked["text"].shape == (0,) and peeked["text"].dtype == tf.string
    assert peeked["ragged"] == spec["ragged"]  # shapes and dtypes only
    assert made == [] and shared.read_batches == 0
    view = EpochView(shared, None, spec)
    assert int(next(resolve(view))) == 0  # the step reads the epoch whole
    assert [int(next(resolve(view))) for _ in range(2)] == [1, 2]
    assert len(made) == 1


def test_a_distributed_view_peeks_only_before_it_is_read():
    shared, _ = _shared()
    spec = tf.TensorSpec((None,), tf.int64)
    view = EpochView(shared, None, spec)
    assert int(next(resolve(view))) == 0
    assert int(next(view)) == 1  # a real read once the step has read
    view = EpochView(shared, None, spec)
    assert next(view).shape == (0,)
    assert [int(view.get_next()) for _ in range(3)] == [3, 4, 5]


def test_a_distributed_epoch_pipeline_is_one_epoch_to_keras():
    shared, _ = _shared()
    spec = tf.TensorSpec((None,), tf.int64)
    distributed = tf.distribute.get_strategy().experimental_distribute_dataset(
        _epochs_source()
    )
    pipeline = DistributedEpochPipeline(shared, distributed, spec)
    assert isinstance(pipeline, tf.distribute.DistributedDataset)
    assert pipeline.cardinality() == BATCHES
    assert pipeline.element_spec == distributed.element_spec
    view = iter(pipeline)
    assert isinstance(view, EpochView)
    assert next(view).shape == (0,)
    with pytest.raises(TypeError, match="reduce the dataset before"):
        pipeline.reduce(0, lambda state, value: state)
