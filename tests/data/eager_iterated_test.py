"""Tests for keras_stage/data/eager_iterated.py: the `EagerIterated` contract.

An `EagerIterated` is its base dataset everywhere but in an eager `iter()`,
which its subclass's `eager_iter` answers. The subclasses the models use
(`DeferredPipeline`, `EpochPipeline`) are tested in
tests/models/iterators/kept_iterators_test.py.
"""

import pytest
import tensorflow as tf

from keras_stage.data.eager_iterated import EagerIterated

pytestmark = pytest.mark.timeout(60)


class _Counted(EagerIterated):
    """Eager iterators over `base`, counted; each yields `(tag, element)`."""

    def __init__(self, base, tag):
        self.tag = tag
        self.made = 0
        super().__init__(base)

    def eager_iter(self):
        self.made += 1
        return ((self.tag, int(v)) for v in iter(self._base))


class _NoEagerIter(EagerIterated):
    pass


def _base():
    return tf.data.Dataset.range(4)


def test_an_eager_iter_is_made_by_the_subclass():
    dataset = _Counted(_base(), "mine")
    assert list(dataset) == [("mine", 0), ("mine", 1), ("mine", 2), ("mine", 3)]
    assert dataset.made == 1


def test_without_eager_iter_an_eager_iter_is_refused():
    with pytest.raises(NotImplementedError):
        iter(_NoEagerIter(_base()))


def test_it_is_a_dataset_with_the_base_spec_and_cardinality():
    base = tf.data.Dataset.range(6).batch(4)
    dataset = _Counted(base, "t")
    assert isinstance(dataset, tf.data.Dataset)
    assert dataset.element_spec == base.element_spec
    assert int(dataset.cardinality()) == 2


def test_transformed_it_is_the_base_and_makes_no_eager_iterator():
    dataset = _Counted(_base(), "t")
    doubled = dataset.map(lambda v: 2 * v)
    assert [int(v) for v in doubled] == [0, 2, 4, 6]
    assert dataset.made == 0


def test_inside_a_tf_function_it_iterates_the_base():
    dataset = _Counted(_base(), "t")

    @tf.function
    def total():
        result = tf.constant(0, tf.int64)
        for v in dataset:
            result += v
        return result

    assert int(total()) == 6
    assert dataset.made == 0
