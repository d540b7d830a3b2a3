"""keras_stage: asynchronous staging for Keras 3 input pipelines.

A `keras_stage.layers.StagedInput` first in a `keras_stage.Model` or
`Sequential` runs the model's input ahead of training, on the Keras-free
engine `keras_stage.data.stage`. `import keras_stage` also registers the
layers and models with Keras's serialization; `import keras_stage.data`
loads the engine alone, and the names that need Keras load on first use.
"""

import importlib
import sys
import typing

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as e:
    raise ImportError(
        "keras_stage needs TensorFlow 2.16-2.21 (Keras 3 with the TensorFlow "
        "backend), and it is not installed. Install the tested version with "
        "`pip install tensorflow-cpu==2.21.0` (`pip install "
        "tensorflow[and-cuda]==2.21.0` for a GPU), or run "
        '`pip install -e ".[tensorflow-cpu]"` in the keras_stage checkout.'
    ) from e

from keras_stage import data as data
from keras_stage.data.devices import configure_streams as configure_streams

# For tools that read the source (griffe, type checkers), not run it.
if typing.TYPE_CHECKING:
    from keras_stage import callbacks as callbacks
    from keras_stage import layers as layers
    from keras_stage.models import Model as Model
    from keras_stage.models import Sequential as Sequential
    from keras_stage.planner import StagePlan as StagePlan

__version__ = "0.1.0"

# The names that need Keras, by defining module (see `__getattr__`).
_KERAS_NAMES = {
    "Model": "keras_stage.models",
    "Sequential": "keras_stage.models",
    "StagePlan": "keras_stage.planner",
    "callbacks": "keras_stage.callbacks",
    "layers": "keras_stage.layers",
}

__all__ = [
    "Model",
    "Sequential",
    "StagePlan",
    "callbacks",
    "configure_streams",
    "data",
    "layers",
]


def _load_keras_names():
    for name, module in _KERAS_NAMES.items():
        imported = importlib.import_module(module)
        globals()[name] = (
            imported if module.endswith(f".{name}") else getattr(imported, name)
        )


def __getattr__(name):
    if name in _KERAS_NAMES:
        _load_keras_names()
        return globals()[name]
    raise AttributeError(f"module 'keras_stage' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(_KERAS_NAMES))


def _imported_for_the_engine_alone():
    """Whether this import is Python's first step of `import keras_stage.data`:
    only the import system's frames (`_find_and_load(name, ...)`, CPython
    internals checked by `tests/import_test.py`) say what was asked for."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_find_and_load":
            name = frame.f_locals.get("name")
            if isinstance(name, str) and name != __name__:
                return name == "keras_stage.data" or name.startswith(
                    "keras_stage.data."
                )
        frame = frame.f_back
    return False


if not _imported_for_the_engine_alone():
    _load_keras_names()
