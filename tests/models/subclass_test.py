"""SmartStage of subclassed models on TensorFlow: the graph of their call.

A `keras_stage.Model` subclass stages the prefix the same model written
functionally stages, trains as the same subclass on `keras.Model` does
(equal weights), keeps its overrides' meaning, and where its call or an
override cannot be planned says so by name and trains as without
SmartStage.
"""

import io

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from benchmarks.workloads import recommenders
from tests.helpers import RECOMMENDER_STAGED

VOCABULARY = [f"w{i}" for i in range(20)]


def _fit(model, data, epochs=2):
    return model.fit(
        data, epochs=epochs, shuffle=False, verbose=0, validation_data=data
    ).history


def _words(rows=256, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "word": np.array([f"w{i}" for i in rng.integers(0, 24, rows)]),
        "count": rng.integers(0, 9, (rows, 1)),
    }
    return x, rng.normal(size=(rows, 1)).astype("float32")


def _batches(x):
    """`x` in batches: Keras's array adapter takes no NumPy strings."""
    return tf.data.Dataset.from_tensor_slices(x).batch(32)


def _dataset(data, seed=3):
    # Made per model after the seed is set: each fit draws its own orders.
    return tf.data.Dataset.from_tensor_slices(data).shuffle(256, seed).batch(32)


class _Words:
    """String and integer lookups, then a trainable trunk with Dropout (a
    mixin: `on(base)` makes it a model class)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stage = keras_stage.layers.StagedInput(name="stage")
        self.words = keras.layers.StringLookup(
            vocabulary=VOCABULARY, name="words"
        )
        self.counts = keras.layers.IntegerLookup(
            vocabulary=list(range(6)), name="counts"
        )
        self.word_emb = keras.layers.Embedding(21, 4, name="word_emb")
        self.count_emb = keras.layers.Embedding(7, 4, name="count_emb")
        self.drop = keras.layers.Dropout(0.2, name="drop")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, inputs, training=False):
        x = self.stage(inputs)
        words = self.word_emb(self.words(x["word"]))
        counts = self.count_emb(self.counts(x["count"]))[:, 0]
        h = keras.layers.concatenate([words, counts])
        return self.out(self.drop(h, training=training))


def on(mixin, base=keras_stage.Model):
    """`mixin`'s model class on `base` (`keras.Model`: the plain twin)."""
    return type(mixin.__name__.lstrip("_"), (mixin, base), {})


Words = keras.saving.register_keras_serializable("subclass_test")(on(_Words))


def _twins(mixin, **compile_kwargs):
    """`mixin` staged (SmartStage) and on `keras.Model`, both compiled."""
    models = []
    for base in (keras_stage.Model, keras.Model):
        keras.utils.set_random_seed(1)
        model = on(mixin, base)(name="words")
        kwargs = dict(compile_kwargs)
        if base is keras_stage.Model:
            kwargs["smart_stage"] = True
        model.compile(optimizer="adam", loss="mse", **kwargs)
        models.append(model)
    return models


def _same_fit(cls, **compile_kwargs):
    """Fits `cls` staged and plain; returns both models and histories."""
    data = _words()
    staged, plain = _twins(cls, **compile_kwargs)
    histories = []
    for model in (staged, plain):
        keras.utils.set_random_seed(1)
        histories.append(_fit(model, _dataset(data)))
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    for key, values in histories[1].items():  # the staged also has stage_*
        assert histories[0][key] == values, key
    return staged, plain


def test_subclass_stages_its_lookups_and_trains_as_plain_keras():
    staged, plain = _same_fit(_Words)
    plan = staged.get_stage_plan()
    assert plan.staged_layers == ["stage", "counts", "words"]
    assert plan.note == ""
    x = _batches(_words(64, seed=1)[0])
    np.testing.assert_array_equal(
        staged.predict(x, verbose=0), plain.predict(x, verbose=0)
    )


def test_subclass_plan_is_the_functional_models_plan():
    keras.utils.set_random_seed(1)
    subclass = Words(name="words")
    subclass.compile(optimizer="adam", loss="mse", smart_stage=True)
    subclass(next(iter(_batches(_words(4)[0]))))  # tells its input specs

    inputs = {
        "word": keras.Input(shape=(), dtype="string", name="word"),
        "count": keras.Input(shape=(1,), dtype="int64", name="count"),
    }
    layers = Words(name="layers")  # its layers, called functionally
    x = keras_stage.layers.StagedInput(name="stage")(inputs)
    words = layers.word_emb(
        keras.layers.StringLookup(vocabulary=VOCABULARY, name="words")(
            x["word"]
        )
    )
    counts = layers.count_emb(
        keras.layers.IntegerLookup(vocabulary=list(range(6)), name="counts")(
            x["count"]
        )
    )[:, 0]
    h = keras.layers.concatenate([words, counts])
    functional = keras_stage.Model(
        inputs, layers.out(layers.drop(h)), name="words"
    )
    functional.compile(optimizer="adam", loss="mse", smart_stage=True)

    ours, theirs = subclass.get_stage_plan(), functional.get_stage_plan()
    assert ours.staged_layers == theirs.staged_layers
    assert [b.get_config() for b in ours.boundary] == [
        b.get_config() for b in theirs.boundary
    ]
    assert ours.cut_reason == theirs.cut_reason
    staged_reasons = {
        k: v for k, v in ours.reasons.items() if k in ours.trunk_layers
    }
    assert staged_reasons["word_emb"] == theirs.reasons["word_emb"]

    def summary(model):
        out = io.StringIO()
        model.stage_summary(print_fn=lambda line: out.write(line + "\n"))
        # Keras ops' names count up per process: not the layers'.
        return [
            line
            for line in out.getvalue().splitlines()
            if "get_item" not in line and "concatenate" not in line
        ]

    assert summary(subclass) == summary(functional)


@pytest.mark.parametrize("name", sorted(recommenders.MODELS))
def test_keras_rs_recommender_trains_as_plain_keras(name):
    data = recommenders.MODELS[name][1](1024)
    models, histories = [], []
    for base in (keras_stage.Model, keras.Model):
        model = recommenders.build(name, base)
        histories.append(
            model.fit(
                recommenders.dataset(data, 128, seed=5),
                epochs=2,
                validation_data=recommenders.dataset(data, 256),
                shuffle=False,
                verbose=0,
            ).history
        )
        models.append(model)
    staged, plain = models
    assert staged.get_stage_plan().staged_layers == RECOMMENDER_STAGED[name]
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert histories[0]["val_loss"] == histories[1]["val_loss"]
    test = recommenders.dataset(data, 256)
    keras.tree.map_structure(
        np.testing.assert_array_equal,
        staged.predict(test, verbose=0),
        plain.predict(test, verbose=0),
    )


def test_retrieval_branches_on_training_with_a_trunk_per_flag():
    # Its call skips the top-k scoring in training: the plan is the same
    # in both, each flag's trunk is its own graph.
    data = recommenders.movielens(512)
    model = recommenders.build("retrieval", keras_stage.Model)
    model.fit(recommenders.dataset(data, 128), shuffle=False, verbose=0)
    out = model.predict(recommenders.dataset(data, 128), verbose=0)
    assert sorted(out) == [
        "movie_embeddings",
        "predictions",
        "user_embeddings",
    ]
    assert out["predictions"].shape == (512, 10)


class OwnTrainStep(_Words):
    """keras.io's "customizing fit" steps: the model through `self(x)`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}

    def test_step(self, data):
        x, y = data
        return {"loss": self.compute_loss(x=x, y=y, y_pred=self(x))}


def test_own_train_step_through_self_is_planned_and_trains_as_plain():
    staged, _ = _same_fit(OwnTrainStep)
    assert "words" in staged.get_stage_plan().staged_layers


class LayerInStep(_Words):
    """A step calling one of the model's layers itself."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            ids = self.words(x["word"])
            y_pred = self(x, training=True) + 0.0 * keras.ops.cast(
                keras.ops.sum(ids), "float32"
            )
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


class LossReadsX(_Words):
    """A loss that reads the raw inputs."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        weight = keras.ops.cast(keras.ops.shape(x["count"])[0], "float32")
        return keras.ops.mean((y - y_pred) ** 2) * weight / weight


class LayerMadeInCall(_Words):
    def call(self, inputs, training=False):
        x = self.stage(inputs)
        ids = keras.layers.StringLookup(vocabulary=VOCABULARY)(x["word"])
        return self.out(self.word_emb(ids))


@pytest.mark.parametrize(
    ("cls", "why"),
    [
        (LayerInStep, "its train_step calls layer 'words' directly"),
        (LossReadsX, "its compute_loss reads its `x` argument"),
        pytest.param(
            LayerMadeInCall,
            "its call makes layer 'string_lookup",
            # Keras's own, building it by tracing its call eagerly.
            marks=pytest.mark.filterwarnings("ignore:`build\\(\\)` was called"),
        ),
    ],
)
def test_unplannable_subclass_says_why_and_trains_as_plain(cls, why):
    staged, plain = _twins(cls)
    staged(next(iter(_batches(_words(4)[0]))))  # tells its input specs
    plan = staged.get_stage_plan()
    assert why in plan.note
    assert plan.staged_layers == []
    if cls is LayerMadeInCall:
        return  # a new layer per call: no two runs share weights
    data = _words()
    with pytest.warns(UserWarning, match=why):
        keras.utils.set_random_seed(1)
        _fit(staged, _dataset(data))
    keras.utils.set_random_seed(1)
    _fit(plain, _dataset(data))
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_plan_waits_for_the_inputs_then_plans_from_the_data():
    keras.utils.set_random_seed(1)
    model = Words(name="words")
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    assert "has not seen data yet" in model.get_stage_plan().note
    _fit(model, _dataset(_words()), epochs=1)
    assert model.get_stage_plan().staged_layers == ["stage", "counts", "words"]


def test_saved_subclass_loads_with_its_plan_and_trains_on(tmp_path):
    data = _words()
    keras.utils.set_random_seed(1)
    model = Words(name="words")
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    _fit(model, _dataset(data), epochs=1)
    path = tmp_path / "words.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is Words and loaded.smart_stage is True
    x = _batches(_words(64, seed=1)[0])
    np.testing.assert_array_equal(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    assert loaded.get_stage_plan().staged_layers == ["stage", "counts", "words"]
    history = _fit(loaded, _dataset(data), epochs=1)
    assert np.isfinite(history["loss"][0])


class ParseNumbers(keras.layers.Layer):
    """A user's stateless layer of TensorFlow ops: "1.5" -> 1.5."""

    def call(self, lines):
        return tf.strings.to_number(lines, tf.float32)

    def compute_output_spec(self, lines):
        return keras.KerasTensor(lines.shape, "float32")


class _Parsed:
    """String parsing, Hashing, Normalization and a frozen sub-model before
    the trunk (a mixin: `on(base)`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stage = keras_stage.layers.StagedInput(name="stage")
        self.parse = ParseNumbers(name="parse")
        self.norm = keras.layers.Normalization(
            mean=3.0, variance=4.0, name="norm"
        )
        self.norm.build((None, 1))
        self.hash = keras.layers.Hashing(num_bins=8, name="hash")
        features = keras.Input(shape=(1,), name="features")
        self.frozen = keras.Model(
            features,
            keras.layers.Dense(4, name="encoder")(features),
            name="frozen",
        )
        self.frozen.trainable = False
        self.emb = keras.layers.Embedding(8, 4, name="emb")
        self.out = keras.layers.Dense(1, name="out")

    def call(self, inputs):
        x = self.stage(inputs)
        encoded = self.frozen(self.norm(self.parse(x["number"])))
        hashed = self.emb(self.hash(x["word"]))
        return self.out(keras.layers.concatenate([encoded, hashed]))


class MetricsFromPredictions(_Words):
    """keras-rs's `compute_metrics` override, on `y` and `y_pred`."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        self.error.update_state(keras.ops.mean(keras.ops.abs(y - y_pred)))
        return self.get_metrics_result()

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.error = keras.metrics.Mean(name="error")


def test_compute_metrics_on_predictions_keeps_its_meaning():
    staged, _ = _same_fit(MetricsFromPredictions)
    assert "words" in staged.get_stage_plan().staged_layers


def test_parsing_hashing_normalization_and_a_frozen_model_are_staged():
    rng = np.random.default_rng(0)
    x = {
        "number": np.array([[f"{v:.2f}"] for v in rng.normal(3, 2, 256)]),
        "word": np.array([f"w{i}" for i in rng.integers(0, 30, 256)]),
    }
    data = (x, rng.normal(size=(256, 1)).astype("float32"))
    models = []
    for base in (keras_stage.Model, keras.Model):
        keras.utils.set_random_seed(1)
        model = on(_Parsed, base)(name="parsed")
        kwargs = {"smart_stage": True} if base is keras_stage.Model else {}
        model.compile(optimizer="adam", loss="mse", **kwargs)
        keras.utils.set_random_seed(1)
        _fit(model, _dataset(data))
        models.append(model)
    staged, plain = models
    assert sorted(staged.get_stage_plan().staged_layers) == [
        "frozen",
        "hash",
        "norm",
        "parse",
        "stage",
    ]
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
