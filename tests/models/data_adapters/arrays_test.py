"""Tests for keras_stage/models/data_adapters/arrays.py.

Keras's batches of in-memory arrays, gathered, and how many a call reads.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage import _compat
from keras_stage.models.data_adapters.arrays import (
    array_batches,
    batch_count,
)

ROWS = 25  # 6 batches of 4 and a partial one of 1


def _keras_adapter(x, **kwargs):
    """Keras's adapter of `x`, its other arguments defaulted as fit's."""
    args = dict(
        y=None,
        sample_weight=None,
        batch_size=None,
        steps_per_epoch=None,
        shuffle=False,
        class_weight=None,
    )
    args.update(kwargs)
    return _compat.get_data_adapter(x=x, **args)


def _adapter(shuffle, **kwargs):
    x = {
        "a": np.arange(ROWS * 2, dtype="float64").reshape(ROWS, 2),
        "s": np.array([f"row{i}" for i in range(ROWS)], dtype=object),
    }
    args = dict(y=np.arange(ROWS) % 3, batch_size=4, shuffle=shuffle)
    args.update(kwargs)
    return _keras_adapter(x, **args)


def _epochs(dataset, count=2):
    return [
        [keras.tree.map_structure(lambda t: t.numpy(), b) for b in dataset]
        for _ in range(count)
    ]


def _assert_same_batches(expected, got):
    tf.nest.assert_same_structure(expected, got)
    for want, have in zip(
        tf.nest.flatten(expected), tf.nest.flatten(got), strict=True
    ):
        assert want.dtype == have.dtype
        np.testing.assert_array_equal(want, have)


@pytest.mark.parametrize("shuffle", [False, True, "batch"])
@pytest.mark.parametrize(
    "weights",
    [
        {},
        {"sample_weight": np.linspace(0.0, 1.0, ROWS)},
        {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}},
    ],
    ids=["none", "sample_weight", "class_weight"],
)
def test_the_batches_are_keras_s_in_keras_s_order(shuffle, weights):
    keras.utils.set_random_seed(7)
    expected = _adapter(shuffle, **weights).get_tf_dataset()
    want = _epochs(expected)
    keras.utils.set_random_seed(7)
    dataset = array_batches(_adapter(shuffle, **weights), shuffle).dataset()
    assert dataset.element_spec == expected.element_spec
    _assert_same_batches(want, _epochs(dataset))
    if shuffle:  # the order is Keras's shuffle, not the rows' order
        labels = np.concatenate([batch[1] for batch in want[0]])
        assert not np.array_equal(labels, np.arange(ROWS) % 3)


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_spec_is_the_gathered_batches_spec(shuffle):
    batches = array_batches(
        _adapter(shuffle, sample_weight=np.ones(ROWS)), shuffle
    )
    assert batches.element_spec == batches.dataset().element_spec


@pytest.mark.parametrize("numbered", [False, True])
def test_the_staged_fn_gathers_each_index_batch(numbered):
    # A stage over the index batches runs `fn` on what the gathered
    # dataset (numbered as `StageSplit.number` numbers it) would give.
    batches = array_batches(_adapter(False), False)
    indices = next(iter(batches.indices))
    gathered = next(iter(batches.dataset()))
    seen = []
    fn = batches.staged_fn(lambda element: seen.append(element) or 0, numbered)
    if numbered:
        fn((tf.constant(5, tf.int64), (indices,)))
        (ordinal, got), want = seen[0], (5, gathered)
        assert int(ordinal) == want[0]
        _assert_same_batches(_numpy(want[1]), _numpy(got))
    else:
        fn(indices)
        _assert_same_batches(_numpy(gathered), _numpy(seen[0]))


def _numpy(batch):
    return keras.tree.map_structure(lambda t: t.numpy(), batch)


def test_floats_are_cast_to_floatx_as_keras_does():
    dataset = array_batches(_adapter(False), False).dataset()
    assert dataset.element_spec[0]["a"].dtype == tf.float32


def test_the_options_are_those_keras_sets():
    # On the index batches (what a stage with a prefix stages) and on the
    # gathered ones.
    for shuffle in (False, True):
        batches = array_batches(_adapter(shuffle), shuffle)
        for dataset in (batches.indices, batches.dataset()):
            options = dataset.options()
            optimization = options.experimental_optimization
            assert not optimization.apply_default_optimizations
            assert (
                options.experimental_distribute.auto_shard_policy
                == tf.data.experimental.AutoShardPolicy.DATA
            )


def test_other_sources_keep_keras_s_dataset():
    adapter = _keras_adapter(tf.data.Dataset.range(4).batch(2))
    assert array_batches(adapter, False) is None
    ragged = tf.ragged.constant([[1], [2, 3], [4], [5, 6, 7]])
    adapter = _keras_adapter(ragged, y=np.zeros((4,)), batch_size=2)
    assert array_batches(adapter, False) is None


def test_a_staged_fit_on_arrays_reads_the_gathered_batches(monkeypatch):
    # The stage's source is this module's dataset, and the fit trains on
    # the same data as plain Keras (same weights, shuffled).
    built = []
    original = keras_stage.models.data_adapters.arrays.array_batches

    def spy(adapter, shuffle):
        batches = original(adapter, shuffle)
        built.append(batches)
        return batches

    monkeypatch.setattr(
        keras_stage.models.data_adapters.arrays, "array_batches", spy
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = rng.normal(size=(40, 1)).astype("float32")

    def fitted(model_class, staged):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        h = keras_stage.layers.StagedInput()(inputs) if staged else inputs
        model = model_class(inputs, keras.layers.Dense(1)(h))
        model.compile("sgd", "mse")
        callbacks = [keras_stage.callbacks.PrefetchCallback()] if staged else []
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=True,
            verbose=0,
            callbacks=callbacks,
        )
        return model.get_weights()

    plain = fitted(keras.Model, staged=False)
    staged = fitted(keras_stage.Model, staged=True)
    assert built and all(dataset is not None for dataset in built)
    for a, b in zip(plain, staged, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_smart_stage_fit_on_arrays_gathers_in_the_stage(monkeypatch):
    # With a SmartStage prefix the stage stages the index batches and
    # gathers in its own map: the gathered dataset is never built, and
    # the fit trains as plain Keras does (shuffled, with validation).
    from keras_stage.models.data_adapters.arrays import ArrayBatches

    gathered, fused = [], []
    original, original_fn = ArrayBatches.dataset, ArrayBatches.staged_fn

    def spy(self, indices=None):
        gathered.append(indices)
        return original(self, indices)

    def spy_fn(self, fn, numbered=False):
        fused.append(numbered)
        return original_fn(self, fn, numbered)

    monkeypatch.setattr(ArrayBatches, "dataset", spy)
    monkeypatch.setattr(ArrayBatches, "staged_fn", spy_fn)
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, size=(48, 3)).astype("float32")
    y = rng.normal(size=(48, 1)).astype("float32")

    def fitted(model_class, staged):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((3,))
        h = keras_stage.layers.StagedInput()(inputs) if staged else inputs
        norm = keras.layers.Normalization(name="norm")
        norm.adapt(x)
        model = model_class(inputs, keras.layers.Dense(1)(norm(h)))
        compile_kwargs = {"smart_stage": True} if staged else {}
        model.compile("sgd", "mse", **compile_kwargs)
        callbacks = [keras_stage.callbacks.PrefetchCallback()] if staged else []
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=True,
            validation_data=(x[:16], y[:16]),
            verbose=0,
            callbacks=callbacks,
        )
        return model

    plain = fitted(keras.Model, staged=False)
    staged = fitted(keras_stage.Model, staged=True)
    assert staged.get_stage_plan().staged_layers[-1] == "norm"
    assert gathered == []
    assert fused == [False, False]  # the training's and the validation's
    for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_batch_count_counts_the_batches_keras_makes():
    x = {"a": np.zeros((100, 3)), "b": np.zeros((100,))}
    assert batch_count(x, 32, None) == 4  # Keras's last batch is partial
    assert batch_count(x, None, None) == 4  # Keras's default of 32
    assert batch_count(np.zeros((8, 2)), 8, None) == 1
    assert batch_count(tf.zeros((10, 2)), 4, None) == 3
    assert batch_count(x, 32, 2) == 2  # `steps` bounds the call


def test_batch_count_is_none_for_data_a_stage_may_overlap():
    dataset = tf.data.Dataset.range(10).batch(2)
    assert batch_count(dataset, None, None) is None
    assert batch_count(dataset, None, 5) is None
    assert batch_count((i for i in range(3)), None, None) is None
    assert batch_count(None, None, None) is None
