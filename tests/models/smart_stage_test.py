"""compile(smart_stage=True) trains exactly like the whole model.

Each equality test builds the same model twice with the same initial
weights, compiles one with `smart_stage=True` and one plain, seeds the
same way right before each `fit`, and checks losses and final weights.
The other tests cover what the split must keep: the user's model whole,
save/load, raw-input predict, random layers, XLA on the trunk, and the
models smart_stage cannot look into.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.data import stage
from keras_stage.layers import StagedInput
from tests.helpers import (
    count_step_traces,
    staged_prefix_outputs,
    twin_optimizer,
)

pytestmark = pytest.mark.timeout(120)

FIT_SEED = 11
_rng = np.random.default_rng(0)
N = 45  # not a multiple of the batch size: a partial last batch
X = _rng.normal(size=(N, 4)).astype("float32")
Y = _rng.normal(size=(N, 1)).astype("float32")
SW = _rng.random(size=(N,)).astype("float32")
WORDS = np.array([f"w{i % 13}" for i in range(N)], dtype=object)


@keras.saving.register_keras_serializable(package="keras_stage_tests")
class SplitHalves(keras.layers.Layer):
    """Returns a list and a dict: both kinds of structured output."""

    def call(self, x):
        return [x[:, :2], x[:, 2:]], {"sum": keras.ops.sum(x, axis=-1)}

    def compute_output_spec(self, x):
        # Distinct tensors: Keras maps outputs by identity.
        halves = [keras.KerasTensor((x.shape[0], 2), x.dtype) for _ in "ab"]
        total = keras.KerasTensor((x.shape[0],), x.dtype)
        return halves, {"sum": total}


def _twins(build, **compile_kwargs):
    """A smart-staged model and a plain one with the same weights."""
    staged, plain = build(), build()
    plain.set_weights(staged.get_weights())
    kwargs = {"optimizer": twin_optimizer(), "loss": "mse"}
    kwargs.update(compile_kwargs)
    staged.compile(**kwargs, smart_stage=True)
    kwargs["optimizer"] = twin_optimizer()
    plain.compile(**kwargs, smart_stage=False)
    return staged, plain


def _fit_both(staged, plain, *args, **kwargs):
    kwargs.setdefault("epochs", 3)
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("verbose", 0)
    keras.utils.set_random_seed(FIT_SEED)
    a = staged.fit(*args, **kwargs)
    keras.utils.set_random_seed(FIT_SEED)
    b = plain.fit(*args, **kwargs)
    return a.history, b.history


def _assert_same_training(staged, plain, h_staged, h_plain):
    for key, values in h_plain.items():
        if not key.startswith("stage_"):
            np.testing.assert_allclose(
                h_staged[key], values, rtol=1e-5, atol=1e-6, err_msg=key
            )
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _preprocessed_dense():
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(capacity=2, num_threads=2, name="stage")(inputs)
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(X)
    x = norm(keras.layers.Rescaling(2.0, name="rescale")(x))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    return keras_stage.Model(inputs, outputs)


def test_fit_with_validation_and_sample_weight_equals_plain_fit(monkeypatch):
    # Each trace of the staged steps (the trunk's) is counted: Keras builds
    # the optimizer and the compile metrics inside a step's first trace,
    # and a `tf.function` that creates variables is traced twice; the
    # staged call builds them first, with the same variables.
    traced = count_step_traces(monkeypatch)
    staged, plain = _twins(_preprocessed_dense, weighted_metrics=["mae"])
    assert staged.get_stage_plan().staged_layers == [
        "stage",
        "rescale",
        "norm",
    ]
    histories = _fit_both(
        staged,
        plain,
        X,
        Y,
        sample_weight=SW,
        shuffle=True,
        validation_data=(X[:10], Y[:10]),
    )
    _assert_same_training(staged, plain, *histories)
    assert "val_mae" in histories[0]
    assert sorted(p for name, p in traced if name == staged.name) == [
        "test",
        "train",
    ]
    assert [v.name for v in staged.optimizer.variables] == [
        v.name for v in plain.optimizer.variables
    ]
    assert [v.name for v in staged.metrics_variables] == [
        v.name for v in plain.metrics_variables
    ]


def test_sequential_equals_plain_fit():
    def build():
        keras.utils.set_random_seed(3)
        return keras_stage.Sequential(
            [
                keras.Input(shape=(4,)),
                StagedInput(capacity=2, num_threads=2),
                keras.layers.Rescaling(0.5, name="rescale"),
                keras.layers.Dense(4, name="hidden"),
                keras.layers.Dense(1, name="head"),
            ]
        )

    staged, plain = _twins(build)
    plan = staged.get_stage_plan()
    assert plan.staged_layers[1:] == ["rescale"]
    assert plan.trunk_layers == ["hidden", "head"]
    _assert_same_training(
        staged, plain, *_fit_both(staged, plain, X, Y, shuffle=True)
    )


def test_dict_inputs_dict_outputs_and_structured_layers():
    def build():
        keras.utils.set_random_seed(3)
        inputs = {
            "a": keras.Input(shape=(4,), name="a"),
            "b": keras.Input(shape=(), dtype="string", name="b"),
        }
        x = StagedInput(capacity=2, num_threads=2, name="stage")(inputs)
        halves, extra = SplitHalves(name="split")(x["a"])
        ids = keras.layers.StringLookup(
            vocabulary=[f"w{i}" for i in range(13)], name="lookup"
        )(x["b"])
        emb = keras.layers.Flatten(name="flat")(
            keras.layers.Embedding(20, 3, name="emb")(ids[:, None])
        )
        total = keras.layers.Reshape((1,), name="total")(extra["sum"])
        merged = keras.layers.Concatenate(name="concat")(
            [halves[0], halves[1], total, emb]
        )
        return keras_stage.Model(
            inputs,
            {
                "y": keras.layers.Dense(1, name="y")(merged),
                # A staged output: the trunk passes it through.
                "aux": total,
            },
        )

    staged, plain = _twins(
        build,
        loss={"y": "mse", "aux": "mse"},
        loss_weights={"y": 1.0, "aux": 0.0},
    )
    plan = staged.get_stage_plan()
    # `get_item` is the Keras op of `ids[:, None]`: staged too.
    assert plan.staged_layers == [
        "stage",
        "lookup",
        "get_item",
        "split",
        "total",
    ]
    assert plan.trunk_layers == ["emb", "flat", "concat", "y"]
    assert plan.reasons["flat"] == "depends on trunk layer 'emb'"
    assert [(t.name, t.dtype, t.shape) for t in plan.boundary] == [
        ("get_item", "int64", (None, 1)),
        ("split[0]", "float32", (None, 2)),
        ("split[1]", "float32", (None, 2)),
        ("total", "float32", (None, 1)),
    ]
    x = {"a": X, "b": WORDS}
    y = {"y": Y, "aux": X.sum(axis=1, keepdims=True)}
    _assert_same_training(
        staged, plain, *_fit_both(staged, plain, x, y, shuffle=True)
    )
    a, b = staged.predict(x, verbose=0), plain.predict(x, verbose=0)
    np.testing.assert_allclose(a["y"], b["y"], rtol=1e-6)
    np.testing.assert_allclose(a["aux"], b["aux"], rtol=1e-6)


def test_class_weight_and_steps_per_execution():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=(4,))
        x = StagedInput(capacity=2, num_threads=2)(inputs)
        x = keras.layers.Rescaling(0.5)(x)
        outputs = keras.layers.Dense(1, activation="sigmoid")(x)
        return keras_stage.Model(inputs, outputs)

    labels = (Y > 0).astype("float32")
    staged, plain = _twins(
        build,
        loss="binary_crossentropy",
        metrics=["accuracy"],
        steps_per_execution=3,
    )
    histories = _fit_both(
        staged, plain, X, labels, class_weight={0: 1.0, 1: 3.0}
    )
    _assert_same_training(staged, plain, *histories)


def test_empty_stage_trains_normally():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=(4,))
        x = StagedInput(name="stage")(inputs)
        outputs = keras.layers.Dense(1, name="head")(x)
        return keras_stage.Model(inputs, outputs)

    staged, plain = _twins(build)
    plan = staged.get_stage_plan()
    assert plan.staged_layers == ["stage"]
    assert plan.trunk_layers == ["head"]
    _assert_same_training(staged, plain, *_fit_both(staged, plain, X, Y))


def test_model_stays_whole_after_a_staged_fit(tmp_path):
    staged, plain = _twins(_preprocessed_dense)
    layers = [layer.name for layer in staged.layers]
    n_weights = len(staged.weights)
    _fit_both(staged, plain, X, Y, epochs=1)
    assert [layer.name for layer in staged.layers] == layers
    assert len(staged.weights) == n_weights
    # Raw-input predict, evaluate and call all run the whole model.
    np.testing.assert_allclose(
        staged.predict(X, verbose=0), plain.predict(X, verbose=0), rtol=1e-6
    )
    np.testing.assert_allclose(
        staged.evaluate(X, Y, verbose=0),
        plain.evaluate(X, Y, verbose=0),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        staged(X), plain.predict(X, verbose=0), rtol=1e-5, atol=1e-6
    )
    # Keras's own plain steps still work on raw data (the README suggests
    # predict_on_batch for small inputs: it builds no stage).
    np.testing.assert_allclose(
        staged.predict_on_batch(X[:8]),
        plain.predict(X[:8], verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        staged.test_on_batch(X[:8], Y[:8]),
        plain.test_on_batch(X[:8], Y[:8]),
        rtol=1e-6,
    )
    staged.train_on_batch(X[:8], Y[:8])
    path = tmp_path / "m.keras"
    staged.save(path)
    loaded = keras.saving.load_model(path)
    assert [layer.name for layer in loaded.layers] == layers
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), staged.predict(X, verbose=0), rtol=1e-6
    )


def test_keras_round_trip_keeps_smart_stage_and_plan(tmp_path):
    model = _preprocessed_dense()
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    # Trained first: a never-built optimizer does not load back silently.
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    plan = model.get_stage_plan()
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.smart_stage is True
    assert loaded.get_stage_plan() == plan
    loaded.fit(X, Y, batch_size=8, epochs=1, verbose=0)


def test_jit_compile_applies_to_a_string_free_trunk():
    @keras.saving.register_keras_serializable(package="keras_stage_tests")
    class HashWords(keras.layers.Layer):
        # Supports "jit" by Keras's flag, but strings cannot go to XLA.
        def call(self, x):
            return tf.strings.to_hash_bucket_fast(x, 32)

        def compute_output_spec(self, x):
            return keras.KerasTensor(x.shape, "int64")

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=(), dtype="string")
        x = StagedInput(capacity=2, num_threads=2)(inputs)
        x = keras.layers.Embedding(32, 4)(HashWords()(x))
        outputs = keras.layers.Dense(1)(x)
        return keras_stage.Model(inputs, outputs)

    whole = build()
    whole.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(Exception, match="(?i)xla|string|compil"):
        whole.fit(WORDS, Y, batch_size=8, epochs=1, verbose=0)

    staged, plain = build(), build()
    plain.set_weights(staged.get_weights())
    staged.compile(
        optimizer=twin_optimizer(),
        loss="mse",
        jit_compile=True,
        smart_stage=True,
    )
    plain.compile(optimizer=twin_optimizer(), loss="mse")
    seen = {}

    class JitProbe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen["jit"] = self.model.jit_compile

        def on_predict_batch_end(self, batch, logs=None):
            seen["predict_jit"] = self.model.jit_compile

    keras.utils.set_random_seed(FIT_SEED)
    staged.fit(
        WORDS, Y, batch_size=8, epochs=2, verbose=0, callbacks=[JitProbe()]
    )
    keras.utils.set_random_seed(FIT_SEED)
    plain.fit(WORDS, Y, batch_size=8, epochs=2, verbose=0)
    assert seen["jit"] is True
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # predict's staged trunk is compiled too.
    np.testing.assert_allclose(
        staged.predict(WORDS, batch_size=8, verbose=0, callbacks=[JitProbe()]),
        plain.predict(WORDS, batch_size=8, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    assert seen["predict_jit"] is True


def _noisy_model(num_threads=4):
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(4,))
    x = StagedInput(capacity=2, num_threads=num_threads, name="stage")(inputs)
    x = keras.layers.GaussianNoise(1.0, seed=5, name="noise")(x)
    x = keras.layers.Dropout(0.3, seed=6, name="drop")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    model = keras_stage.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    return model


def test_random_layers_get_their_own_deterministic_seed_stream():
    model = _noisy_model()
    assert model.get_stage_plan().staged_layers == ["stage", "noise", "drop"]
    first, second = staged_prefix_outputs(model, X, 5, epochs=2)
    # Every batch of every epoch gets fresh noise...
    batches = [b.tobytes() for b in first + second]
    assert len(set(batches)) == len(batches)
    # ...the same noise in a rebuilt stage with 4 threads, whatever thread
    # runs which batch...
    again = staged_prefix_outputs(_noisy_model(), X, 5, epochs=2)
    np.testing.assert_array_equal(np.stack(first), np.stack(again[0]))
    # ...and the model's own seed state is untouched by the stage.
    state = model.get_layer("noise").seed_generator.state.numpy()
    staged_prefix_outputs(model, X, 5, epochs=1)
    np.testing.assert_array_equal(
        model.get_layer("noise").seed_generator.state.numpy(), state
    )


def test_staged_random_layers_train_deterministically():
    weights = []
    for _ in range(2):
        model = _noisy_model(num_threads=4)
        keras.utils.set_random_seed(FIT_SEED)
        model.fit(X, Y, batch_size=5, epochs=2, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights, strict=True):
        np.testing.assert_array_equal(a, b)


def _noisy_fit(model, data, epochs, **kwargs):
    keras.utils.set_random_seed(FIT_SEED)
    return model.fit(data, epochs=epochs, verbose=0, shuffle=False, **kwargs)


def _noisy_data():
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(5)


def test_staged_random_layers_number_one_iterator_as_one_per_epoch(tmp_path):
    # Long-lived, the fit's one iterator reads ahead of Keras: the elements
    # still get the ordinals an iterator per epoch gives them, and the
    # count Keras took is what the next iterator numbers on from.
    batches = -(-N // 5)
    long_lived = _noisy_model()
    _noisy_fit(long_lived, _noisy_data(), 3)
    kept = long_lived._keras_stage_state.stages["train"]
    assert kept.long_lived is not None  # the epochs ran on one iterator
    split = long_lived._keras_stage_state.split
    assert int(split.ordinal.numpy()) == 3 * batches
    per_epoch = _noisy_model()
    # BackupAndRestore checkpoints each epoch's iterator: one per epoch.
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    _noisy_fit(per_epoch, _noisy_data(), 3, callbacks=[backup])
    assert per_epoch._keras_stage_state.stages["train"].long_lived is None
    for a, b in zip(
        long_lived.get_weights(), per_epoch.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_staged_random_layers_keep_their_stage_across_calls():
    # A user's loop of fit(epochs=1) on one dataset reuses the stage and
    # its iterator, and draws what one fit of as many epochs draws; a fit
    # on another dataset object then numbers on from the batches taken.
    batches = -(-N // 5)
    data, other = _noisy_data(), _noisy_data()
    looped = _noisy_model()
    for call in range(1, 4):
        _noisy_fit(looped, data, 1)
        split = looped._keras_stage_state.split
        assert int(split.ordinal.numpy()) == call * batches
        looped.evaluate(data, verbose=0)  # evaluation draws no number
        assert int(split.ordinal.numpy()) == call * batches
    kept = looped._keras_stage_state.stages["train"]
    assert kept.carries()  # its iterator runs on into the next call
    assert kept._shared.iterators_made == 1
    _noisy_fit(looped, other, 1)
    once = _noisy_model()
    _noisy_fit(once, data, 3)
    _noisy_fit(once, other, 1)
    for a, b in zip(looped.get_weights(), once.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_without_staged_input_stages_from_the_inputs_and_says_so(caplog):
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=(4,))
        x = keras.layers.Rescaling(0.5, name="rescale")(inputs)
        outputs = keras.layers.Dense(1, name="head")(x)
        return keras_stage.Model(inputs, outputs)

    staged, plain = _twins(build)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        histories = _fit_both(staged, plain, X, Y, shuffle=True)
        _assert_same_training(staged, plain, *histories)
        staged.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    notes = [r for r in caplog.records if "no StagedInput" in r.getMessage()]
    assert len(notes) == 1
    assert "stage_wait_ratio" in histories[0]


def test_unplannable_subclassed_model_warns_once_and_stages_data_only():
    class Sub(keras_stage.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.last = None

        def call(self, x):
            self.last = x  # a side effect: its call is not planned
            return self.dense(x)

    model = Sub()
    model(X[:1])
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    with pytest.warns(UserWarning, match="Subclassed model") as record:
        history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert len([w for w in record if "Subclassed" in str(w.message)]) == 1
    assert "stage_wait_ratio" in history.history


def test_pre_staged_dataset_runs_the_whole_model(caplog):
    model = _preprocessed_dense()
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    staged = stage(dataset, capacity=2)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        history = model.fit(staged, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert any("whole model" in r.getMessage() for r in caplog.records)


def test_nested_models_equal_plain_fit():
    def build():
        keras.utils.set_random_seed(3)
        raw = keras.Input(shape=(4,), name="raw")
        preprocess = keras.Model(
            raw, keras.layers.Rescaling(0.5)(raw), name="preprocess"
        )
        features = keras.Input(shape=(4,), name="features")
        tower = keras.Model(
            features, keras.layers.Dense(3)(features), name="tower"
        )
        inputs = keras.Input(shape=(4,), name="x")
        x = StagedInput(capacity=2, num_threads=2)(inputs)
        outputs = keras.layers.Dense(1)(tower(preprocess(x)))
        return keras_stage.Model(inputs, outputs)

    staged, plain = _twins(build)
    assert "preprocess" in staged.get_stage_plan().staged_layers
    assert "tower" in staged.get_stage_plan().trunk_layers
    _assert_same_training(
        staged, plain, *_fit_both(staged, plain, X, Y, shuffle=True)
    )


@keras.saving.register_keras_serializable(package="keras_stage_tests")
class ParsePairs(keras.layers.Layer):
    """ "1.5,-2.0" -> [1.5, -2.0]: strings in, floats of another shape out."""

    def call(self, lines):
        a, b = tf.io.decode_csv(lines, record_defaults=[[0.0], [0.0]])
        return tf.stack([a, b], axis=-1)

    def compute_output_spec(self, lines):
        return keras.KerasTensor((lines.shape[0], 2), "float32")


class CountedRescaling(keras.layers.Rescaling):
    """A Rescaling counting its calls (each trace runs it once)."""

    calls = 0

    def call(self, inputs):
        type(self).calls += 1
        return super().call(inputs)


def test_a_first_fit_runs_the_staged_layers_python_twice(monkeypatch):
    # Once in the plan's trace, once in the stage's: the metrics and loss
    # are built through the trunk from the stage's element, not by a third,
    # symbolic, call of the whole model (what a FeatureSpace prefix pays
    # most for). They are the variables plain Keras builds.
    monkeypatch.setattr(CountedRescaling, "calls", 0)

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=(4,), name="x")
        x = StagedInput(capacity=2, num_threads=2)(inputs)
        x = CountedRescaling(2.0, name="rescale")(x)
        outputs = keras.layers.Dense(1, name="head")(x)
        return keras_stage.Model(inputs, outputs)

    staged, plain = _twins(build, metrics=["mae"])
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8)
    histories = []
    calls = []
    for model in (staged, plain):
        before = CountedRescaling.calls
        keras.utils.set_random_seed(FIT_SEED)
        histories.append(
            model.fit(
                data,
                epochs=1,
                validation_data=data.take(1),
                shuffle=False,
                verbose=0,
            )
        )
        calls.append(CountedRescaling.calls - before)
    _assert_same_training(staged, plain, *(h.history for h in histories))
    # The fit ran staged (an unstaged fit logs `stage_unstaged` 1).
    assert histories[0].history.get("stage_unstaged", [0]) == [0]
    assert histories[0].history["stage_skipped"] == [0]
    assert [v.name for v in staged.metrics_variables] == [
        v.name for v in plain.metrics_variables
    ]
    # Plain Keras traces its train step twice (its first trace creates
    # variables) and its test step once.
    assert calls == [2, 3], calls


def test_split_under_a_distribution_strategy_builds_before_keras_does():
    # Under a strategy Keras builds metrics by calling the model on a batch
    # before the first step, which with SmartStage would be the cut; the
    # staged call builds them first (through the trunk, from the stage's
    # element), and Keras's build then has nothing to do.
    lines = np.array([f"{a:.3f},{b:.3f}" for a, b in X[:, :2]], dtype=object)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")

    def build():
        keras.utils.set_random_seed(3)
        with strategy.scope():
            inputs = keras.Input(shape=(), dtype="string")
            x = StagedInput(capacity=2, num_threads=2)(inputs)
            outputs = keras.layers.Dense(1)(ParsePairs(name="parse")(x))
            return keras_stage.Model(inputs, outputs)

    staged, plain = build(), build()
    plain.set_weights(staged.get_weights())
    with strategy.scope():
        staged.compile(
            optimizer="sgd", loss="mse", metrics=["mae"], smart_stage=True
        )
        plain.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    assert staged.get_stage_plan().staged_layers[1:] == ["parse"]
    histories = _fit_both(
        staged,
        plain,
        lines,
        Y,
        epochs=2,
        validation_data=(lines[:10], Y[:10]),
    )
    _assert_same_training(staged, plain, *histories)
    np.testing.assert_allclose(
        staged.evaluate(lines, Y, verbose=0),
        plain.evaluate(lines, Y, verbose=0),
        rtol=1e-6,
    )


def test_frozen_layers_run_in_the_stage_and_train_the_same():
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=(4,))
        x = StagedInput(capacity=2, num_threads=2)(inputs)
        encoder = keras.layers.Dense(6, activation="tanh", name="encoder")
        encoder.trainable = False  # a pretrained, frozen encoder
        outputs = keras.layers.Dense(1, name="head")(encoder(x))
        return keras_stage.Model(inputs, outputs)

    staged, plain = _twins(build)
    plan = staged.get_stage_plan()
    assert plan.staged_layers[1:] == ["encoder"]
    assert plan.trunk_layers == ["head"]
    frozen = staged.get_layer("encoder").get_weights()
    _assert_same_training(
        staged, plain, *_fit_both(staged, plain, X, Y, shuffle=True)
    )
    for a, b in zip(
        staged.get_layer("encoder").get_weights(), frozen, strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_export_after_a_staged_fit_serves_raw_inputs(tmp_path):
    staged, plain = _twins(_preprocessed_dense)
    _fit_both(staged, plain, X, Y, epochs=1)
    staged.export(str(tmp_path / "exported"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "exported"))
    np.testing.assert_allclose(
        served.serve(tf.constant(X)),
        plain.predict(X, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_masked_sequences_train_the_same():
    seq = _rng.normal(size=(N, 5, 2)).astype("float32")
    seq[::3, 3:] = 0.0  # padded steps, masked out

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input(shape=(5, 2))
        x = StagedInput(capacity=2, num_threads=2)(inputs)
        x = keras.layers.Masking(0.0)(keras.layers.Rescaling(2.0)(x))
        x = keras.layers.Dense(3)(x)
        outputs = keras.layers.Dense(1)(
            keras.layers.GlobalAveragePooling1D()(x)
        )
        return keras_stage.Model(inputs, outputs)

    staged, plain = _twins(build)
    _assert_same_training(
        staged, plain, *_fit_both(staged, plain, seq, Y, shuffle=True)
    )
    np.testing.assert_allclose(
        staged.predict(seq, verbose=0), plain.predict(seq, verbose=0), rtol=1e-6
    )
