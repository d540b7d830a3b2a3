"""What a model keeps between staged calls, and the calls that skip a stage.

Covers the traced SmartStage prefix kept across calls (planner's
`StageSplit.stage_fn`), the iterators handed to Keras
(keras_stage/models/iterators/kept_iterators.py) and
`StagedInput(adaptive=...)`.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.models.decision import calls
from keras_stage.models.iterators.kept_iterators import (
    DeferredPipeline,
    resolve,
)
from keras_stage.models.model_state import UNSTAGED_STEPS
from keras_stage.models.model_state import state as model_state
from tests.helpers import run_forked

pytestmark = pytest.mark.timeout(120)

WORDS = np.array([f"w{i % 7}" for i in range(64)], dtype=object)
LABELS = np.linspace(0.0, 1.0, 64, dtype="float32").reshape(-1, 1)


def _model(adaptive=True, staged=True, **options):
    inputs = keras.Input(shape=(), dtype="string")
    x = inputs
    if staged:
        x = keras_stage.layers.StagedInput(adaptive=adaptive, **options)(inputs)
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
    functions = {id(f): f for f in map(split.stage_fn, (True, False))}
    return sum(f.experimental_get_tracing_count() for f in functions.values())


def test_a_second_staged_call_traces_no_staged_layer_again():
    model = _model(adaptive=False)
    model.fit(WORDS, LABELS, batch_size=16, epochs=1, verbose=0)
    model.evaluate(WORDS, LABELS, batch_size=16, verbose=0)
    traced = _traces(model)
    # One function for training and evaluation: the lookup's call does not
    # take `training`, so the flag changes nothing it computes. Its two
    # traces are the fit's batches (of 16) and evaluate's (of any size).
    split = model._stage_plan()[1]
    assert split.stage_fn(True) is split.stage_fn(False)
    assert traced == 2
    # Other data of the same kind (full batches of 16 strings).
    model.fit(WORDS[:48], LABELS[:48], batch_size=16, epochs=2, verbose=0)
    model.evaluate(WORDS[16:], LABELS[16:], batch_size=16, verbose=0)
    assert _traces(model) == traced
    # A new signature (a partial last batch) is traced, then kept.
    model.evaluate(WORDS[:40], LABELS[:40], batch_size=16, verbose=0)
    traced = _traces(model)
    model.evaluate(WORDS[:40], LABELS[:40], batch_size=16, verbose=0)
    assert _traces(model) == traced


class _TrainingShift(keras.layers.Layer):
    """Adds 1 in training only: a stateless layer whose call takes it."""

    def call(self, x, training=None):
        return x + 1.0 if training else x


def test_a_prefix_whose_call_takes_training_is_traced_per_flag():
    inputs = keras.Input(shape=(1,))
    x = keras_stage.layers.StagedInput(adaptive=False)(inputs)
    x = _TrainingShift(name="shift")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    model = keras_stage.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    x, y = np.ones((32, 1), "float32"), np.zeros((32, 1), "float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=16, verbose=0)
    split = model._stage_plan()[1]
    assert split.plan.staged_layers  # the shift is staged
    assert split.stage_fn(True) is not split.stage_fn(False)
    assert _traces(model) == 2
    # Each computes as its flag says.
    np.testing.assert_allclose(
        model.predict(x[:16], batch_size=16, verbose=0),
        model(x[:16], training=False).numpy(),
        rtol=1e-6,
    )


@pytest.mark.parametrize("shifts", [False, True])
def test_a_nested_models_layers_tell_whether_its_stage_takes_training(
    shifts,
):
    # A functional model inside the prefix (as a FeatureSpace model is
    # often built) passes `training` on: its layers decide.
    inner_in = keras.Input(shape=(1,))
    inner = keras.layers.Rescaling(2.0)(inner_in)
    if shifts:
        inner = _TrainingShift()(inner)
    inner_model = keras.Model(inner_in, inner, name="inner")
    inputs = keras.Input(shape=(1,))
    x = keras_stage.layers.StagedInput(adaptive=False)(inputs)
    outputs = keras.layers.Dense(1, name="head")(inner_model(x))
    model = keras_stage.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    split = model._stage_plan()[1]
    assert list(split.plan.staged_layers)[-1] == "inner"
    shared = split.stage_fn(True) is split.stage_fn(False)
    assert shared is not shifts


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
    # Its stage as dear to build as a slow machine may time it, so the
    # decision does not ride on this run's timings (the weighing itself is
    # calls_test's): 16 batches of a lookup cannot repay it.
    from keras_stage.models.call import facts

    facts.costs(staged).note_build("train", 10.0)
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
    stats = model._keras_stage_state.steps.step_stats["train"]
    consumed = stats.snapshot()["consumed"]
    unstaged = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert unstaged.history["stage_unstaged"] == [1.0, 1.0]
    # The unstaged steps are traced apart: no fetch counted in the stage.
    assert stats.snapshot()["consumed"] == consumed
    model.train_on_batch(x[:16], y[:16])
    assert stats.snapshot()["consumed"] == consumed


def test_a_loop_of_unstaged_calls_keeps_the_step_it_traced_installed():
    # Setting Keras's compiled step goes through its attribute tracking:
    # unstaged calls leave theirs in place, and a staged call between them
    # runs its own and puts it back.
    plain = _model(staged=False)
    staged = _model()
    staged.set_weights(plain.get_weights())
    one_batch = WORDS[:8]
    expected = plain.predict(one_batch, verbose=0)
    np.testing.assert_allclose(
        staged.predict(one_batch, verbose=0), expected, rtol=1e-6
    )
    step = staged.predict_function
    kept = model_state(staged).steps.staged_functions
    assert step is not None and step is kept[("predict", UNSTAGED_STEPS)]
    # A dataset that maps is always staged.
    mapped = (
        tf.data.Dataset.from_tensor_slices(WORDS).map(tf.identity).batch(16)
    )
    np.testing.assert_allclose(
        staged.predict(mapped, verbose=0),
        plain.predict(mapped, verbose=0),
        rtol=1e-6,
    )
    assert staged.predict_function is step
    np.testing.assert_allclose(
        staged.predict(one_batch, verbose=0), expected, rtol=1e-6
    )
    assert staged.predict_function is step


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
    # (Unstaged, it times the whole model's steps and their trace, for
    # every model like it.)
    assert "unstaged [does_not_pay]" in caplog.text
    measured = fresh._keras_stage_state.learned.costs.phase("train")
    assert measured.unstaged_step_seconds is not None
    assert measured.unstaged_trace_seconds is not None
    assert history.history["stage_unstaged"] == [1.0, 1.0]
    # ...so it ran unstaged: nothing planned, the same weights as plain.
    assert fresh._keras_stage_state.plan is None
    for a, b in zip(plain.get_weights(), fresh.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The stage plan is there when asked for.
    assert fresh.get_stage_plan().staged_layers
    # A third model decides from both kinds of steps timed.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="keras_stage"):
        history = _model().fit(
            WORDS, LABELS, batch_size=16, epochs=2, verbose=0
        )
    # Either way, as its costs weigh: the whole step's trace it would add
    # unstaged (one timing, by the fresh model) is a fraction of what its
    # stage costs to set up here, but another process's burst on a loaded
    # machine can double that one timing. The call does what it logged.
    assert "[pays]" in caplog.text or "[does_not_pay]" in caplog.text
    assert "[trial]" not in caplog.text
    unstaged = "runs the whole model in Keras's step, unstaged" in caplog.text
    epochs_unstaged = history.history.get("stage_unstaged", [0.0, 0.0])
    if unstaged:
        assert epochs_unstaged == [1.0, 1.0]
    else:
        assert epochs_unstaged[0] == 0.0  # its first epoch staged


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


def _dataset(shuffle_seed=None, count=64):
    ds = tf.data.Dataset.from_tensor_slices((WORDS[:count], LABELS[:count]))
    if shuffle_seed is not None:
        ds = ds.shuffle(count, seed=shuffle_seed)
    return ds.batch(16)


def _built_pipelines(monkeypatch):
    """Notes each stage pipeline built (each traces the stage's map).

    As `(stage name, pool size)`: a stage whose adaptive pool is resized
    builds one pipeline per size it runs on, the first time.
    """
    from keras_stage.data import staging

    built = []
    original = staging._build_pipeline

    def noting(dataset, fn, options, stats, *args, **kwargs):
        pool_size = args[5] if len(args) > 5 else kwargs.get("pool_size")
        built.append((options.name, pool_size))
        return original(dataset, fn, options, stats, *args, **kwargs)

    monkeypatch.setattr(staging, "_build_pipeline", noting)
    return built


def test_later_calls_on_a_dataset_run_the_stage_built_by_the_first(
    monkeypatch,
):
    model = _model(adaptive=False)
    built = _built_pipelines(monkeypatch)
    ds, val = _dataset(), _dataset(count=32)
    # Epochs on one iterator: its stage runs fits of as many epochs.
    model.fit(ds, epochs=2, validation_data=val, shuffle=False, verbose=0)
    model.evaluate(val, verbose=0)
    kept = dict(model._keras_stage_state.stages)
    assert set(kept) == {"train", "val", "test"}
    pools = {p: e.staged.thread_pool for p, e in kept.items()}
    traced = _traces(model)
    first = len(built)
    for _ in range(3):
        model.fit(ds, epochs=2, validation_data=val, shuffle=False, verbose=0)
        model.evaluate(val, verbose=0)
    # No staged layer traced again, the same stage objects and pools, and
    # no pipeline built twice: only a pool size not run before builds one.
    assert _traces(model) == traced
    assert len(set(built)) == len(built), built
    state = model._keras_stage_state
    for phase, entry in kept.items():
        assert state.stages[phase] is entry
        assert entry.staged.thread_pool is pools[phase]
        assert not entry.in_use  # released at the end of each call
    # Another dataset object: a stage of its own, and it becomes the kept.
    before = len(built)
    other = _dataset(count=48)
    model.evaluate(other, verbose=0)
    assert len(built) > before >= first
    assert state.stages["test"] is not kept["test"]
    assert state.stages["test"].objects[1] is other


def test_a_stage_on_a_fixed_pool_is_built_once(monkeypatch):
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput(num_threads=2, adaptive=False)(inputs)
    x = keras.layers.StringLookup(vocabulary=["w0", "w1", "w2"])(x)
    x = keras.layers.Embedding(5, 4)(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    built = _built_pipelines(monkeypatch)
    ds = _dataset()
    for _ in range(3):
        model.fit(ds, epochs=2, shuffle=False, verbose=0)
        model.evaluate(ds, verbose=0)
        model.predict(ds, verbose=0)
    assert len(built) == 3, built  # train, test, predict: once each


def _loop_as_plain(epochs, shuffle_seed=None):
    """A user's loop of fit + validation + evaluate, 3 times, on one
    dataset object each: the staged model (returned) ends with plain's
    weights and logs."""
    plain = _model(staged=False)
    staged = _model(adaptive=False)
    staged.set_weights(plain.get_weights())
    keras.utils.set_random_seed(3)
    for model in (plain, staged):
        ds, val = _dataset(shuffle_seed=shuffle_seed), _dataset(count=32)
        logs = []
        for _ in range(3):
            history = model.fit(
                ds, epochs=epochs, validation_data=val, shuffle=False, verbose=0
            )
            logs.append(history.history["val_loss"])
            logs.append(model.evaluate(val, verbose=0))
        model.logs = logs
    for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        np.hstack(plain.logs), np.hstack(staged.logs), rtol=1e-6
    )
    return staged


def _plain_and_fed():
    """A plain model and a staged twin whose stages are fed (`FedSource`).

    Every call staged, on a fixed pool: a resized one ends the fed
    iterator (see `LongLivedIterator.carries`).
    """
    plain = _model(staged=False)
    staged = _model(adaptive=False, thread_pool_size=2)
    staged.set_weights(plain.get_weights())
    return plain, staged


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_loop_on_new_datasets_feeds_one_stage_per_role_as_plain(
    monkeypatch, shuffle
):
    # A loop that builds its datasets each call: from a role's second
    # call on, its stage reads a fed source (`FedSource`) that each call
    # feeds its passes, on one iterator; the third call builds nothing and
    # makes no iterator. Training, validation, evaluation and predictions
    # are plain's, on a seeded reshuffling dataset too: its passes draw in
    # the order of plain's iterators, the unread ones Keras makes between
    # epochs too.
    built = _built_pipelines(monkeypatch)
    plain, staged = _plain_and_fed()
    built_by_call = []
    for model in (plain, staged):
        logs = []
        for call in range(3):
            history = model.fit(
                _dataset(shuffle_seed=call if shuffle else None),
                epochs=2,
                validation_data=_dataset(count=32),
                shuffle=False,
                verbose=0,
            )
            logs.append(history.history["loss"] + history.history["val_loss"])
            logs.append([model.evaluate(_dataset(count=32), verbose=0)])
            logs.append(model.predict(_dataset(count=48), verbose=0)[:, 0])
            if model is staged:
                built_by_call.append(list(built))
        model.logs = logs
    for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        np.hstack(plain.logs), np.hstack(staged.logs), rtol=1e-6
    )
    kept = staged._keras_stage_state.stages
    assert all(entry.long_lived.feeds for entry in kept.values())
    # The first call builds the validation's fed stage, which its evaluate
    # feeds too; the second builds the fed stages of training and predict;
    # the third nothing.
    first, second, third = built_by_call
    assert sorted(n.rsplit("_", 1)[1] for n, _ in first) == [
        "predict",
        "train",
        "val",
    ], built
    roles = sorted(name.rsplit("_", 1)[1] for name, _ in second[len(first) :])
    assert roles == ["predict", "train"], built
    assert third == second
    assert all(entry._shared.iterators_made == 1 for entry in kept.values())


def test_an_evaluate_on_new_data_after_a_fit_feeds_its_validation_stage(
    monkeypatch,
):
    # A script's evaluate on a test set after a fit with validation: the
    # fit's validation stage is fed from its first call, and the evaluate
    # (the same compiled step) feeds it its pass: no stage built, no
    # iterator made, plain's loss.
    built = _built_pipelines(monkeypatch)
    plain, staged = _plain_and_fed()
    losses = []
    for model in (plain, staged):
        model.fit(
            _dataset(),
            epochs=2,
            validation_data=_dataset(count=32),
            shuffle=False,
            verbose=0,
        )
        before = list(built)
        # Another dataset of the validation's structure and batch count.
        losses.append(model.evaluate(_dataset(count=32), verbose=0))
    assert built == before  # the staged evaluate built nothing
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    kept = staged._keras_stage_state.stages
    assert kept["test"] is kept["val"]
    assert kept["val"]._shared.iterators_made == 1
    assert kept["val"].carries()


def test_a_fed_fit_stopped_early_leaves_no_passes_to_the_next(monkeypatch):
    # The second fit (fed) stops after 1 of its 3 epochs: its 2 unread
    # passes are not the next fit's, which builds its stage again; every
    # fit trains as plain's.
    built = _built_pipelines(monkeypatch)
    plain, staged = _plain_and_fed()

    def stop(model):
        def on_epoch_end(epoch, logs):
            model.stop_training = True

        return keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)

    for model in (plain, staged):
        for epochs, stops in ((1, False), (3, True), (2, False)):
            model.fit(
                _dataset(),
                epochs=epochs,
                shuffle=False,
                callbacks=[stop(model)] if stops else [],
                verbose=0,
            )
    for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert [name.rsplit("_", 1)[1] for name, _ in built] == ["train"] * 3


def test_training_that_is_backed_up_is_not_fed(tmp_path):
    # A fed source's epochs are not in a tf.data checkpoint.
    backed_up = _model(adaptive=False)
    for _ in range(2):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        backed_up.fit(
            _dataset(), epochs=1, shuffle=False, callbacks=[backup], verbose=0
        )
    kept = backed_up._keras_stage_state.stages.get("train")
    assert kept is None or kept.long_lived is None or not kept.long_lived.feeds
    fed = _model(adaptive=False)
    for _ in range(2):
        fed.fit(_dataset(), epochs=3, shuffle=False, verbose=0)
    assert fed._keras_stage_state.stages["train"].long_lived.feeds


def test_a_kept_stage_trains_as_plain_on_a_reshuffled_dataset():
    _loop_as_plain(epochs=2, shuffle_seed=5)


def test_a_predict_loop_on_one_dataset_makes_one_iterator():
    # Keras reads predict's batches in Python: its kept stage's iterator
    # runs on into the next predict all the same, each call's predictions
    # the model's own.
    model = _model(adaptive=False)
    ds = _dataset(count=60)  # a partial last batch
    expected = model(tf.constant(WORDS[:60])).numpy()
    for _ in range(3):
        np.testing.assert_allclose(
            model.predict(ds, verbose=0), expected, rtol=1e-6
        )
    kept = model._keras_stage_state.stages["predict"]
    assert kept.carries()
    assert kept._shared.iterators_made == 1


# Keras warns of `shuffle=True` (its default) with a dataset.
_QUIET = {"shuffle": False, "verbose": 0}


def test_a_kept_stage_weighs_the_batches_with_the_calls_class_weight():
    # Keras weighs the batches in a map over the user's dataset: the same
    # weights run the kept stage again; other weights get a stage of
    # their own, and both train as plain Keras.
    plain = _model(staged=False)
    staged = _model(adaptive=False)
    staged.set_weights(plain.get_weights())
    labels = (LABELS > 0.5).astype("float32")
    kept = []
    for model in (plain, staged):
        ds = tf.data.Dataset.from_tensor_slices((WORDS, labels)).batch(16)
        weights = {0: 1.0, 1: 3.0}
        for _ in range(2):
            model.fit(ds, epochs=2, class_weight=weights, **_QUIET)
            if model is staged:
                kept.append(model._keras_stage_state.stages["train"])
        weights[1] = 0.5  # the user's dict, changed in place
        model.fit(ds, epochs=2, class_weight=weights, **_QUIET)
        if model is staged:
            kept.append(model._keras_stage_state.stages["train"])
    assert kept[0] is kept[1]
    assert kept[2] is not kept[1]
    for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_readapted_layer_gets_a_new_kept_stage():
    model = _model(adaptive=False)
    ds = _dataset()
    model.predict(ds, verbose=0)
    first = model._keras_stage_state.stages["predict"]
    model.get_layer("lookup").set_vocabulary(
        ["w6", "w5", "w4", "w3", "w2", "w1", "w0"]
    )
    staged = model.predict(ds, verbose=0)
    assert model._keras_stage_state.stages["predict"] is not first
    np.testing.assert_allclose(
        staged, model(tf.constant(WORDS)).numpy(), rtol=1e-6
    )


def test_compile_drops_the_kept_stages():
    model = _model(adaptive=False)
    model.fit(_dataset(), epochs=1, shuffle=False, verbose=0)
    assert model._keras_stage_state.stages
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    assert not model._keras_stage_state.stages


def test_an_evaluate_nested_in_a_fit_on_its_validation_data_builds_its_own():
    model = _model(adaptive=False)
    ds, val = _dataset(), _dataset(count=32)
    nested = []

    class EvaluateEachEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            nested.append(model.evaluate(val, verbose=0))

    history = model.fit(
        ds,
        epochs=3,
        validation_data=val,
        callbacks=[EvaluateEachEpoch()],
        shuffle=False,
        verbose=0,
    )
    # The fit's validation stage stayed open for its later epochs, and
    # each nested evaluate saw what the validation run saw.
    np.testing.assert_allclose(history.history["val_loss"], nested, rtol=1e-6)
    assert not model._keras_stage_state.stages["test"].in_use


def test_a_dataset_that_draws_nothing_gets_iterators_made_when_read():
    from keras_stage.models.data_adapters import stage_data

    model = _model(adaptive=False)
    layer, split = model.layers[1], model._stage_plan()[1]
    for ds, defers in ((_dataset(), True), (_dataset(shuffle_seed=1), False)):
        data = stage_data(layer, "train", ds, split=split)
        assert data.defers is defers
        data.end_call()


class _PoolResizes(keras.callbacks.Callback):
    """Notes, before each epoch after the first, whether an adaptive pool
    changed size since the epoch before began.

    The pool's size follows each epoch's timings (`StagePool.adapt`), so on
    a loaded machine a fit may resize it; an iterator made on the new size
    is then the one a resize costs (see `LongLivedIterator`).
    """

    def __init__(self, monkeypatch):
        super().__init__()
        from keras_stage.data.pool import StagePool

        self.changed = []
        self._sizes = {}  # pool -> its size when the epoch before began
        self._pools = []
        original = StagePool.resize
        pools = self._pools

        def resize(pool, threads):
            if all(known is not pool for known in pools):
                pools.append(pool)
            return original(pool, threads)

        monkeypatch.setattr(StagePool, "resize", resize)

    def on_train_begin(self, logs=None):
        self.changed = []
        self._sizes = {}

    def on_epoch_begin(self, epoch, logs=None):
        sizes = {id(pool): pool.size for pool in self._pools}
        if epoch > 0:
            self.changed.append(
                any(
                    size != self._sizes.get(key, size)
                    for key, size in sizes.items()
                )
            )
        self._sizes = sizes


def test_a_fit_on_a_dataset_that_draws_nothing_makes_one_iterator(
    monkeypatch,
):
    model = _model(adaptive=False)
    resizes = _PoolResizes(monkeypatch)
    made = []
    # Plans, traces and measures.
    model.fit(_dataset(), epochs=3, shuffle=False, verbose=0)
    costs = model._keras_stage_state.learned.costs
    original = costs.note_iterator

    def note(phase, seconds):
        made.append(phase)
        original(phase, seconds)

    costs.note_iterator = note
    model.fit(
        _dataset(), epochs=3, shuffle=False, verbose=0, callbacks=[resizes]
    )
    # Its epochs run on one iterator: no epoch makes one, unless its pool
    # was resized for it (its size usually settles in the first fit).
    assert made == ["train"] * (1 + sum(resizes.changed))
    made.clear()
    # A reshuffling dataset on the adaptive pool, in a model's first fit
    # (a later call on another dataset reads a fed source): its first
    # epoch on an iterator of its own, the others on one more, made on the
    # pool sized from the first (its draws follow the iterators made
    # before); a later resize makes none (an iterator of a drawing source
    # keeps its pool).
    monkeypatch.setattr(
        calls.CallCosts,
        "note_iterator",
        lambda self, phase, seconds: made.append(phase),
    )
    fresh = _model(adaptive=False)
    fresh.fit(_dataset(shuffle_seed=1), epochs=3, shuffle=False, verbose=0)
    assert made == ["train"] * 2


# -- one iterator across calls ------------------------------------------------


def test_a_users_loop_on_one_dataset_makes_one_iterator_per_stage():
    staged = _loop_as_plain(epochs=1)
    # Each stage ran on one iterator across the calls.
    kept = staged._keras_stage_state.stages
    assert kept["val"]._shared.iterators_made == 1
    assert kept["test"]._shared.iterators_made == 1
    assert kept["train"]._shared.iterators_made <= 2
    assert all(entry.carries() for entry in kept.values())


class _Shift(keras.layers.Layer):
    """Adds a variable that training leaves alone: a stageable layer."""

    def build(self, input_shape):
        self.shift = self.add_weight(
            shape=(), initializer="zeros", trainable=False
        )

    def call(self, x):
        return x + self.shift


def test_a_staged_variable_changed_between_calls_is_not_read_stale():
    # The kept iterator filled its buffer with the next call's batches,
    # computed with the variable's old value: that buffer must go.
    xs = np.arange(48, dtype="float32").reshape(16, 3)
    ds = tf.data.Dataset.from_tensor_slices((xs, np.zeros((16, 1)))).batch(4)
    results = []
    for staged in (False, True):
        inputs = keras.Input(shape=(3,))
        x = inputs
        if staged:
            x = keras_stage.layers.StagedInput(adaptive=False)(inputs)
        x = _Shift(name="shift")(x)
        outputs = keras.layers.Dense(1, kernel_initializer="ones")(x)
        model = (keras_stage.Model if staged else keras.Model)(inputs, outputs)
        if staged:
            model.compile(optimizer="sgd", loss="mse", smart_stage=True)
            assert "shift" in model._stage_plan()[0].staged_layers
        else:
            model.compile(optimizer="sgd", loss="mse")
        losses = [model.evaluate(ds, verbose=0)]
        model.get_layer("shift").shift.assign(5.0)
        losses.append(model.evaluate(ds, verbose=0))
        losses.append(model.evaluate(ds, verbose=0))
        results.append(losses)
    assert results[0][0] != results[0][1]
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


_EXITS_SCRIPT = """
import time
import numpy as np, tensorflow as tf, keras, keras_stage

def read(t):
    time.sleep(0.02)  # a remote read: the GIL is released and taken again
    return t

class Slow(keras.layers.Layer):
    def call(self, x):
        y = tf.py_function(read, [x], tf.float32)
        y.set_shape(x.shape)
        return y

inputs = keras.Input(shape=(2,))
x = keras_stage.layers.StagedInput(adaptive=False, capacity=2)(inputs)
model = keras_stage.Model(inputs, keras.layers.Dense(1)(Slow()(x)))
model.compile(optimizer="sgd", loss="mse", smart_stage=True)
ds = tf.data.Dataset.from_tensor_slices(
    (np.ones((64, 2), "float32"), np.ones((64, 1), "float32"))
).batch(4)
model.fit(ds, epochs=1, verbose=0)
assert model._keras_stage_state.stages["train"].carries()
if {drop}:
    del model
    import gc
    gc.collect()
print("ended")
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("drop", [False, True])
def test_an_iterator_running_on_with_python_lets_the_process_exit(drop):
    # The kept iterator's map calls Python (a py_function); torn down in
    # the thread that drops it, or by the interpreter's exit, it could wait
    # for that Python while holding the interpreter lock. Forked from a
    # process that imported TensorFlow (not a fresh `python`, which imports
    # it again), and ended by the interpreter's whole exit.
    done = run_forked(
        ["-c"],
        code=_EXITS_SCRIPT.format(drop=drop),
        timeout=120,
        interpreter_exit=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ended" in done.stdout
    # Nor does the exit's teardown fail (a finalizer and the exit hook
    # both drop the iterator).
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]
