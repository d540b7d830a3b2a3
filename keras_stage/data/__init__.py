"""The Keras-free staging engine: `stage(dataset, fn, **options)`."""

from keras_stage.data.errors import StageTimeoutError as StageTimeoutError
from keras_stage.data.options import AUTO as AUTO
from keras_stage.data.options import StageOptions as StageOptions
from keras_stage.data.staging import StagedDataset as StagedDataset
from keras_stage.data.staging import StageIterator as StageIterator
from keras_stage.data.staging import live_stages as live_stages
from keras_stage.data.staging import stage as stage
from keras_stage.data.stats import StageStats as StageStats

__all__ = [
    "AUTO",
    "StageIterator",
    "StageOptions",
    "StageStats",
    "StageTimeoutError",
    "StagedDataset",
    "live_stages",
    "stage",
]
