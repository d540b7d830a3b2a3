"""SmartStage on the PyTorch backend: string-input models train, as
hand-split.

Plain Keras on torch cannot fit a model with string inputs (torch has no
string dtype); keras_stage runs its preprocessing prefix in tf.data and
trains the trunk as Keras's torch step. These tests hold it to the
hand-split expert pipeline (the same preprocessing layers in `dataset.map`,
a numeric trunk model on torch): the same weights after several epochs,
with and without shuffling, on a string model and on keras.io's
structured-data (FeatureSpace) model; and to everything else a Keras user
on torch calls: validation, callbacks, `steps_per_epoch`, sample weights,
seeds, `.keras` files, `export`, the exception policies and the timeout.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from benchmarks.workloads import tables
from tests.helpers import (
    check_a_tensorflow_ops_layer_is_staged,
    staged_prefix_outputs,
)

# torch is imported in the tests that use it: the TensorFlow suite, which
# has no torch, collects this module and skips its tests (conftest.py).

pytestmark = pytest.mark.timeout(300)

THAL = ("normal", "fixed", "reversible")
NUMERIC = ("age", "chol")
CITY_BINS = 8
# The staged and the hand-split runs make the same torch calls on the
# same tensors: their weights, losses and predictions are equal to the bit.
# Across programs (TensorFlow's, an exported one, NumPy's) a few float32
# roundings apart; a FeatureSpace called whole or layer by layer, and
# trained on, as on JAX (its tests' tolerance).
CLOSE = {"rtol": 1e-6, "atol": 1e-6}
FEATURE_SPACE_CLOSE = {"rtol": 1e-5, "atol": 1e-6}


def make_data(count, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        name: rng.normal(50 + 30 * i, 10, (count, 1)).astype("float32")
        for i, name in enumerate(NUMERIC)
    }
    thal = rng.integers(len(THAL), size=count)
    x["thal"] = np.array([THAL[i] for i in thal], dtype=object)
    x["city"] = np.array(
        [f"city{i}" for i in rng.integers(20, size=count)], dtype=object
    )
    x["cp"] = rng.integers(5, size=(count, 1)).astype("int64")
    score = (x["age"][:, 0] - 50) / 10 + thal - 1
    return x, (score > 0).astype("float32")[:, None]


def chain(*layers):
    """A function calling `layers` in turn."""

    def call(x):
        for layer in layers:
            x = layer(x)
        return x

    return call


def preprocessing(adapt):
    """The preprocessing layers, adapted: name -> layer (or chain)."""
    layers = {}
    for name in NUMERIC:
        layers[name] = keras.layers.Normalization(name=f"{name}_norm")
        layers[name].adapt(adapt[name])
    layers["thal"] = keras.layers.StringLookup(
        vocabulary=list(THAL), output_mode="one_hot", name="thal_ids"
    )
    # Hashing's own one-hot of a scalar column loses the batch axis in its
    # symbolic shape (Keras 3.15): a CategoryEncoding makes it.
    layers["city"] = chain(
        keras.layers.Hashing(num_bins=CITY_BINS, name="city_hash"),
        keras.layers.CategoryEncoding(
            CITY_BINS, output_mode="one_hot", name="city_onehot"
        ),
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
    inputs["city"] = keras.Input(shape=(), dtype="string", name="city")
    inputs["cp"] = keras.Input(shape=(1,), dtype="int64", name="cp")
    return inputs


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.Adam(1e-2),
        "loss": "binary_crossentropy",
        "metrics": ["accuracy"],
    }


def staged_model(adapt, model_class=None, **options):
    keras.utils.set_random_seed(7)
    inputs = raw_inputs()
    x = keras_stage.layers.StagedInput(**options)(inputs)
    pre = preprocessing(adapt)
    columns = [pre[name](x[name]) for name in sorted(pre)]
    concat, hidden, out = trunk_layers()
    model_class = model_class or keras_stage.Model
    model = model_class(inputs, out(hidden(concat(columns))))
    model.compile(**compile_kwargs(), smart_stage=True)
    return model


def expert(adapt):
    """The hand split: `(preprocess, trunk)`, with the same initial weights.

    The trunk is a numeric `keras.Model` on torch, of inputs shaped as the
    preprocessing's outputs in tf.data.
    """
    keras.utils.set_random_seed(7)
    pre = preprocessing(adapt)

    def preprocess(x):
        return tuple(pre[name](x[name]) for name in sorted(pre))

    # The specs of its outputs in tf.data (eager, Keras's layers would
    # give torch tensors).
    specs = (
        tf.data.Dataset.from_tensor_slices(as_tensors(make_data(2)[0]))
        .batch(2)
        .map(preprocess)
        .element_spec
    )
    inputs = [
        keras.Input(shape=spec.shape[1:], dtype=spec.dtype.name)
        for spec in specs
    ]
    concat, hidden, out = trunk_layers()
    trunk = keras.Model(inputs, out(hidden(concat(inputs))))
    trunk.compile(**compile_kwargs())
    return preprocess, trunk


def as_tensors(x):
    return {k: tf.constant(v) for k, v in x.items()}


def raw_dataset(x, y, shuffle, weights=None):
    parts = (as_tensors(x), y)
    if weights is not None:
        parts += (weights,)
    dataset = tf.data.Dataset.from_tensor_slices(parts)
    if shuffle:
        dataset = dataset.shuffle(64, seed=3, reshuffle_each_iteration=True)
    return dataset.batch(16)


def mapped(preprocess, dataset):
    """The hand split's `dataset.map` of `preprocess` over (x, y[, w])."""
    return dataset.map(lambda x, *rest: (preprocess(x), *rest))


def trunk_weights(model):
    names = ("hidden", "out")
    return [w for n in names for w in model.get_layer(n).get_weights()]


def assert_same_weights(model, trunk, **close):
    """`model`'s trunk weights are `trunk`'s: equal, or `close`."""
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        if close:
            np.testing.assert_allclose(a, b, **close)
        else:
            np.testing.assert_array_equal(a, b)


def test_plain_keras_cannot_fit_string_inputs_on_torch():
    # What keras_stage is for: Keras alone fails in fit, given arrays or a
    # tf.data dataset: torch has no string dtype.
    x, y = make_data(32)
    keras.utils.set_random_seed(7)
    inputs = raw_inputs()
    pre = preprocessing(x)
    columns = [pre[name](inputs[name]) for name in sorted(pre)]
    concat, hidden, out = trunk_layers()
    plain = keras.Model(inputs, out(hidden(concat(columns))))
    plain.compile(optimizer="adam", loss="binary_crossentropy")
    with pytest.raises(ValueError, match="Invalid dtype: object"):
        plain.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="Invalid dtype: object"):
        plain.fit(raw_dataset(x, y, False), epochs=1, shuffle=False, verbose=0)


def test_the_plan_stages_the_preprocessing_and_says_why_not_the_rest():
    # String parsing (TextVectorization's split and standardisation),
    # Hashing, StringLookup, IntegerLookup, Normalization and
    # CategoryEncoding run in tf.data; the rest in the trunk, each with its
    # reason.
    x, _ = make_data(32)
    keras.utils.set_random_seed(7)
    inputs = raw_inputs()
    inputs["notes"] = keras.Input(shape=(), dtype="string", name="notes")
    staged = keras_stage.layers.StagedInput(name="stage")(inputs)
    pre = preprocessing(x)
    columns = [pre[name](staged[name]) for name in sorted(pre)]
    words = keras.layers.TextVectorization(
        vocabulary=["chest", "pain", "angina"],
        output_mode="multi_hot",
        name="notes_words",
    )
    columns.append(words(staged["notes"]))
    frozen = keras.layers.Dense(2, name="frozen")
    frozen.trainable = False
    columns.append(frozen(pre["age"](staged["age"])))
    concat, hidden, out = trunk_layers()
    model = keras_stage.Model(inputs, out(hidden(concat(columns))))
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    plan = model.get_stage_plan()
    assert set(plan.staged_layers) == {
        "stage",
        "age_norm",
        "chol_norm",
        "thal_ids",
        "city_hash",
        "city_onehot",
        "cp_ids",
        "notes_words",
    }
    assert set(plan.trunk_layers) == {"features", "frozen", "hidden", "out"}
    # Its first input, traced before it, is in the trunk already.
    assert plan.reasons["features"] == "depends on trunk layer 'frozen'"
    # A frozen layer's weights are torch tensors and its call takes torch
    # tensors: on torch (as on JAX) it runs in the trunk, and says why.
    assert "the torch backend" in plan.reasons["frozen"]
    # As on TensorFlow: its own reason comes first.
    assert plan.reasons["hidden"] == "has trainable weights"
    assert plan.reasons["out"] == "has trainable weights"


@pytest.mark.parametrize("kind", ["layer", "lambda"])
def test_a_layer_of_tensorflow_ops_parses_strings_in_the_stage(kind):
    # Keras's Layer.__call__ would convert the graph tensors to the
    # backend's arrays: the stage runs the layer's call on them.
    check_a_tensorflow_ops_layer_is_staged(kind)


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
        mapped(preprocess, raw_dataset(x, y, shuffle)),
        epochs=3,
        shuffle=False,
        verbose=0,
    )

    # The user's model object is the one trained.
    assert any(
        not np.allclose(a, b)
        for a, b in zip(before, trunk_weights(model), strict=True)
    )
    assert_same_weights(model, trunk)
    assert len(history.history["loss"]) == 3

    # A second fit (the model built now: Keras reads no batch to build).
    model.fit(raw_dataset(x, y, shuffle), epochs=2, shuffle=False, verbose=0)
    trunk.fit(
        mapped(preprocess, raw_dataset(x, y, shuffle)),
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    assert_same_weights(model, trunk)

    # evaluate and predict take the raw inputs.
    test = raw_dataset(x, y, shuffle=False)
    staged_eval = model.evaluate(test, verbose=0, return_dict=True)
    expert_eval = trunk.evaluate(
        mapped(preprocess, test), verbose=0, return_dict=True
    )
    assert staged_eval == expert_eval
    np.testing.assert_array_equal(
        model.predict(x, batch_size=16, verbose=0),
        trunk.predict(
            tf.data.Dataset.from_tensor_slices(as_tensors(x))
            .batch(16)
            .map(lambda a: (preprocess(a),)),
            verbose=0,
        ),
    )


# -- keras.io's structured-data (FeatureSpace) model -------------------------


def feature_space(features):
    """The example's `FeatureSpace`, adapted on `features` as it does."""
    space = tables.feature_space()
    space.adapt(tf.data.Dataset.from_tensor_slices(features).batch(32))
    return space


def heart_trunk(features):
    x = keras.layers.Dense(32, activation="relu", name="hidden")(features)
    x = keras.layers.Dropout(0.5, name="dropout")(x)
    return keras.layers.Dense(1, activation="sigmoid", name="out")(x)


def heart_compile_kwargs():
    return {
        "optimizer": "adam",
        "loss": "binary_crossentropy",
        "metrics": ["accuracy"],
    }


def staged_feature_space_model(features):
    """The example's model end to end, its `FeatureSpace` staged.

    The encoded features hang off the FeatureSpace's own inputs: a
    `StagedInput` goes before them by calling them as a nested model (as
    `benchmarks.workloads.tables.FeatureSpaceWorkload` builds it).
    """
    keras.utils.set_random_seed(5)
    space = feature_space(features)
    raw = dict(space.get_inputs())
    encode = keras.Model(raw, space.get_encoded_features(), name="encode")
    inputs = {
        name: keras.Input(shape=(1,), dtype=raw[name].dtype, name=name)
        for name in sorted(raw)
    }
    staged = keras_stage.layers.StagedInput(name="stage")(inputs)
    model = keras_stage.Model(inputs, heart_trunk(encode(staged)))
    model.compile(**heart_compile_kwargs(), smart_stage=True)
    return model


def hand_split_feature_space(features):
    """The example as written: `(space, trunk)`, the `FeatureSpace` to map
    over the dataset, the trunk a `keras.Model` of the encoded features."""
    keras.utils.set_random_seed(5)
    space = feature_space(features)
    encoded = space.get_encoded_features()
    inputs = keras.Input(shape=encoded.shape[1:], name="features")
    trunk = keras.Model(inputs, heart_trunk(inputs))
    trunk.compile(**heart_compile_kwargs())
    return space, trunk


def heart_dataset(features, labels, shuffle):
    dataset = tf.data.Dataset.from_tensor_slices((dict(features), labels))
    if shuffle:
        dataset = dataset.shuffle(64, seed=3, reshuffle_each_iteration=True)
    return dataset.batch(32)


@pytest.mark.parametrize("shuffle", [False, True])
def test_feature_space_training_equals_the_hand_split_pipeline(shuffle):
    features, labels = tables.heart(160, 7)
    val_features, val_labels = tables.heart(40, 8)
    model = staged_feature_space_model(features)
    space, trunk = hand_split_feature_space(features)
    assert model.get_stage_plan().staged_layers == ["stage", "encode"]
    for a, b in zip(trunk_weights(model), trunk_weights(trunk), strict=True):
        np.testing.assert_array_equal(a, b)

    # The example's fit: with validation, the Dropout drawing its masks
    # from torch's global generator (unseeded, Keras's torch dropout does),
    # so each fit starts from the same seed.
    keras.utils.set_random_seed(11)
    history = model.fit(
        heart_dataset(features, labels, shuffle),
        epochs=3,
        validation_data=heart_dataset(val_features, val_labels, False),
        shuffle=False,
        verbose=0,
    )
    keras.utils.set_random_seed(11)
    expert_history = trunk.fit(
        heart_dataset(features, labels, shuffle).map(
            lambda x, y: (space(x), y)
        ),
        epochs=3,
        validation_data=heart_dataset(val_features, val_labels, False).map(
            lambda x, y: (space(x), y)
        ),
        shuffle=False,
        verbose=0,
    )
    assert_same_weights(model, trunk, **FEATURE_SPACE_CLOSE)
    np.testing.assert_allclose(
        history.history["val_loss"],
        expert_history.history["val_loss"],
        **FEATURE_SPACE_CLOSE,
    )
    # The example's one patient, predicted from its raw values.
    patient = {
        name: np.asarray(values[:1]) for name, values in val_features.items()
    }
    np.testing.assert_allclose(
        model.predict(patient, verbose=0),
        trunk.predict(space(patient), verbose=0),
        **FEATURE_SPACE_CLOSE,
    )


# -- what else a Keras user calls ------------------------------------------


def test_validation_data_and_split_train_as_the_hand_split():
    x, y = make_data(96)
    val_x, val_y = make_data(32, seed=1)
    model = staged_model(x)
    preprocess, trunk = expert(x)
    history = model.fit(
        raw_dataset(x, y, False),
        epochs=2,
        validation_data=raw_dataset(val_x, val_y, False),
        callbacks=[keras_stage.callbacks.PrefetchCallback()],
        shuffle=False,
        verbose=0,
    )
    expert_history = trunk.fit(
        mapped(preprocess, raw_dataset(x, y, False)),
        epochs=2,
        validation_data=mapped(preprocess, raw_dataset(val_x, val_y, False)),
        shuffle=False,
        verbose=0,
    )
    assert_same_weights(model, trunk)
    assert history.history["val_loss"] == expert_history.history["val_loss"]
    # The PrefetchCallback's logs, every epoch.
    for key in ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped"):
        assert len(history.history[key]) == 2, (key, history.history)
    assert history.history["stage_skipped"] == [0, 0]
    assert all(0 <= r <= 1 for r in history.history["stage_wait_ratio"])

    # validation_split, from arrays (strings included).
    history = model.fit(
        x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0
    )
    assert len(history.history["val_loss"]) == 2
    assert np.all(np.isfinite(history.history["val_loss"]))
    assert model.predict(x, batch_size=32, verbose=0).shape == (96, 1)


class BatchRecorder(keras.callbacks.Callback):
    """Records the batches each epoch of fit ran, and their logs' keys."""

    def on_train_begin(self, logs=None):
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1].append((batch, sorted(logs)))


def test_user_callbacks_see_every_batch_stop_and_checkpoint(tmp_path):
    x, y = make_data(96)
    model = staged_model(x)
    recorder = BatchRecorder()
    path = tmp_path / "checkpoint.keras"
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=10,
        validation_data=(x, y),
        callbacks=[
            recorder,
            # No epoch improves on the first by 10: stops after the second.
            keras.callbacks.EarlyStopping(
                monitor="val_loss", min_delta=10.0, patience=1
            ),
            keras.callbacks.ModelCheckpoint(path, monitor="val_loss"),
        ],
        verbose=0,
    )
    assert len(history.history["loss"]) == 2
    assert len(recorder.epochs) == 2
    for epoch in recorder.epochs:
        assert [batch for batch, _ in epoch] == list(range(6))
        assert epoch[-1][1] == ["accuracy", "loss"]
    saved = keras.saving.load_model(path)
    assert isinstance(saved, keras_stage.Model)
    np.testing.assert_array_equal(
        saved.predict(x, batch_size=16, verbose=0),
        model.predict(x, batch_size=16, verbose=0),
    )


def test_steps_per_epoch_on_a_repeated_dataset_train_as_the_hand_split():
    x, y = make_data(96)
    model = staged_model(x)
    preprocess, trunk = expert(x)
    # 4 steps of the 6 batches a pass has: epochs run across passes.
    history = model.fit(
        raw_dataset(x, y, True).repeat(),
        epochs=3,
        steps_per_epoch=4,
        shuffle=False,
        verbose=0,
    )
    trunk.fit(
        mapped(preprocess, raw_dataset(x, y, True).repeat()),
        epochs=3,
        steps_per_epoch=4,
        shuffle=False,
        verbose=0,
    )
    assert len(history.history["loss"]) == 3
    assert_same_weights(model, trunk)


@pytest.mark.parametrize("feed", ["arrays", "dataset"])
def test_sample_weights_train_as_the_hand_split(feed):
    x, y = make_data(96)
    weights = np.linspace(0.2, 2.0, 96).astype("float32")
    model = staged_model(x)
    preprocess, trunk = expert(x)
    if feed == "arrays":
        model.fit(
            x,
            y,
            sample_weight=weights,
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
        )
    else:
        model.fit(
            raw_dataset(x, y, True, weights), epochs=2, shuffle=False, verbose=0
        )
    trunk.fit(
        mapped(preprocess, raw_dataset(x, y, feed == "dataset", weights)),
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    assert_same_weights(model, trunk)
    # And unweighted training is another: the weights were used.
    unweighted = staged_model(x)
    unweighted.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert not np.allclose(
        trunk_weights(unweighted)[0], trunk_weights(model)[0]
    )


def test_set_random_seed_makes_two_runs_the_same():
    # The initial weights (seed 7) and Keras's shuffles of the arrays draw
    # from it: the same seed, the same weights; another, others.
    x, y = make_data(96)
    runs = []
    for seed in (8, 8, 9):
        model = staged_model(x)
        keras.utils.set_random_seed(seed)
        history = model.fit(
            x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0
        )
        runs.append((model.get_weights(), history.history["val_loss"]))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert runs[0][1] == runs[1][1]
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(runs[0][0], runs[2][0], strict=True)
    )


def test_readme_example_runs_unchanged_on_torch():
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


def test_a_sequential_model_trains_on_torch():
    words = np.array([f"w{i % 20}" for i in range(128)], dtype=object)
    labels = np.random.rand(128, 1).astype("float32")
    model = keras_stage.Sequential(
        [
            keras.Input(shape=(), dtype="string"),
            keras_stage.layers.StagedInput(),
            keras.layers.Hashing(16),
            keras.layers.Embedding(16, 4),
            keras.layers.Dense(1),
        ]
    )
    model.compile("adam", "mse", smart_stage=True)
    history = model.fit(words, labels, batch_size=32, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert len(history.history["stage_wait_ratio"]) == 2
    losses = [model.evaluate(words, labels, verbose=0) for _ in range(2)]
    assert losses[0] == losses[1]


# -- what reaches the torch step -------------------------------------------


def test_batches_reach_the_torch_step_as_torch_tensors_on_its_device():
    # The trunk's first layer takes the stage's cut tensors: torch tensors
    # on the device the trunk's weights are on, in every step.
    import torch

    seen = []

    class Recording(keras.layers.Concatenate):
        def call(self, inputs):
            seen.append([(type(t), t.device) for t in inputs])
            return super().call(inputs)

    x, y = make_data(64)
    keras.utils.set_random_seed(7)
    inputs = raw_inputs()
    staged = keras_stage.layers.StagedInput()(inputs)
    pre = preprocessing(x)
    columns = [pre[name](staged[name]) for name in sorted(pre)]
    _, hidden, out = trunk_layers()
    model = keras_stage.Model(
        inputs, out(hidden(Recording(name="features")(columns)))
    )
    model.compile(**compile_kwargs(), smart_stage=True)
    assert (
        "cannot run in tf.data on the torch backend"
        in (model.get_stage_plan().reasons["features"])
    )
    del seen[:]
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    device = model.get_layer("hidden").kernel.value.device
    # Keras's meta-device calls (building, shapes) aside: one call a step.
    stepped = [s for s in seen if all(d.type != "meta" for _, d in s)]
    assert len(stepped) == 4 * 2 + 4, seen
    for columns in stepped:
        assert len(columns) == 5
        for kind, on in columns:
            assert issubclass(kind, torch.Tensor), columns
            assert on == device, columns


@pytest.mark.parametrize(
    "base",
    [
        pytest.param(keras_stage.models.Functional, id="Functional"),
        pytest.param(keras_stage.Model, id="Model"),
    ],
)
def test_a_train_step_override_takes_torch_tensors(base):
    # What a user's own `train_step` sees: Keras's torch step's data, torch
    # tensors (the stage's cut, the labels) on the trunk's device, not
    # TensorFlow's.
    import torch

    seen = []

    class Stepping(base):
        def train_step(self, data):
            seen.append(data)
            return super().train_step(data)

    x, y = make_data(64)
    model = staged_model(x, model_class=Stepping)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1
    assert len(seen) == 4
    device = model.get_layer("hidden").kernel.value.device
    for data in seen:
        leaves = keras.tree.flatten(data)
        # The cut (5 columns) and the labels.
        assert len(leaves) == 6, [t.shape for t in leaves]
        for t in leaves:
            assert isinstance(t, torch.Tensor), type(t)
            assert t.device == device, t.device


# -- saving and exporting --------------------------------------------------


def test_a_keras_file_round_trips_on_torch(tmp_path):
    x, y = make_data(64)
    model = staged_model(x)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    # The whole model: its preprocessing and its stage plan come back.
    assert isinstance(loaded, keras_stage.Model)
    assert [layer.name for layer in loaded.layers] == [
        layer.name for layer in model.layers
    ]
    assert loaded.get_stage_plan().staged_layers == (
        model.get_stage_plan().staged_layers
    )
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        loaded.predict(x, batch_size=16, verbose=0),
        model.predict(x, batch_size=16, verbose=0),
    )
    # It trains on, staged, from the raw strings.
    history = loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(history.history["stage_wait_ratio"]) == 1


def test_saved_on_torch_serves_raw_strings_on_tensorflow(tmp_path):
    x, y = make_data(64)
    model = staged_model(x)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    expected = model.predict(x, batch_size=16, verbose=0)
    sample = {k: v.tolist() for k, v in x.items()}
    dtypes = {k: str(v.dtype) for k, v in x.items()}
    script = (
        "import json, sys, numpy as np, keras, keras_stage\n"
        "assert keras.backend.backend() == 'tensorflow'\n"
        "x = json.loads(sys.stdin.read())\n"
        f"x = {{k: np.array(v, dtype={dtypes!r}[k]) for k, v in x.items()}}\n"
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
    np.testing.assert_allclose(served, expected, **CLOSE)


@pytest.mark.parametrize("format", ["tf_saved_model", "torch"])
def test_export_of_string_inputs_names_the_tensorflow_backend(tmp_path, format):
    x, y = make_data(32)
    model = staged_model(x)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    target = tmp_path / "exported"
    with pytest.raises(ValueError) as raised:
        model.export(str(target), format=format)
    message = str(raised.value)
    assert "cannot export on the torch backend" in message
    assert "KERAS_BACKEND=tensorflow" in message
    assert not target.exists()


# torch's, on saving a program whose constants are views (Normalization's).
@pytest.mark.filterwarnings("ignore:No complete tensor found:UserWarning")
def test_export_of_numeric_inputs_is_keras_s_own_on_torch(tmp_path):
    # A staged model of numbers exports as Keras exports it on torch: an
    # ExportedProgram (format="torch") computing the model's outputs.
    import torch

    keras.utils.set_random_seed(7)
    inputs = keras.Input(shape=(4,))
    x = keras_stage.layers.StagedInput()(inputs)
    x = keras.layers.Normalization(mean=0.5, variance=0.1)(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    data = np.random.rand(32, 4).astype("float32")
    model.fit(data, data[:, :1], batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "model.pt2"
    model.export(str(path), format="torch", verbose=False)
    program = torch.export.load(str(path))
    sample = data[:1]
    np.testing.assert_allclose(
        program.module()(torch.from_numpy(sample)).detach().numpy(),
        model.predict(sample, verbose=0),
        **CLOSE,
    )


def test_export_of_numeric_inputs_fails_only_as_plain_keras_does(tmp_path):
    # The default format (a TensorFlow SavedModel) goes through Keras's own
    # torch export: whatever Keras 3.15 does for the same plain model (on
    # torch 2.13 it fails in torch.export), the staged one does, with no
    # refusal of keras_stage's.
    def outcome(model_class, name):
        keras.utils.set_random_seed(7)
        inputs = keras.Input(shape=(4,))
        model = model_class(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        data = np.ones((8, 4), "float32")
        model.fit(data, data[:, :1], batch_size=4, epochs=1, verbose=0)
        try:
            model.export(str(tmp_path / name), verbose=False)
        except Exception as e:  # noqa: BLE001 - compared below
            return type(e), str(e).splitlines()[0]
        return None, sorted(os.listdir(tmp_path / name))

    assert outcome(keras_stage.Model, "staged") == outcome(keras.Model, "plain")


# -- exception policies and the timeout --------------------------------------


def test_ignored_exceptions_skip_bad_records_on_torch():
    # A record whose label fails a check in the staged pipeline: the stage
    # skips it and counts it, as on TensorFlow.
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
    steps = BatchRecorder()
    history = model.fit(
        dataset, epochs=1, shuffle=False, callbacks=[steps], verbose=0
    )
    assert history.history["stage_skipped"] == [1]
    assert len(steps.epochs[0]) == 7


@pytest.mark.timeout(60)
def test_a_blocked_source_times_out_on_torch_and_the_model_fits_again(
    release,
):
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


# -- random augmentation -----------------------------------------------------


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
    torch_state = keras.ops.convert_to_numpy(
        model.get_layer("flip").generator.state.value
    )
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
    # ...and the layer's own (torch) seed state is untouched by the stage.
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(
            model.get_layer("flip").generator.state.value
        ),
        torch_state,
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
        predictions[1],
        keras.ops.convert_to_numpy(model(IMAGES, training=False)),
        rtol=1e-5,
    )


def test_op_determinism_trains_on_torch():
    # The reproducibility recipe, in a fresh process (op determinism cannot
    # be turned off once on): two runs give the same losses.
    script = (
        "import numpy as np, keras, keras_stage, tensorflow as tf\n"
        "keras.utils.set_random_seed(1)\n"
        "tf.config.experimental.enable_op_determinism()\n"
        "words = np.array([f'w{i % 20}' for i in range(128)], dtype=object)\n"
        "y = np.linspace(0, 1, 128, dtype='float32')[:, None]\n"
        "inputs = keras.Input(shape=(), dtype='string')\n"
        "x = keras_stage.layers.StagedInput()(inputs)\n"
        "x = keras.layers.Embedding(16, 4)(keras.layers.Hashing(16)(x))\n"
        "x = keras.layers.Dropout(0.3)(x)\n"
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
            env={**os.environ, "KERAS_BACKEND": "torch"},
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(done.stdout.strip().splitlines()[-1])
    assert runs[0].startswith("LOSSES")
    assert runs[0] == runs[1]  # the same losses, run after run
