"""Keras fit/evaluate/predict with `StagedInput(service=...)`.

A local dispatcher and 2 workers on loopback (`LocalService`) run the data
and the SmartStage prefix; the trunk records the id of every example it
trains on, so a test can count each example per epoch.
"""

import collections
import socket

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.data.service import LocalService

NUM_EXAMPLES = 50
BATCH = 8

recorded = []


class Recorder(keras.layers.Layer):
    """In the trunk: records the ids of each batch the step trains on."""

    def call(self, inputs):
        h, ids = inputs

        def note(ids):
            recorded.extend(int(i) for i in ids.numpy())
            return np.int64(0)

        done = tf.py_function(note, [ids], tf.int64)
        with tf.control_dependencies([done]):
            return tf.identity(h)


class Epochs(keras.callbacks.Callback):
    """Marks each epoch's start in the recorded ids."""

    def on_epoch_begin(self, epoch, logs=None):
        recorded.append(-1 - epoch)


def _per_epoch(ids):
    epochs = []
    for i in ids:
        if i < 0:
            epochs.append(collections.Counter())
        else:
            epochs[-1][i] += 1
    return epochs


@pytest.fixture(scope="module")
def service():
    # The dispatcher deems a worker lost after 4 missed heartbeats, and a
    # parallel_epochs epoch ends without the elements it held: a slower
    # heartbeat keeps a worker starved of the 2 cores by the suite's other
    # processes from being lost; losing workers is what
    # tests/data/failover_test.py tests, not these fits. (The batch these
    # fits once lost under load was the re-formed last one, dropped when
    # the stage ended an epoch whose streams had all ended but whose
    # service end came late: see `failover._COMPLETE_WAIT`.)
    with LocalService(num_workers=2, heartbeat_ms=1500) as running:
        yield running


@pytest.fixture(autouse=True)
def _fresh_record():
    recorded.clear()
    yield
    recorded.clear()


def _model(service=None, processing_mode="distributed_epoch", seed=0):
    keras.utils.set_random_seed(seed)
    inputs = {
        "id": keras.Input((), dtype="int64", name="id"),
        "word": keras.Input((), dtype="string", name="word"),
    }
    staged = keras_stage.layers.StagedInput(
        capacity=4,
        num_threads=2,
        service=service,
        processing_mode=processing_mode,
        name="staged",
    )(inputs)
    words = keras.layers.StringLookup(
        vocabulary=["a", "b", "c"], name="lookup"
    )(staged["word"])
    h = keras.layers.Embedding(5, 4)(words)
    h = keras.layers.Dense(4)(h)
    h = Recorder()([h, staged["id"]])
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    return model


def _data():
    ids = np.arange(NUM_EXAMPLES, dtype="int64")
    words = np.array(["a", "b", "c", "d", "a"] * 10, dtype=object)
    return {"id": ids, "word": words}, (ids % 3).astype("float32")


def _fit(model, x, y=None, epochs=3, **kwargs):
    recorded.clear()
    history = model.fit(
        x,
        y,
        epochs=epochs,
        verbose=0,
        callbacks=[Epochs(), keras_stage.callbacks.PrefetchCallback()],
        **kwargs,
    )
    return history, _per_epoch(recorded)


@pytest.mark.timeout(180)
def test_fit_over_the_service_trains_every_example_once_per_epoch(service):
    x, y = _data()
    local_model = _model()
    _, local = _fit(local_model, x, y, batch_size=BATCH, shuffle=False)
    model = _model(service.target)
    assert list(model.get_stage_plan().staged_layers) == [
        "staged",
        "lookup",
    ]
    history, served = _fit(model, x, y, batch_size=BATCH, shuffle=True)
    once = collections.Counter(range(NUM_EXAMPLES))
    assert local == [once] * 3
    assert served == local
    assert len(history.history["loss"]) == 3
    assert all(np.isfinite(history.history["loss"]))
    # Full batches again after the workers: the same count every epoch.
    assert history.history["stage_skipped"] == [0, 0, 0]


@pytest.mark.timeout(180)
def test_a_dataset_without_a_static_batch_size_keeps_full_batches(service):
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    assert dataset.element_spec[1].shape[0] is None
    model = _model(service.target)
    _, served = _fit(model, dataset, shuffle=False)
    assert served == [collections.Counter(range(NUM_EXAMPLES))] * 3


@pytest.mark.timeout(240)
def test_calls_on_one_dataset_reuse_their_stage_on_the_service(
    service, monkeypatch
):
    # A loop of fit(epochs=1) with an evaluate after each, on one dataset
    # object each: each role's stage on the service is built once (the
    # second round's calls reuse the first's), and every call reads every
    # example once (a new service job per epoch).
    built = []
    stage = keras_stage.layers.StagedInput.stage

    def counted(self, dataset, *args, **kwargs):
        if self.stage_options.service is not None:  # not the local twin's
            built.append(kwargs.get("name"))
        return stage(self, dataset, *args, **kwargs)

    monkeypatch.setattr(keras_stage.layers.StagedInput, "stage", counted)
    x, y = _data()
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    test = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model, local = _model(service.target), _model()
    once = collections.Counter(range(NUM_EXAMPLES))
    for _ in range(2):
        _, served = _fit(model, train, epochs=1, shuffle=False)
        assert served == [once]
        recorded.clear()
        loss = model.evaluate(test, verbose=0)
        assert collections.Counter(recorded) == once
        # The service's workers order an epoch's batches as they finish
        # them: the local twin evaluates the weights trained there.
        local.set_weights(model.get_weights())
        np.testing.assert_allclose(
            loss, local.evaluate(test, verbose=0), rtol=1e-5
        )
    assert sorted(built) == ["staged_test", "staged_train"], built


@pytest.mark.timeout(180)
def test_parallel_epochs_trains_each_example_once_per_worker(service):
    x, y = _data()
    model = _model(service.target, processing_mode="parallel_epochs")
    _, served = _fit(model, x, y, epochs=2, batch_size=BATCH)
    every = collections.Counter(
        {i: service.num_workers for i in range(NUM_EXAMPLES)}
    )
    assert served == [every] * 2


@pytest.mark.timeout(180)
def test_evaluate_and_predict_match_the_local_model(service):
    x, y = _data()
    model = _model(service.target, processing_mode="parallel_epochs")
    local = _model()
    local.set_weights(model.get_weights())
    # Evaluation reads each example once, whatever the training mode.
    recorded.clear()
    loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert collections.Counter(recorded) == collections.Counter(
        range(NUM_EXAMPLES)
    )
    expected = local.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    # Predictions follow the inputs' order (predict stages locally).
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(
        predicted, local.predict(x, batch_size=BATCH, verbose=0), rtol=1e-6
    )


@pytest.mark.timeout(120)
def test_a_generator_source_is_a_clear_error(service):
    x, y = _data()

    def batches():
        for start in range(0, NUM_EXAMPLES, BATCH):
            end = start + BATCH
            yield {k: v[start:end] for k, v in x.items()}, y[start:end]

    model = _model(service.target)
    with pytest.raises(ValueError) as info:
        model.fit(batches(), epochs=1, verbose=0)
    message = str(info.value)
    assert service.target in message
    assert "tf.data.Dataset" in message
    assert "remove `service`" in message


@pytest.mark.timeout(120)
def test_an_unreachable_dispatcher_fails_the_fit_at_once():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    address = f"grpc://localhost:{port}"
    x, y = _data()
    model = _model(address)
    with pytest.raises(ConnectionError, match=address):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.timeout(120)
def test_the_service_settings_survive_saving(tmp_path):
    model = _model("grpc://10.1.2.3:5050", processing_mode="parallel_epochs")
    path = str(tmp_path / "served.keras")
    model.save(path)
    loaded = keras.saving.load_model(
        path, custom_objects={"Recorder": Recorder}
    )
    layer = loaded.get_layer("staged")
    assert layer.get_config()["service"] == "grpc://10.1.2.3:5050"
    assert layer.get_config()["processing_mode"] == "parallel_epochs"
    # Loading needs no running service; the model calls locally.
    x, _ = _data()
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)


@pytest.mark.timeout(180)
def test_a_seeded_random_layer_is_staged_on_the_service(service):
    # SmartStage numbers the batches for seeded random layers; the workers
    # run that numbering with the prefix, and a batch size is found before
    # it (a dataset without a static one).
    keras.utils.set_random_seed(0)
    inputs = {
        "id": keras.Input((), dtype="int64", name="id"),
        "x": keras.Input((3,), name="x"),
    }
    staged = keras_stage.layers.StagedInput(
        service=service.target, name="staged"
    )(inputs)
    h = keras.layers.GaussianNoise(0.1, seed=3, name="noise")(staged["x"])
    h = Recorder()([keras.layers.Dense(4)(h), staged["id"]])
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    assert list(model.get_stage_plan().staged_layers) == ["staged", "noise"]
    ids = np.arange(40, dtype="int64")
    x = np.random.default_rng(0).random((40, 3)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices(
        ({"id": ids, "x": x}, x.sum(axis=1))
    ).batch(8)
    history, served = _fit(model, dataset, epochs=2, shuffle=False)
    assert served == [collections.Counter(range(40))] * 2
    assert all(np.isfinite(history.history["loss"]))


def _worker_streams(dataset, service):
    """`(streams, batches)`: workers that computed part of one epoch.

    Each worker numbers the batches of its stream (a `scan` on the worker),
    so the streams that started are the batches numbered 0.
    """

    def number(position, element):
        return position + 1, (element, position)

    numbered = dataset.scan(tf.constant(0, tf.int64), number)
    served = numbered.apply(
        tf.data.experimental.service.distribute(
            "distributed_epoch", service.target
        )
    )
    positions = [int(p) for _, p in served]
    return positions.count(0), len(positions)


@pytest.mark.timeout(180)
def test_arrays_give_the_service_one_split_and_a_warning_says_so(
    service, caplog
):
    x, y = _data()
    adapter = keras_stage._compat.get_data_adapter(
        x=x,
        y=y,
        sample_weight=None,
        batch_size=BATCH,
        steps_per_epoch=None,
        shuffle=True,
        class_weight=None,
    )
    # What the warning is about: Keras's dataset of arrays is one split,
    # so one worker computes the whole epoch...
    batches = -(-NUM_EXAMPLES // BATCH)
    assert _worker_streams(adapter.get_tf_dataset(), service) == (1, batches)
    # ...and what it advises shares the epoch among the workers (enough
    # examples that the second worker's task starts before the first has
    # taken them all).
    rows = np.arange(4000, dtype="float32")
    advised = tf.data.Dataset.from_tensor_slices((rows, rows)).shuffle(1024)
    streams, batches = _worker_streams(advised.batch(32), service)
    assert streams == service.num_workers
    assert batches in (125, 126)  # a partial batch per worker at most
    model = _model(service.target)
    with caplog.at_level("WARNING", logger="keras_stage"):
        _fit(model, x, y, epochs=2, batch_size=BATCH)
        _fit(model, x, y, epochs=1, batch_size=BATCH)
    warned = [
        r.getMessage()
        for r in caplog.records
        if "one tf.data service split" in r.getMessage()
    ]
    assert len(warned) == 1  # once per layer
    assert "from_tensor_slices" in warned[0]
    assert "'staged'" in warned[0]
