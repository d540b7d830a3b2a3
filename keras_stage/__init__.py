"""keras_stage: asynchronous staging for Keras 3 input pipelines.

Three lines make a Keras model's input run ahead of training: a
`keras_stage.layers.StagedInput` first in the model, a
`keras_stage.callbacks.PrefetchCallback` in `fit` (added for you when
omitted), and `keras_stage.Model`/`Sequential` in place of Keras's.
`keras_stage.data.stage` is the Keras-free engine underneath.
"""

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

from keras_stage import callbacks as callbacks
from keras_stage import data as data
from keras_stage import layers as layers
from keras_stage.data.devices import configure_streams as configure_streams
from keras_stage.models import Model as Model
from keras_stage.models import Sequential as Sequential
from keras_stage.planner import StagePlan as StagePlan

__version__ = "0.1.0"

__all__ = [
    "Model",
    "Sequential",
    "StagePlan",
    "callbacks",
    "configure_streams",
    "data",
    "layers",
]
