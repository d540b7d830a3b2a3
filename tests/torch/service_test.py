"""`StagedInput(service=...)` feeding Keras's torch trainer.

A local dispatcher and 2 workers on loopback (`LocalService`) run the data
and the SmartStage prefix; the torch trunk, eager, records the id of every
example it trains on, so a test can count each example per epoch, as the
TensorFlow and JAX tests do (tests/models/service_fit_test.py,
tests/jax/service_test.py).
"""

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
        h, ids = inputs
        recorded.extend(int(i) for i in keras.ops.convert_to_numpy(ids))
        return h


class Epochs(keras.callbacks.Callback):
    """Marks each epoch's start in the recorded ids (from the fit's start:
    Keras's torch build runs the trunk on placeholder batches before)."""

    def on_train_begin(self, logs=None):
        recorded.clear()

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
    if keras.backend.backend() != "torch":
        pytest.skip("runs on torch: `make test-torch`")
    with LocalService(num_workers=2) as local:
        yield local


def model_on(service_target):
    keras.utils.set_random_seed(3)
    words = keras.Input(shape=(), dtype="string", name="word")
    ids = keras.Input(shape=(), dtype="int32", name="id")
    staged = keras_stage.layers.StagedInput(service=service_target)(
        {"word": words, "id": ids}
    )
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


def test_evaluate_over_the_service_equals_the_local_model(service):
    served = model_on(service.target)
    local = model_on(None)
    local.set_weights(served.get_weights())
    data = dataset()
    assert served.evaluate(data, verbose=0) == pytest.approx(
        local.evaluate(data, verbose=0), rel=1e-6
    )
