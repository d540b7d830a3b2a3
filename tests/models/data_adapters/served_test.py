"""Tests for keras_stage/models/data_adapters/served.py: what a call's data
needs on the tf.data service."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.data.service import DISTRIBUTED_EPOCH
from keras_stage.models.data_adapters import served, stage_data

pytestmark = pytest.mark.timeout(60)

X = np.arange(20, dtype="float32").reshape(10, 2)
Y = np.arange(10, dtype="float32")


def _layer(**options):
    return keras_stage.layers.StagedInput(name="feed", num_threads=1, **options)


def _dataset(n=10, batch=4):
    return tf.data.Dataset.from_tensor_slices((X[:n], Y[:n])).batch(batch)


# -- the tf.data service ---------------------------------------------------


def test_predict_on_a_service_stages_in_this_process(caplog):
    layer = _layer(service="grpc://localhost:5050")
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        assert served.phase_overrides(layer, "predict", False) == {
            "service": None
        }
    assert "keep the order of the inputs" in caplog.text


def test_evaluation_on_a_service_reads_each_example_once():
    layer = _layer(service="grpc://localhost:5050")
    assert served.phase_overrides(layer, "test", False) == {
        "processing_mode": DISTRIBUTED_EPOCH
    }
    assert served.phase_overrides(layer, "train", False) == {}


def test_python_data_cannot_go_to_a_service():
    layer = _layer(service="grpc://localhost:5050")
    with pytest.raises(
        ValueError,
        match=(
            r"StagedInput 'feed' stages on the tf.data service at "
            r"grpc://localhost:5050, whose workers cannot run this process's "
            r"Python.*remove `service` from the StagedInput"
        ),
    ):
        served.phase_overrides(layer, "train", True)


def test_the_batch_size_after_the_service_comes_from_keras_or_the_data():
    data = stage_data(_layer(), "train", X, Y, batch_size=4)
    assert served.batch_size(data.adapter, data.source) == 4
    data.end_call()
    data = stage_data(_layer(), "test", _dataset())
    assert data.adapter.batch_size is None
    assert served.batch_size(data.adapter, data.source) == 4  # its first batch
    data.end_call()
