"""The backend of a staged call: one object per Keras backend (`base.py`)."""

import keras

from keras_stage.models.backends.base import Backend
from keras_stage.models.backends.jax import JaxBackend
from keras_stage.models.backends.tensorflow import TensorFlowBackend
from keras_stage.models.backends.torch import TorchBackend
from keras_stage.models.model_state import state as model_state

# The Keras backends keras_stage stages on, by Keras's name.
BACKENDS = {
    "tensorflow": TensorFlowBackend,
    "jax": JaxBackend,
    "torch": TorchBackend,
}


def get(name=None):
    """The backend of Keras's backend `name`; defaults to the running one."""
    name = keras.backend.backend() if name is None else name
    return BACKENDS.get(name, Backend)(name)


def for_model(model):
    """`model`'s backend, chosen once, as Keras chooses its trainer class."""
    state = model_state(model)
    if state.backend is None:
        state.backend = get()
    return state.backend
