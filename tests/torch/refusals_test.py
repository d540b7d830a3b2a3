"""What the torch backend refuses, each with the way that works; and the
options it does not use, named once."""

import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage

pytestmark = pytest.mark.timeout(300)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _model(**options):
    inputs = keras.Input(shape=(), dtype="string", name="word")
    x = keras_stage.layers.StagedInput(name="stage", **options)(inputs)
    x = keras.layers.Hashing(num_bins=8)(x)
    x = keras.layers.CategoryEncoding(num_tokens=8, output_mode="one_hot")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    return model


def _data():
    words = np.array([f"w{i % 5}" for i in range(16)], dtype=object)
    return words, np.ones((16, 1), "float32")


def test_a_tf_distribute_scope_is_refused_naming_the_tensorflow_backend():
    model = _model()
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(NotImplementedError) as raised:
            model.fit(*_data(), batch_size=8, verbose=0)
    message = str(raised.value)
    assert "OneDeviceStrategy" in message
    assert "KERAS_BACKEND=tensorflow" in message
    model.fit(*_data(), batch_size=8, verbose=0)  # outside it, it trains


def test_a_keras_distribution_is_refused_naming_jax():
    # Keras cannot make one on torch (its torch backend has no
    # distribution_lib); a value set all the same is refused.
    model = _model()
    keras.distribution.set_distribution(object())
    try:
        with pytest.raises(NotImplementedError, match="KERAS_BACKEND=jax"):
            model.fit(*_data(), batch_size=8, verbose=0)
    finally:
        keras.distribution.set_distribution(None)


RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch.distributed as dist
    import keras
    import keras_stage

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2
    )
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput()(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(np.ones((8, 2)), np.ones((8, 1)), verbose=0)
    except NotImplementedError as e:
        print("REFUSED", e)
    dist.destroy_process_group()
    """
)


def test_a_fit_in_torch_distributed_processes_is_refused(tmp_path):
    env = {**os.environ, "KERAS_BACKEND": "torch", "PYTHONPATH": str(ROOT)}
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    for process in ranks:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-3000:]
        assert "REFUSED" in out, err[-3000:]
        assert "2 torch.distributed processes" in out
        assert "DistributedDataParallel" in out


def test_device_options_are_named_as_unused_once(caplog):
    model = _model(device="/gpu:0")
    with caplog.at_level(logging.WARNING, logger="keras_stage"):
        model.fit(*_data(), batch_size=8, verbose=0)
        model.fit(*_data(), batch_size=8, verbose=0)
    warned = [r for r in caplog.records if "PyTorch backend" in r.message]
    assert len(warned) == 1
    assert "`device` and `stream` options are not used" in warned[0].message
