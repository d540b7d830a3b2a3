"""Keras callbacks of keras_stage."""

from keras_stage.callbacks.prefetch_callback import (
    PrefetchCallback as PrefetchCallback,
)

__all__ = ["PrefetchCallback"]
