"""The Keras-free staging engine: `stage(dataset, fn, **options)`.

The API is `__all__`; `live_stages`, `Packer` and `resolve_device` are
internals that tests and examples import from here.
"""

from keras_stage.data import service as service
from keras_stage.data import tfio_support as tfio_support
from keras_stage.data.devices import resolve_device as resolve_device
from keras_stage.data.errors import StageTimeoutError as StageTimeoutError
from keras_stage.data.options import AUTO as AUTO
from keras_stage.data.options import StageOptions as StageOptions
from keras_stage.data.packing import Packer as Packer
from keras_stage.data.staging import StagedDataset as StagedDataset
from keras_stage.data.staging import live_stages as live_stages
from keras_stage.data.staging import stage as stage

__all__ = [
    "AUTO",
    "StageOptions",
    "StageTimeoutError",
    "StagedDataset",
    "service",
    "stage",
    "tfio_support",
]
