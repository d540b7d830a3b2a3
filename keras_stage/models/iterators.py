"""The iterators a staged call hands to Keras's epoch loop.

Keras's `EpochIterator` makes the next epoch's iterator as soon as an epoch
ends, so every call makes one more iterator than it reads, and an
iterator of a staged pipeline costs what instantiating the staged
computation costs (a trace's worth of functions, tens of milliseconds for
a tabular prefix). `DeferredPipeline` hands Keras iterators that make the
real one when first read: the step guard (`resolve`) or Keras's own
Python reads (`next`) make it; an iterator nobody reads costs nothing.
"""

import time

import tensorflow as tf

from keras_stage import _compat


class DeferredIterator:
    """An eager iterator of `pipeline`, made when first read."""

    def __init__(self, pipeline, made):
        self._pipeline = pipeline
        self._made = made
        self._iterator = None

    def resolve(self):
        """The real iterator, made now if it was not yet."""
        if self._iterator is None:
            started = time.perf_counter()
            self._iterator = iter(self._pipeline)
            self._made(time.perf_counter() - started)
        return self._iterator

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.resolve())

    def get_next(self):
        return self.resolve().get_next()

    @property
    def element_spec(self):
        return self._pipeline.element_spec


def resolve(iterator):
    """`iterator`, or the real iterator a `DeferredIterator` stands for."""
    if isinstance(iterator, DeferredIterator):
        return iterator.resolve()
    return iterator


class DeferredPipeline(tf.data.Dataset):
    """`pipeline` as a dataset whose eager iterators are `DeferredIterator`s.

    Used as a dataset otherwise (inside a `tf.function`, transformed) it is
    `pipeline` itself. `made(seconds)` is told how long each real
    iterator took to make. With `defer=False` the real iterators are made
    when Keras asks for them, and only timed.
    """

    def __init__(self, pipeline, made, defer=True):
        self._pipeline = pipeline
        self._made = made
        self._defer = defer
        super().__init__(_compat.dataset_variant(pipeline))

    def _inputs(self):
        return [self._pipeline]

    @property
    def element_spec(self):
        return self._pipeline.element_spec

    def __iter__(self):
        if not tf.executing_eagerly():
            return iter(self._pipeline)
        iterator = DeferredIterator(self._pipeline, self._made)
        return iterator if self._defer else iterator.resolve()
