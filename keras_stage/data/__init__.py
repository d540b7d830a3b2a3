"""The Keras-free staging engine: `stage(dataset, fn, **options)`."""

from keras_stage.data import service as service
from keras_stage.data import tfio_support as tfio_support
from keras_stage.data.devices import configure_streams as configure_streams
from keras_stage.data.devices import resolve_device as resolve_device
from keras_stage.data.errors import StageTimeoutError as StageTimeoutError
from keras_stage.data.options import AUTO as AUTO
from keras_stage.data.options import StageOptions as StageOptions
from keras_stage.data.packing import Packer as Packer
from keras_stage.data.pool import StagePool as StagePool
from keras_stage.data.staging import StagedDataset as StagedDataset
from keras_stage.data.staging import StageIterator as StageIterator
from keras_stage.data.staging import live_stages as live_stages
from keras_stage.data.staging import stage as stage
from keras_stage.data.stats import StageStats as StageStats

__all__ = [
    "AUTO",
    "Packer",
    "StageIterator",
    "StageOptions",
    "StagePool",
    "StageStats",
    "StageTimeoutError",
    "StagedDataset",
    "configure_streams",
    "live_stages",
    "resolve_device",
    "service",
    "stage",
    "tfio_support",
]
