"""What a model keeps between staged calls, and the calls that skip a stage.

Covers the traced SmartStage prefix kept across calls (planner's
`StageSplit.stage_fn`), the iterators handed to Keras
(keras_stage/models/iterators.py) and `StagedInput(adaptive=...)`.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.models.iterators import DeferredPipeline, resolve

pytestmark = pytest.mark.timeout(120)

WORDS = np.array([f"w{i % 7}" for i in range(64)], dtype=object)
LABELS = np.linspace(0.0, 1.0, 64, dtype="float32").reshape(-1, 1)


def _model(adaptive=True, staged=True):
    inputs = keras.Input(shape=(), dtype="string")
    x = inputs
    if staged:
        x = keras_stage.layers.StagedInput(adaptive=adaptive)(inputs)
    lookup = keras.layers.StringLookup(
        vocabulary=[f"w{i}" for i in range(7)], name="lookup"
    )
    x = lookup(x)
    x = keras.layers.Embedding(9, 4, name="emb")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    cls = keras_stage.Model if staged else keras.Model
    model = cls(inputs, outputs)
    if staged:
        model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    else:
        model.compile(optimizer="sgd", loss="mse")
    return model


def _traces(model):
    split = model._stage_plan()[1]  # the SmartStage split the stage runs
    return sum(
        split.stage_fn(training).experimental_get_tracing_count()
        for training in (True, False)
    )


def test_a_second_staged_call_traces_no_staged_layer_again():
    model = _model(adaptive=False)
    model.fit(WORDS, LABELS, batch_size=16, epochs=1, verbose=0)
    model.evaluate(WORDS, LABELS, batch_size=16, verbose=0)
    traced = _traces(model)
    assert traced >= 2  # one per training flag
    # Other data of the same kind (full batches of 16 strings).
    model.fit(WORDS[:48], LABELS[:48], batch_size=16, epochs=2, verbose=0)
    model.evaluate(WORDS[16:], LABELS[16:], batch_size=16, verbose=0)
    assert _traces(model) == traced
    # A new signature (a partial last batch) is traced, then kept.
    model.evaluate(WORDS[:40], LABELS[:40], batch_size=16, verbose=0)
    traced = _traces(model)
    model.evaluate(WORDS[:40], LABELS[:40], batch_size=16, verbose=0)
    assert _traces(model) == traced


def test_a_readapted_lookup_is_traced_again_and_used():
    model = _model(adaptive=False)
    model.fit(WORDS, LABELS, batch_size=16, epochs=1, verbose=0)
    lookup = model.get_layer("lookup")
    # New vocabulary: a new table, which the kept trace must not use.
    lookup.set_vocabulary(["w6", "w5", "w4", "w3", "w2", "w1", "w0"])
    staged = model.predict(WORDS[:32], batch_size=16, verbose=0)
    np.testing.assert_allclose(
        staged, model(tf.constant(WORDS[:32])).numpy(), rtol=1e-6
    )


def test_compile_drops_what_the_model_kept():
    model = _model(adaptive=False)
    model.fit(WORDS, LABELS, batch_size=16, epochs=1, verbose=0)
    before = model._stage_plan()[1]
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    assert model._stage_plan()[1] is not before


def test_calls_too_short_to_pay_run_unstaged_with_the_same_results(caplog):
    plain = _model(staged=False)
    staged = _model(adaptive=True)
    staged.set_weights(plain.get_weights())
    for model in (plain, staged):
        model.fit(WORDS, LABELS, batch_size=16, epochs=1, verbose=0)
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        for model in (plain, staged):
            model.fit(WORDS, LABELS, batch_size=16, epochs=2, verbose=0)
    assert "runs the whole model in Keras's step, unstaged" in caplog.text
    for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        plain.evaluate(WORDS, LABELS, batch_size=16, verbose=0),
        staged.evaluate(WORDS, LABELS, batch_size=16, verbose=0),
        rtol=1e-6,
    )
    # One batch has nothing to overlap: never staged.
    np.testing.assert_allclose(
        plain.predict(WORDS[:8], verbose=0),
        staged.predict(WORDS[:8], verbose=0),
        rtol=1e-6,
    )


def test_adaptive_false_stages_every_call():
    model = _model(adaptive=False)
    for _ in range(2):
        history = model.fit(WORDS, LABELS, batch_size=16, epochs=1, verbose=0)
        assert "stage_wait_ratio" in history.history


def test_calls_with_exception_policies_are_always_staged():
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput(
        ignored_exception_types=(tf.errors.InvalidArgumentError,)
    )(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 2), "float32"), np.ones((8, 1), "float32")
    for _ in range(3):
        history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        assert "stage_skipped" in history.history


@pytest.mark.parametrize("adaptive", ["yes", 1, None])
def test_adaptive_must_be_a_bool(adaptive):
    with pytest.raises(
        TypeError, match="Invalid value for argument `adaptive`"
    ):
        keras_stage.layers.StagedInput(adaptive=adaptive)


def test_adaptive_round_trips_through_get_config():
    layer = keras_stage.layers.StagedInput(adaptive=False)
    config = layer.get_config()
    assert config["adaptive"] is False
    assert keras_stage.layers.StagedInput.from_config(config).adaptive is False


def test_deferred_pipeline_makes_an_iterator_only_when_read():
    made = []
    pipeline = DeferredPipeline(tf.data.Dataset.range(3), made.append)
    unread = iter(pipeline)  # Keras's next-epoch iterator, never read
    assert made == []
    read = iter(pipeline)
    assert [int(next(read)) for _ in range(2)] == [0, 1]
    assert isinstance(resolve(read), tf.data.Iterator)
    assert int(resolve(read).get_next()) == 2
    assert len(made) == 1 and made[0] >= 0.0
    assert resolve(unread) is not resolve(read)
    assert pipeline.element_spec == tf.data.Dataset.range(3).element_spec


def test_an_unstaged_call_records_nothing_in_the_stage():
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput()(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((64, 2), "float32"), np.ones((64, 1), "float32")
    staged = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "stage_wait_ratio" in staged.history  # the first call measures
    stats = model._keras_stage_state.step_stats["train"]
    consumed = stats.snapshot()["consumed"]
    unstaged = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert "stage_wait_ratio" not in unstaged.history
    # The unstaged steps are traced apart: no fetch counted in the stage.
    assert stats.snapshot()["consumed"] == consumed
    model.train_on_batch(x[:16], y[:16])
    assert stats.snapshot()["consumed"] == consumed


def test_a_fresh_model_decides_from_what_models_like_it_measured(caplog):
    first = _model()
    first.fit(WORDS, LABELS, batch_size=16, epochs=2, verbose=0)
    # A new model per trial, of the same stage: its first call (4 batches
    # a cheap lookup) cannot repay a plan, a trace and a stage...
    plain = _model(staged=False)
    fresh = _model()
    fresh.set_weights(plain.get_weights())
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        history = fresh.fit(WORDS, LABELS, batch_size=16, epochs=2, verbose=0)
    plain.fit(WORDS, LABELS, batch_size=16, epochs=2, verbose=0)
    assert "measured on a model with this stage" in caplog.text
    assert "stage_wait_ratio" not in history.history
    # ...so it ran unstaged: nothing planned, the same weights as plain.
    assert fresh._keras_stage_state.plan is None
    for a, b in zip(plain.get_weights(), fresh.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The stage plan is there when asked for.
    assert fresh.get_stage_plan().staged_layers


def test_a_model_with_another_stage_measures_its_own_costs():
    _model().fit(WORDS, LABELS, batch_size=16, epochs=2, verbose=0)
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput(capacity=3)(inputs)
    x = keras.layers.StringLookup(vocabulary=["w0", "w1"])(x)
    x = keras.layers.Embedding(4, 4)(x)
    other = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    other.compile(optimizer="sgd", loss="mse", smart_stage=True)
    history = other.fit(WORDS, LABELS, batch_size=16, epochs=2, verbose=0)
    assert "stage_wait_ratio" in history.history  # staged: nothing measured
