"""SmartStage on the JAX backend: string-input models train, as hand-split.

Plain Keras on JAX cannot fit a model with string inputs; keras_stage runs
its preprocessing prefix in tf.data and trains the trunk as Keras's JAX
step. These tests hold it to the hand-split expert pipeline (the same
preprocessing layers in `dataset.map`, a numeric trunk model): the same
weights after several epochs, with and without shuffling.
"""

import json
import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from tests.helpers import (
    check_a_tensorflow_ops_layer_is_staged,
    staged_prefix_outputs,
)

pytestmark = pytest.mark.timeout(300)

THAL = ("normal", "fixed", "reversible")
NUMERIC = ("age", "chol")


def make_data(count, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        name: rng.normal(50 + 30 * i, 10, (count, 1)).astype("float32")
        for i, name in enumerate(NUMERIC)
    }
    thal = rng.integers(len(THAL), size=count)
    x["thal"] = np.array([THAL[i] for i in thal], dtype=object)
    x["cp"] = rng.integers(5, size=(count, 1)).astype("int64")
    score = (x["age"][:, 0] - 50) / 10 + thal - 1
    return x, (score > 0).astype("float32")[:, None]


def preprocessing(adapt):
    """The preprocessing layers, adapted: name -> layer."""
    layers = {}
    for name in NUMERIC:
        layers[name] = keras.layers.Normalization(name=f"{name}_norm")
        layers[name].adapt(adapt[name])
    layers["thal"] = keras.layers.StringLookup(
        vocabulary=list(THAL), output_mode="one_hot", name="thal_ids"
    )
    layers["cp"] = keras.layers.IntegerLookup(
        vocabulary=list(range(5)), output_mode="one_hot", name="cp_ids"
    )
    return layers


def trunk_layers():
    return (
        keras.layers.Concatenate(name="features"),
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dense(1, activation="sigmoid", name="out"),
    )


def raw_inputs():
    inputs = {name: keras.Input(shape=(1,), name=name) for name in NUMERIC}
    inputs["thal"] = keras.Input(shape=(), dtype="string", name="thal")
    inputs["cp"] = keras.Input(shape=(1,), dtype="int64", name="cp")
    return inputs


def staged_model(adapt, staged_input=True, **options):
    keras.utils.set_random_seed(7)
    inputs = raw_inputs()
    x = (
        keras_stage.layers.StagedInput(**options)(inputs)
        if staged_input
        else inputs
    )
    pre = preprocessing(adapt)
    columns = [pre[name](x[name]) for name in sorted(pre)]
    concat, hidden, out = trunk_layers()
    model = keras_stage.Model(inputs, out(hidden(concat(columns))))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        smart_stage=True,
    )
    return model


def expert(adapt):
    """The hand split: `(preprocess, trunk)`, with the same initial weights."""
    keras.utils.set_random_seed(7)
    pre = preprocessing(adapt)

    def preprocess(x):
        # JAX (without x64) takes no int64: the lookups' one-hots as int32.
        return tuple(
            tf.cast(t, tf.int32) if t.dtype == tf.int64 else t
            for t in (pre[name](x[name]) for name in sorted(pre))
        )

    widths = {"age": 1, "chol": 1, "cp": 6, "thal": 4}
    dtypes = {"cp": "int32", "thal": "int32"}
    inputs = [
        keras.Input(shape=(widths[name],), dtype=dtypes.get(name, "float32"))
        for name in sorted(pre)
    ]
    concat, hidden, out = trunk_layers()
    trunk = keras.Model(inputs, out(hidden(concat(inputs))))
    trunk.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="binary_crossentropy",
        metrics=["accuracy"],
    )
    return preprocess, trunk


def as_tensors(x):
    return {k: tf.constant(v) for k, v in x.items()}


def raw_dataset(x, y, shuffle):
    dataset = tf.data.Dataset.from_tensor_slices((as_tensors(x), y))
    if shuffle:
        dataset = dataset.shuffle(64, seed=3, reshuffle_each_iteration=True)
    return dataset.batch(16)


def trunk_weights(model):
    names = ("hidden", "out")
    return [w for n in names for w in model.get_layer(n).get_weights()]


def test_plain_keras_cannot_fit_string_inputs_on_jax():
    # What keras_stage is for: Keras alone fails in fit.
    x, y = make_data(32)
    keras.utils.set_random_seed(7)
    inputs = raw_inputs()
    pre = preprocessing(x)
    columns = [pre[name](inputs[name]) for name in sorted(pre)]
    concat, hidden, out = trunk_layers()
    plain = keras.Model(inputs, out(hidden(concat(columns))))
    plain.compile(optimizer="adam", loss="binary_crossentropy")
    with pytest.raises(Exception, match="dtype"):
        plain.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_the_plan_stages_the_preprocessing_and_says_why_not_the_rest():
    x, _ = make_data(32)
    plan = staged_model(x).get_stage_plan()
    assert set(plan.staged_layers) >= {
        "age_norm",
        "chol_norm",
        "thal_ids",
        "cp_ids",
    }
    assert "features" in plan.trunk_layers
    assert (
        "cannot run in tf.data on the jax backend" in (plan.reasons["features"])
    )
    # As on TensorFlow: its own reason comes first.
    assert plan.reasons["hidden"] == "has trainable weights"
    assert plan.reasons["out"] == "has trainable weights"


@pytest.mark.parametrize("shuffle", [False, True])
def test_training_equals_the_hand_split_pipeline(shuffle):
    x, y = make_data(96)
    model = staged_model(x)
    preprocess, trunk = expert(x)
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        np.testing.assert_array_equal(a, b)
    before = trunk_weights(model)

    # shuffle=False: Keras warns that a dataset ignores shuffle=True.
    history = model.fit(
        raw_dataset(x, y, shuffle), epochs=3, shuffle=False, verbose=0
    )
    trunk.fit(
        raw_dataset(x, y, shuffle).map(lambda a, b: (preprocess(a), b)),
        epochs=3,
        shuffle=False,
        verbose=0,
    )

    # The user's model object is the one trained.
    assert any(
        not np.allclose(a, b)
        for a, b in zip(before, trunk_weights(model), strict=True)
    )
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert len(history.history["loss"]) == 3

    # A second fit (the model built now: Keras reads no batch to build).
    model.fit(raw_dataset(x, y, shuffle), epochs=2, shuffle=False, verbose=0)
    trunk.fit(
        raw_dataset(x, y, shuffle).map(lambda a, b: (preprocess(a), b)),
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "stage_wait_ratio" in history.history

    # evaluate and predict take the raw inputs.
    test = raw_dataset(x, y, shuffle=False)
    staged_eval = model.evaluate(test, verbose=0, return_dict=True)
    expert_eval = trunk.evaluate(
        test.map(lambda a, b: (preprocess(a), b)), verbose=0, return_dict=True
    )
    assert staged_eval["loss"] == pytest.approx(expert_eval["loss"], rel=1e-5)
    np.testing.assert_allclose(
        model.predict(x, batch_size=16, verbose=0),
        trunk.predict(
            tf.data.Dataset.from_tensor_slices(as_tensors(x))
            .batch(16)
            .map(lambda a: (preprocess(a),)),
            verbose=0,
        ),
        rtol=1e-5,
        atol=1e-6,
    )


def test_arrays_with_validation_train_on_jax():
    x, y = make_data(96)
    model = staged_model(x)
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        validation_split=0.25,
        verbose=0,
        callbacks=[keras_stage.callbacks.PrefetchCallback()],
    )
    assert len(history.history["val_loss"]) == 2
    assert history.history["stage_skipped"] == [0, 0]
    assert model.predict(x, batch_size=32, verbose=0).shape == (96, 1)


def test_a_later_call_starts_its_pool_where_the_last_one_ended(monkeypatch):
    # A JAX stage counts in stats of its own, so each call that builds its
    # stage builds a new pool: it starts at the size the model's last call
    # of the role ended with, not at the cores again (each resize restarts
    # the stage). (A call on a dataset of the kept stage's structure reads
    # on from its iterator, on its pool: see the test of new datasets.)
    from keras_stage.data import pool as pool_module
    from keras_stage.models.model_state import state as model_state

    starts = []
    original = pool_module.StagePool.__init__

    def recording(self, *args, start=None, **kwargs):
        starts.append(start)
        original(self, *args, start=start, **kwargs)

    monkeypatch.setattr(pool_module.StagePool, "__init__", recording)
    x, y = make_data(64)
    model = staged_model(x)
    data = raw_dataset(x, y, shuffle=False)
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    sizes = model_state(model).pool_sizes
    assert set(sizes) == {"train"} and sizes["train"] >= 1
    model_state(model).pool_sizes["train"] = 3
    # Fewer batches: not the kept stage's structure, a stage of its own.
    data = raw_dataset(x, y, shuffle=False).take(3)
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    assert starts[-1] == 3
    assert model_state(model).pool_sizes["train"] >= 3  # JAX's only grow


def test_saved_on_jax_serves_raw_strings_on_tensorflow(tmp_path):
    x, y = make_data(64)
    model = staged_model(x)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    expected = model.predict(x, batch_size=16, verbose=0)
    sample = {k: v.tolist() for k, v in x.items()}
    script = (
        "import json, sys, numpy as np, keras, keras_stage\n"
        "assert keras.backend.backend() == 'tensorflow'\n"
        "x = json.loads(sys.stdin.read())\n"
        "x = {k: np.array(v, dtype=object if k == 'thal' else None)"
        " for k, v in x.items()}\n"
        "x['age'] = x['age'].astype('float32')\n"
        "x['chol'] = x['chol'].astype('float32')\n"
        f"model = keras.saving.load_model({str(path)!r})\n"
        "print(json.dumps(model.predict(x, batch_size=16, verbose=0)"
        ".tolist()))\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "tensorflow"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(sample),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    served = np.array(json.loads(done.stdout.strip().splitlines()[-1]))
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_readme_example_runs_unchanged_on_jax():
    words = np.array([f"word{i % 50}" for i in range(256)], dtype=object)
    labels = np.random.rand(256, 1).astype("float32")
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput(name="stage")(inputs)
    x = keras.layers.Hashing(num_bins=64, name="hash")(x)
    x = keras.layers.Embedding(64, 8, name="emb")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    before = model.get_layer("emb").get_weights()[0].copy()
    history = model.fit(
        words,
        labels,
        batch_size=32,
        epochs=2,
        callbacks=[keras_stage.callbacks.PrefetchCallback()],
        verbose=0,
    )
    assert model.get_stage_plan().staged_layers == ["stage", "hash"]
    assert len(history.history["stage_wait_ratio"]) == 2
    assert not np.allclose(before, model.get_layer("emb").get_weights()[0])


def test_staged_input_alone_stages_numeric_data_on_jax():
    keras.utils.set_random_seed(7)
    inputs = keras.Input(shape=(4,))
    x = keras_stage.layers.StagedInput(capacity=2, num_threads=2)(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    data = np.random.rand(64, 4).astype("float32")
    history = model.fit(data, data[:, :1], batch_size=16, epochs=2, verbose=0)
    assert len(history.history["stage_wait_ratio"]) == 2
    assert model.predict(data, batch_size=16, verbose=0).shape == (64, 1)


def test_the_engine_stages_on_any_backend():
    lines = tf.data.Dataset.from_tensor_slices(["1,a", "2,b"]).batch(2)
    staged = keras_stage.data.stage(
        lines, lambda x: tf.io.decode_csv(x, [[0], [""]]), num_threads=2
    )
    assert [n.numpy().tolist() for n, _ in staged] == [[1, 2]]


def test_ignored_exceptions_skip_bad_records_on_jax():
    # A record whose number does not parse fails in the staged prefix; the
    # stage skips it and counts it, as on TensorFlow.
    keras.utils.set_random_seed(7)
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput(
        ignored_exception_types=(tf.errors.InvalidArgumentError,)
    )(inputs)
    x = keras.layers.Hashing(num_bins=8, name="hash")(x)
    model = keras_stage.Model(
        inputs, keras.layers.Dense(1)(keras.layers.Embedding(8, 2)(x))
    )
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)

    def check(batch, label):
        tf.debugging.assert_non_negative(label)
        return batch, label

    words = tf.constant([f"w{i}" for i in range(64)])
    labels = np.ones((64, 1), "float32")
    labels[20] = -1.0  # the bad record, in the third batch of 8
    dataset = (
        tf.data.Dataset.from_tensor_slices((words, labels)).batch(8).map(check)
    )
    history = model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    assert history.history["stage_skipped"] == [1]


def test_export_on_jax_names_the_tensorflow_backend(tmp_path):
    x, y = make_data(32)
    model = staged_model(x)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="KERAS_BACKEND=tensorflow"):
        model.export(str(tmp_path / "exported"))
    assert not (tmp_path / "exported").exists()


def stage_iterators_made(monkeypatch):
    """The names of the stage iterators made from now on (a list)."""
    from keras_stage.data import staging

    made = []

    class Counted(staging.StageIterator):
        def __init__(self, staged):
            made.append(staged.name)
            super().__init__(staged)

    monkeypatch.setattr(staging, "StageIterator", Counted)
    return made


def test_a_fit_runs_its_epochs_on_one_stage_iterator(monkeypatch):
    # Keras's JAX trainer reads an iterator per epoch; each would start the
    # stage afresh (its threads, its functions, a cold buffer). Only a
    # larger pool (the "auto" pool grows after an epoch that kept the step
    # waiting) runs in a new one.
    made = stage_iterators_made(monkeypatch)
    x, y = make_data(96)
    model = staged_model(x)
    callback = keras_stage.callbacks.PrefetchCallback()
    verdicts = []
    noted = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: verdicts.append(callback.verdict)
    )
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=3,
        validation_data=(x, y),
        callbacks=[callback, noted],
        verbose=0,
    )
    # The "auto" pool starts at the cores on JAX, the pool tf.data's
    # shared one has, and never shrinks (see
    # keras_stage.models.backends.jax.JaxBackend.pool_start).
    cores = keras_stage.data.StageOptions().smallest_pool_size()
    assert verdicts[0]["thread_pool_size"] == cores
    grown = 0
    for epoch, verdict in enumerate(verdicts):
        size, after = (
            verdict["thread_pool_size"],
            verdict["next_thread_pool_size"],
        )
        assert after >= size, verdicts
        if not verdict["input_bound"]:
            assert after == size, verdicts
        if epoch < len(verdicts) - 1:
            assert verdicts[epoch + 1]["thread_pool_size"] == after
            grown += after > size
    # One for the training epochs (and one per growth), one for the
    # validation runs.
    names = sorted(name.rsplit("_", 1)[1] for name in made)
    assert names == ["train"] * (1 + grown) + ["val"], (made, verdicts)


def test_epochs_on_one_iterator_read_one_batch_ahead_as_on_an_accelerator(
    monkeypatch,
):
    # On an accelerator Keras's JAX trainer reads the batch after the one
    # it hands the step (to start its copy to the device), so it reads once
    # past each epoch's end; on one stage iterator that read must end the
    # epoch, not take the next epoch's first batch. On CPU it reads none
    # ahead: the accelerator's reader is forced here.
    from keras.src.backend.jax.trainer import JAXEpochIterator

    def one_batch_ahead(self):
        return self._one_batch_ahead_iterator(
            self.data_adapter.get_jax_iterator()
        )

    monkeypatch.setattr(JAXEpochIterator, "_get_iterator", one_batch_ahead)
    made = stage_iterators_made(monkeypatch)
    x, y = make_data(96)
    # A fixed pool: a resized one would run in a new iterator.
    model = staged_model(x, thread_pool_size=2)
    preprocess, trunk = expert(x)
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    trunk.fit(
        raw_dataset(x, y, shuffle=False).map(lambda a, b: (preprocess(a), b)),
        epochs=3,
        shuffle=False,
        verbose=0,
    )
    assert [n.rsplit("_", 1)[1] for n in made].count("train") == 1, made
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_calls_on_one_dataset_read_on_from_one_stage_iterator(monkeypatch):
    # A user's loop of fit(epochs=1) with an evaluate between them, on one
    # dataset object each: the kept stages' iterators run on across the
    # calls, and train as the hand split does.
    made = stage_iterators_made(monkeypatch)
    x, y = make_data(96)
    model = staged_model(x, thread_pool_size=2)
    preprocess, trunk = expert(x)
    train, test = raw_dataset(x, y, False), raw_dataset(x, y, False).take(2)
    mapped = raw_dataset(x, y, False).map(lambda a, b: (preprocess(a), b))
    for _ in range(3):
        model.fit(train, epochs=1, shuffle=False, verbose=0)
        trunk.fit(mapped, epochs=1, shuffle=False, verbose=0)
        staged_loss = model.evaluate(test, verbose=0)[0]
        assert staged_loss == pytest.approx(
            trunk.evaluate(mapped.take(2), verbose=0)[0], rel=1e-5
        )
    roles = [name.rsplit("_", 1)[1] for name in made]
    assert sorted(roles) == ["test", "train"], made
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    predicted = [model.predict(test, verbose=0) for _ in range(2)]
    np.testing.assert_allclose(predicted[0], predicted[1])
    assert [n.rsplit("_", 1)[1] for n in made].count("predict") == 1, made


def staged_and_hand(adapt):
    """`(staged model, hand-split trunk, mapped)` on a fixed pool of 2.

    `mapped(dataset)`: the hand split's preprocessing over `dataset`.
    """
    model = staged_model(adapt, thread_pool_size=2)
    preprocess, trunk = expert(adapt)

    def mapped(dataset):
        return dataset.map(lambda a, b: (preprocess(a), b))

    return model, trunk, mapped


def test_calls_on_new_datasets_of_one_structure_read_on_from_one_iterator(
    monkeypatch,
):
    # A loop that builds its dataset each call: from the second call of a
    # role on, each call feeds its passes to the kept stage's source
    # (`FedSource`), read on by its one iterator; no later call builds a
    # stage or makes an iterator again, and the weights are the hand
    # split's.
    made = stage_iterators_made(monkeypatch)
    x, y = make_data(96)
    model, trunk, mapped = staged_and_hand(x)
    for epochs in (2, 1, 3):
        model.fit(
            raw_dataset(x, y, False), epochs=epochs, shuffle=False, verbose=0
        )
        trunk.fit(
            mapped(raw_dataset(x, y, False)),
            epochs=epochs,
            shuffle=False,
            verbose=0,
        )
        staged_loss = model.evaluate(raw_dataset(x, y, False), verbose=0)[0]
        assert staged_loss == pytest.approx(
            trunk.evaluate(mapped(raw_dataset(x, y, False)), verbose=0)[0],
            rel=1e-5,
        )
    # Per role: the first call's stage, and the one fed from the second.
    roles = sorted(name.rsplit("_", 1)[1] for name in made)
    assert roles == ["test", "test", "train", "train"], made
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Calls on one dataset object: its one iterator runs on, unfed.
    unlabelled = tf.data.Dataset.from_tensor_slices(as_tensors(x)).batch(16)
    predicted = [model.predict(unlabelled, verbose=0) for _ in range(2)]
    np.testing.assert_allclose(predicted[0], predicted[1])
    assert [n.rsplit("_", 1)[1] for n in made].count("predict") == 1, made


def test_a_call_that_stops_early_leaves_no_passes_to_the_next(monkeypatch):
    # A fed call (the second on a new dataset) that stops after the first
    # of its 3 epochs leaves 2 passes fed and unread: the next call (on
    # another dataset) must not read them, so it builds its stage again,
    # and every call trains as the hand split does.
    made = stage_iterators_made(monkeypatch)
    x, _ = make_data(96)
    model, trunk, mapped = staged_and_hand(x)

    def stop(model):
        def on_epoch_end(epoch, logs):
            model.stop_training = True

        return keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)

    for seed, epochs, stops in ((0, 1, False), (1, 3, True), (2, 2, False)):
        data = make_data(96, seed=seed)
        for fitted, dataset in (
            (model, raw_dataset(*data, False)),
            (trunk, mapped(raw_dataset(*data, False))),
        ):
            fitted.fit(
                dataset,
                epochs=epochs,
                shuffle=False,
                callbacks=[stop(fitted)] if stops else [],
                verbose=0,
            )
    # The first call's stage, the fed one the second built, and the one
    # built again after that call stopped early.
    assert [n.rsplit("_", 1)[1] for n in made] == ["train"] * 3, made
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_a_blocked_source_times_out_on_jax_and_the_model_fits_again(release):
    def generate():
        for i in range(6):
            if i == 2:
                release.wait(60)  # a source that stops answering
            yield np.ones((2, 2), "float32"), np.ones((2, 1), "float32")

    spec = (
        tf.TensorSpec((None, 2), tf.float32),
        tf.TensorSpec((None, 1), tf.float32),
    )
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput(
        name="hang", timeout=1.0, capacity=1, num_threads=1
    )(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    hanging = tf.data.Dataset.from_generator(generate, output_signature=spec)
    with pytest.raises(
        keras_stage.data.StageTimeoutError, match="Stage 'hang_train'"
    ):
        model.fit(hanging, verbose=0, shuffle=False)

    clean = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 2), "float32"), np.ones((8, 1), "float32"))
    ).batch(2)
    history = model.fit(clean, epochs=2, verbose=0, shuffle=False)
    assert len(history.history["loss"]) == 2


def test_device_options_are_named_as_unused_on_jax(caplog):
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput(name="gpu_stage", device="gpu:0")(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    data = np.ones((8, 2), "float32")
    with caplog.at_level("WARNING", logger="keras_stage"):
        model.fit(data, data[:, :1], batch_size=4, epochs=2, verbose=0)
    warned = [r for r in caplog.records if "jax.device_put" in r.message]
    assert len(warned) == 1  # once per layer
    assert "gpu_stage" in warned[0].message


IMAGES = (
    np.random.default_rng(4).integers(0, 255, (16, 4, 4, 3)).astype("float32")
)


def _augmenting_model():
    inputs = keras.Input(shape=(4, 4, 3))
    x = keras_stage.layers.StagedInput(name="stage")(inputs)
    x = keras.layers.Rescaling(1 / 255.0, name="scale")(x)
    x = keras.layers.RandomFlip("horizontal", seed=1, name="flip")(x)
    x = keras.layers.RandomContrast(0.5, seed=2, name="contrast")(x)
    x = keras.layers.Flatten(name="flat")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1, name="head")(x))
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    return model


def test_random_augmentation_is_staged_with_its_own_seed_stream():
    model = _augmenting_model()
    plan = model.get_stage_plan()
    assert plan.staged_layers == ["stage", "scale", "flip", "contrast"]
    assert "flip" not in plan.reasons and "contrast" not in plan.reasons
    jax_state = np.asarray(model.get_layer("flip").generator.state.value)
    first, second = staged_prefix_outputs(model, IMAGES, 4, epochs=2)
    # Every batch of every epoch is augmented afresh (not the rescaled
    # input, not the same as another batch's draw)...
    batches = [b.tobytes() for b in first + second]
    assert len(set(batches)) == len(batches)
    for epoch in (first, second):
        rescaled = np.concatenate(epoch) * 255.0
        assert not np.allclose(rescaled, IMAGES, atol=1e-3)
    # ...the same in a rebuilt stage with 4 threads, whatever thread runs
    # which batch...
    again = staged_prefix_outputs(_augmenting_model(), IMAGES, 4, epochs=2)
    np.testing.assert_array_equal(np.stack(first), np.stack(again[0]))
    # ...and the layer's own (JAX) seed state is untouched by the stage.
    np.testing.assert_array_equal(
        np.asarray(model.get_layer("flip").generator.state.value), jax_state
    )


def test_staged_augmentation_trains_deterministically_and_serves_unaugmented():
    weights, predictions = [], []
    for _ in range(2):
        keras.utils.set_random_seed(7)
        model = _augmenting_model()
        history = model.fit(
            IMAGES,
            np.linspace(0, 1, 16)[:, None],
            batch_size=4,
            epochs=2,
            verbose=0,
        )
        assert np.all(np.isfinite(history.history["loss"]))
        weights.append(model.get_weights())
        predictions.append(model.predict(IMAGES, verbose=0))
    for a, b in zip(*weights, strict=True):
        np.testing.assert_array_equal(a, b)
    # Inference does not augment: the stage's predict equals the model's
    # own call, where the random layers pass their inputs through.
    np.testing.assert_allclose(
        predictions[1], np.asarray(model(IMAGES, training=False)), rtol=1e-5
    )


def test_staged_augmentation_on_one_iterator_numbers_as_per_call(caplog):
    # A fit's epochs on one iterator read ahead of Keras; they still draw
    # what three one-epoch fits (an iterator each) draw.
    labels = np.linspace(0, 1, 16)[:, None]
    weights = []
    for epochs, calls in ((3, 1), (1, 3)):
        keras.utils.set_random_seed(7)
        model = _augmenting_model()
        with caplog.at_level(logging.DEBUG, logger="keras_stage"):
            for _ in range(calls):
                model.fit(
                    IMAGES,
                    labels,
                    batch_size=4,
                    epochs=epochs,
                    shuffle=False,
                    verbose=0,
                )
        split = model._keras_stage_state.split
        assert int(split.ordinal.numpy()) == 12  # 4 batches x 3 epochs
        weights.append(model.get_weights())
    assert any("3 epochs on one iterator" in m for m in caplog.messages)
    for a, b in zip(*weights, strict=True):
        np.testing.assert_array_equal(a, b)


def _word_model(sequential=False):
    if sequential:
        return keras_stage.Sequential(
            [
                keras.Input(shape=(), dtype="string"),
                keras_stage.layers.StagedInput(),
                keras.layers.Hashing(16),
                keras.layers.Embedding(16, 4),
                keras.layers.Dense(1),
            ]
        )
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput()(inputs)
    x = keras.layers.Embedding(16, 4)(keras.layers.Hashing(16)(x))
    return keras_stage.Model(inputs, keras.layers.Dense(1)(x))


@pytest.mark.parametrize(
    "setting",
    [
        "sequential",
        "sample_weight",
        "run_eagerly",
        "jit_compile_false",
        "steps_per_execution",
        "mixed_float16",
    ],
)
def test_standard_keras_settings_train_on_jax(setting):
    words = np.array([f"w{i % 20}" for i in range(128)], dtype=object)
    labels = np.random.rand(128, 1).astype("float32")
    compile_kwargs, fit_kwargs = {}, {}
    if setting == "sample_weight":
        fit_kwargs["sample_weight"] = np.linspace(0.5, 1.5, 128)
    if setting == "run_eagerly":
        compile_kwargs["run_eagerly"] = True
    if setting == "jit_compile_false":
        compile_kwargs["jit_compile"] = False
    if setting == "steps_per_execution":
        compile_kwargs["steps_per_execution"] = 2
    if setting == "mixed_float16":
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _word_model(sequential=setting == "sequential")
        model.compile("adam", "mse", smart_stage=True, **compile_kwargs)
        history = model.fit(
            words, labels, batch_size=32, epochs=2, verbose=0, **fit_kwargs
        )
        assert np.all(np.isfinite(history.history["loss"]))
        assert len(history.history["stage_wait_ratio"]) == 2
        assert model.predict(words[:8], verbose=0).shape == (8, 1)
        losses = [model.evaluate(words, labels, verbose=0) for _ in range(2)]
        assert losses[0] == pytest.approx(losses[1])
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_staged_predict_runs_a_jitted_trunk_on_jax():
    # Keras's "auto" jit is off for a model with string layers; the staged
    # trunk has none, so predict's step is jitted as fit's and evaluate's
    # are: the trunk's Python runs when traced, not for every batch.
    calls = []

    class Counted(keras.layers.Dense):
        def call(self, x):
            calls.append(1)
            return super().call(x)

    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput()(inputs)
    x = keras.layers.Embedding(16, 4)(keras.layers.Hashing(16)(x))
    model = keras_stage.Model(inputs, Counted(1)(x))
    model.compile("adam", "mse", smart_stage=True)
    words = np.array([f"w{i % 20}" for i in range(64)], dtype=object)
    model.predict(words, batch_size=8, verbose=0)  # 8 batches
    traced = len(calls)
    assert traced <= 2, calls  # the build's symbolic call and one trace
    predicted = model.predict(words, batch_size=8, verbose=0)
    assert len(calls) == traced
    # The model's own outputs: Hashing(16) is TensorFlow's fast hash.
    ids = tf.strings.to_hash_bucket_fast(words, 16).numpy()
    table = np.asarray(model.layers[-2].embeddings)
    kernel, bias = (np.asarray(w) for w in model.layers[-1].weights)
    np.testing.assert_allclose(
        predicted, table[ids] @ kernel + bias, rtol=1e-5, atol=1e-6
    )


def test_op_determinism_trains_on_jax():
    # The reproducibility recipe, in a fresh process (op determinism cannot
    # be turned off once on): the stage's clock gives way to the host's.
    script = (
        "import numpy as np, keras, keras_stage, tensorflow as tf\n"
        "keras.utils.set_random_seed(1)\n"
        "tf.config.experimental.enable_op_determinism()\n"
        "words = np.array([f'w{i % 20}' for i in range(128)], dtype=object)\n"
        "y = np.linspace(0, 1, 128, dtype='float32')[:, None]\n"
        "inputs = keras.Input(shape=(), dtype='string')\n"
        "x = keras_stage.layers.StagedInput()(inputs)\n"
        "x = keras.layers.Embedding(16, 4)(keras.layers.Hashing(16)(x))\n"
        "m = keras_stage.Model(inputs, keras.layers.Dense(1)(x))\n"
        "m.compile('adam', 'mse', smart_stage=True)\n"
        "h = m.fit(words, y, batch_size=32, epochs=2, verbose=0,\n"
        "          validation_split=0.25)\n"
        "print('LOSSES', h.history['loss'], h.history['val_loss'])\n"
    )
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env={**os.environ, "KERAS_BACKEND": "jax"},
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(done.stdout.strip().splitlines()[-1])
    assert runs[0].startswith("LOSSES")
    assert runs[0] == runs[1]  # the same losses, run after run


@pytest.mark.parametrize("kind", ["layer", "lambda"])
def test_a_layer_of_tensorflow_ops_parses_strings_in_the_stage(kind):
    # Keras's Layer.__call__ would convert the graph tensors to the
    # backend's arrays: the stage runs the layer's call on them.
    check_a_tensorflow_ops_layer_is_staged(kind)


def test_a_feature_space_s_nested_model_is_staged_whole():
    space = keras.utils.FeatureSpace(
        features={"thal": "string_categorical", "age": "float_normalized"},
        output_mode="concat",
    )
    x = {
        "thal": np.array(["a", "b"] * 8, dtype=object),
        "age": np.arange(16, dtype="float32"),
    }
    space.adapt(tf.data.Dataset.from_tensor_slices(x).batch(8))
    raw = dict(space.get_inputs())
    encode = keras.Model(raw, space.get_encoded_features(), name="encode")
    inputs = {
        n: keras.Input(shape=(1,), dtype=raw[n].dtype, name=n) for n in raw
    }
    staged = keras_stage.layers.StagedInput(name="stage")(inputs)
    out = keras.layers.Dense(1, name="out")
    model = keras_stage.Model(inputs, out(encode(staged)))
    model.compile("adam", "mse", smart_stage=True)
    assert model.get_stage_plan().staged_layers == ["stage", "encode"]
    model.fit(x, np.ones((16, 1)), batch_size=8, verbose=0)
    np.testing.assert_allclose(
        model.predict(x, batch_size=8, verbose=0),
        out(space(x)),
        rtol=1e-5,
        atol=1e-6,
    )
