"""Model classes of keras_stage."""

from keras_stage.models.model import Functional as Functional
from keras_stage.models.model import Model as Model
from keras_stage.models.sequential import Sequential as Sequential

__all__ = ["Functional", "Model", "Sequential"]
