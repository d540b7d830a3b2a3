"""`StagedInput(service=...)` feeding Keras's JAX trainer.

A local dispatcher and 2 workers on loopback (`LocalService`) run the data
and the SmartStage prefix; the JAX trunk records the id of every example
it trains on (`jax.debug.callback` in the jitted step), so a test can
count each example per epoch, as the TensorFlow tests do
(tests/models/service_fit_test.py).
"""

import socket

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.data.service import LocalService

pytestmark = pytest.mark.timeout(300)

NUM_EXAMPLES = 48
BATCH = 8
VOCAB = [f"w{i}" for i in range(20)]

recorded = []


class Recorder(keras.layers.Layer):
    """In the trunk: records the ids of each batch the step trains on."""

    def call(self, inputs):
        import jax

        h, ids = inputs
        jax.debug.callback(
            lambda ids: recorded.extend(int(i) for i in np.ravel(ids)), ids
        )
        return h


class Epochs(keras.callbacks.Callback):
    """Marks each epoch's start in the recorded ids."""

    def on_epoch_begin(self, epoch, logs=None):
        recorded.append(-1 - epoch)


def per_epoch(ids):
    epochs = []
    for i in ids:
        if i < 0:
            epochs.append([])
        else:
            epochs[-1].append(i)
    return epochs


@pytest.fixture(scope="module")
def service():
    if keras.backend.backend() != "jax":
        pytest.skip("runs on JAX: `make test-jax`")
    with LocalService(num_workers=2) as local:
        yield local


def model_on(service_target, processing_mode="distributed_epoch"):
    keras.utils.set_random_seed(3)
    words = keras.Input(shape=(), dtype="string", name="word")
    ids = keras.Input(shape=(), dtype="int32", name="id")
    staged = keras_stage.layers.StagedInput(
        service=service_target, processing_mode=processing_mode
    )({"word": words, "id": ids})
    x = keras.layers.StringLookup(vocabulary=VOCAB, name="lookup")(
        staged["word"]
    )
    x = keras.layers.Embedding(len(VOCAB) + 1, 4, name="emb")(x)
    x = Recorder(name="recorder")([x, staged["id"]])
    model = keras_stage.Model(
        {"word": words, "id": ids}, keras.layers.Dense(1, name="out")(x)
    )
    model.compile("sgd", "mse", smart_stage=True)
    return model


def dataset():
    ids = np.arange(NUM_EXAMPLES, dtype="int32")
    x = {"word": [f"w{i % 23}" for i in ids], "id": ids}
    y = (ids % 2).astype("float32")[:, None]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def test_fit_over_the_service_trains_every_example_once_per_epoch(service):
    model = model_on(service.target)
    recorded.clear()
    history = model.fit(
        dataset(), epochs=2, callbacks=[Epochs()], shuffle=False, verbose=0
    )
    assert model.get_stage_plan().staged_layers[-1] == "lookup"
    epochs = per_epoch(recorded)
    assert len(epochs) == 2
    for seen in epochs:
        assert sorted(seen) == list(range(NUM_EXAMPLES))
    assert history.history["stage_service_delivered"] == [NUM_EXAMPLES] * 2


def test_parallel_epochs_trains_each_example_once_per_worker(service):
    model = model_on(service.target, processing_mode="parallel_epochs")
    recorded.clear()
    model.fit(
        dataset(), epochs=1, callbacks=[Epochs()], shuffle=False, verbose=0
    )
    (seen,) = per_epoch(recorded)
    assert sorted(seen) == sorted(list(range(NUM_EXAMPLES)) * 2)


def test_evaluate_over_the_service_equals_the_local_model(service):
    served = model_on(service.target)
    local = model_on(None)
    local.set_weights(served.get_weights())
    data = dataset()
    assert served.evaluate(data, verbose=0) == pytest.approx(
        local.evaluate(data, verbose=0), rel=1e-6
    )


def test_an_unreachable_dispatcher_fails_the_fit_at_once():
    if keras.backend.backend() != "jax":
        pytest.skip("runs on JAX: `make test-jax`")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends
    model = model_on(f"grpc://127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match="Cannot reach"):
        model.fit(dataset(), epochs=1, shuffle=False, verbose=0)
