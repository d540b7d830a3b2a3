"""`EagerIterated`: a dataset whose eager iterators are made its own way."""

import tensorflow as tf

from keras_stage import _compat


class EagerIterated(tf.data.Dataset):
    """`base` as a dataset whose eager iterators a subclass's `eager_iter`
    makes (the pool's on its current size, a staged model's kept across
    epochs); in a graph or transformed it is `base` itself."""

    def __init__(self, base):
        self._base = base
        super().__init__(_compat.dataset_variant(base))

    def _inputs(self):
        return [self._base]

    @property
    def element_spec(self):
        return self._base.element_spec

    def __iter__(self):
        if not tf.executing_eagerly():
            return iter(self._base)
        return self.eager_iter()

    def eager_iter(self):
        """The iterator an eager `iter()` of this dataset returns."""
        raise NotImplementedError
