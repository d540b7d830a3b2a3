"""Keras layers of keras_stage."""

from keras_stage.layers.staged_input import StagedInput as StagedInput

__all__ = ["StagedInput"]
