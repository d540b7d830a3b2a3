"""The data path: from what users pass to fit/evaluate/predict to a stage.

One adapter per input type, each returning the call's `StagedData`
(`staged_data.build`): `arrays` (in-memory arrays, in Keras's batches and
order), `datasets` (a `tf.data.Dataset`, staged by the user or not) and
`python_sources` (generators and `keras.utils.PyDataset`). `stage_data`
picks one, as Keras's `get_data_adapter` does; `epoch_plans` decides
whether a call's epochs share one iterator, `served` what the tf.data
service needs.
"""

import tensorflow as tf

from keras_stage.data.staging import StagedDataset
from keras_stage.models import backends
from keras_stage.models.data_adapters import (
    arrays,
    datasets,
    python_sources,
    served,
)
from keras_stage.models.data_adapters.staged_data import StageRequest


def stage_data(layer, phase, x, y=None, sample_weight=None, **kwargs):
    """The `StagedData` of one call's `x` (with `y`, `sample_weight`) for
    its `phase`; `**kwargs`: the rest of its `StageRequest` (`backend`
    defaults to the running backend's, `role` to `phase`)."""
    kwargs.update(y=y, sample_weight=sample_weight)
    if kwargs.get("backend") is None:
        kwargs["backend"] = backends.get()
    if kwargs.get("role") is None:
        kwargs["role"] = phase
    if isinstance(x, StagedDataset):
        return datasets.stage_staged(StageRequest(layer, phase, x, **kwargs))
    python = python_sources.is_python_source(x)
    request = StageRequest(
        layer,
        phase,
        x,
        overrides=served.phase_overrides(layer, phase, python),
        **kwargs,
    )
    if isinstance(x, tf.data.Dataset):
        return datasets.stage(request)
    if python:
        return python_sources.stage(request)
    return arrays.stage(request)
