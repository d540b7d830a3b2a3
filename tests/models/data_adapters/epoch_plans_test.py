"""Tests for keras_stage/models/data_adapters/epoch_plans.py: a stage that
runs across a call's epochs on one iterator.

`stage_data(..., epochs=E)` plans it (`epoch_plans.plan`), builds the stage
over one source spanning E epochs (data/source_passes.py) and hands Keras
epoch views (models/iterators/kept_iterators.py) of one real iterator
(data/epochs.py). Each epoch must read exactly the
batches, in exactly the order, plain Keras reads: checked here against
plain Keras's own `fit` (a model recording every batch its steps get) and
against fresh iterators of Keras's adapter dataset, for arrays (shuffle
False/True/"batch", sample and class weights, seeded or not) and `tf.data`
datasets (seeded reshuffling, `reshuffle_each_iteration=False`,
`steps_per_epoch`, validation).
"""

import gc
import time
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage import _compat
from keras_stage.data import source_passes
from keras_stage.models.data_adapters import stage_data
from keras_stage.models.data_adapters.epoch_plans import strategy_refusal
from keras_stage.models.data_adapters.staged_data import (
    StageCosts,
    StagedData,
)
from keras_stage.models.iterators.kept_iterators import (
    DeferredPipeline,
    EpochPipeline,
    EpochView,
    resolve,
)

pytestmark = pytest.mark.timeout(180)

N, BATCH, EPOCHS = 24, 8, 3  # 3 batches an epoch
SEED = 11


def _values(data):
    return [np.asarray(t).tolist() for t in keras.tree.flatten(data)]


class _Recorder(keras.Model):
    """Records every batch its train and test steps get, in order."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.seen = []

    def call(self, x):
        return self.dense(tf.reshape(tf.cast(x, "float32"), (-1, 1)))

    def _record(self, phase, data):
        self.seen.append((phase, _values(data)))
        return {"n": tf.constant(0.0)}

    def train_step(self, data):
        return self._record("train", data)

    def test_step(self, data):
        return self._record("val", data)


def _fit(x, epochs=EPOCHS, callbacks=None, **kwargs):
    """The batches a plain Keras fit reads: `(phase, values)` in order."""
    if isinstance(x, tf.data.Dataset):
        kwargs.setdefault("shuffle", False)  # Keras warns otherwise
    model = _Recorder()
    model.compile(run_eagerly=True)
    model.fit(x, epochs=epochs, verbose=0, callbacks=callbacks, **kwargs)
    return model.seen


def _layer():
    return keras_stage.layers.StagedInput(num_threads=2)


def _arrays():
    x = np.arange(N, dtype="float32")
    return x, 2 * x, (x % 3).astype("float32")


def _dataset(seed=3, reshuffle=True, size=N):
    pairs = tf.data.Dataset.range(size).map(
        lambda i: (tf.cast(i, tf.float32), tf.cast(2 * i, tf.float32))
    )
    return pairs.shuffle(
        size, seed=seed, reshuffle_each_iteration=reshuffle
    ).batch(BATCH)


def _staged(x, made, phase="train", **kwargs):
    costs = StageCosts(on_iterator=made.append)
    return stage_data(_layer(), phase, x, costs=costs, **kwargs)


def _firsts(batches):
    """The first component (x) of each batch, concatenated."""
    return [v for batch in batches for v in batch[0]]


def _read_epoch(pipeline, batches):
    """Reads one epoch as Keras does: an iterator, then one it never reads."""
    view = iter(pipeline)
    out = [_values(resolve(view).get_next()) for _ in range(batches)]
    iter(pipeline)  # the next epoch's iterator, made when an epoch ends
    return out


# -- the facts the long-lived source is built on --------------------------


def test_fact_seeded_array_shuffle_repeats_in_fresh_iterators_only():
    x, y, _ = _arrays()
    keras.utils.set_random_seed(SEED)
    adapter = _compat.get_data_adapter(
        x=x, y=y, batch_size=BATCH, shuffle=True, steps_per_epoch=None
    )
    dataset = adapter.get_tf_dataset()
    fresh = [_firsts(_values(b) for b in dataset) for _ in range(3)]
    assert fresh[0] == fresh[1] == fresh[2]
    running = iter(dataset.repeat(2))
    passes = [_firsts(_values(next(running)) for _ in range(3)) for _ in "ab"]
    assert passes[0] == fresh[0] and passes[1] != fresh[0]


def test_fact_keras_fit_reads_every_other_iteration_of_a_reshuffling_dataset():
    # The global seed is part of a seeded shuffle's seeds: the same for all.
    keras.utils.set_random_seed(SEED)
    dataset = _dataset()
    iterations = [_firsts(_values(b) for b in dataset) for _ in range(6)]
    keras.utils.set_random_seed(SEED)
    epochs = _epochs(_fit(_dataset()), "train")
    assert epochs == [iterations[0], iterations[2], iterations[4]]
    keras.utils.set_random_seed(SEED)
    with_steps = _epochs(_fit(_dataset(), steps_per_epoch=3), "train")
    assert with_steps == iterations[:3]


def _epochs(seen, phase, batches=3):
    """Per epoch (of `batches` batches), the x values a phase read."""
    values = [v for p, v in seen if p == phase]
    return [
        _firsts(values[i : i + batches]) for i in range(0, len(values), batches)
    ]


# -- arrays ----------------------------------------------------------------


@pytest.mark.parametrize(
    "shuffle, weights",
    [
        (False, None),
        (True, None),
        ("batch", None),
        (True, "sample_weight"),
        ("batch", "class_weight"),
    ],
)
def test_arrays_read_plain_keras_epochs_on_one_iterator(shuffle, weights):
    x, y, sw = _arrays()
    kwargs = {"batch_size": BATCH, "shuffle": shuffle}
    if weights == "sample_weight":
        kwargs["sample_weight"] = sw
    elif weights == "class_weight":
        y = (x % 2).astype("float32")
        kwargs["class_weight"] = {0: 1.0, 1: 3.0}
    keras.utils.set_random_seed(SEED)
    plain = _fit(x, y=y, **kwargs)
    keras.utils.set_random_seed(SEED)
    adapter = _compat.get_data_adapter(x=x, y=y, steps_per_epoch=None, **kwargs)
    fresh = [[_values(b) for b in adapter.get_tf_dataset()] for _ in "abc"]

    keras.utils.set_random_seed(SEED)
    made = []
    data = _staged(x, made, y=y, epochs=EPOCHS, **kwargs)
    assert data.long_lived and data.long_lived_refusal is None
    assert data.epochs == EPOCHS
    assert isinstance(data.pipeline, EpochPipeline)
    assert int(data.pipeline.cardinality()) == 3  # what Keras counts
    staged = _fit(data.pipeline)
    data.end_call()
    # Whole batches (x, y, weights), epoch by epoch.
    assert [v for _, v in staged] == [v for _, v in plain]
    assert [v for _, v in staged] == [b for epoch in fresh for b in epoch]
    assert len(made) == 1


@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_unseeded_array_shuffles_draw_a_new_permutation_every_epoch(shuffle):
    tf.random.set_seed(None)  # no global seed: Keras draws afresh
    x, y, _ = _arrays()
    made = []
    data = _staged(
        x, made, y=y, batch_size=BATCH, shuffle=shuffle, epochs=EPOCHS
    )
    assert data.long_lived
    epochs = _epochs([("train", v) for v in _read_pipeline(data)], "train")
    data.end_call()
    for epoch in epochs:
        assert sorted(epoch) == list(range(N))
        if shuffle == "batch":
            for i in range(0, N, BATCH):
                assert sorted(epoch[i : i + BATCH]) == list(range(i, i + BATCH))
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    assert len(made) == 1


def _read_pipeline(data, epochs=EPOCHS, batches=3):
    out = []
    for _ in range(epochs):
        out.extend(_read_epoch(data.pipeline, batches))
    return out


# -- tf.data datasets ------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
@pytest.mark.parametrize(
    "source, steps",
    [
        ("seeded", None),
        ("seeded", 3),  # steps_per_epoch: Keras keeps its iterator
        ("seeded", 2),  # epochs shorter than the data
        ("global_seed", None),  # shuffle's seed from the global seed
        ("no_reshuffle", None),
    ],
)
def test_datasets_read_plain_keras_epochs_and_validation(source, steps):
    def make(seed):
        if source == "global_seed":
            return _dataset(seed=None)
        return _dataset(seed=seed, reshuffle=source != "no_reshuffle")

    keras.utils.set_random_seed(SEED)
    plain = _fit(make(3), validation_data=make(4), steps_per_epoch=steps)
    keras.utils.set_random_seed(SEED)
    train_x, val_x = make(3), make(4)
    made = []
    train = _staged(
        train_x, made, steps=steps, epochs=EPOCHS, alongside=(val_x,)
    )
    val = _staged(
        val_x,
        made,
        phase="test",
        role="val",
        epochs=EPOCHS,
        alongside=(train_x,),
    )
    assert train.long_lived and val.long_lived
    staged = _fit(
        train.pipeline, validation_data=val.pipeline, steps_per_epoch=steps
    )
    train.end_call()
    val.end_call()
    assert staged == plain
    assert len(made) == 2  # one iterator each, for every epoch and run


def test_unseeded_datasets_reshuffle_every_epoch():
    tf.random.set_seed(None)
    made = []
    data = _staged(_dataset(seed=None), made, epochs=EPOCHS)
    assert data.long_lived
    epochs = _epochs([("t", v) for v in _read_pipeline(data)], "t")
    data.end_call()
    assert all(sorted(epoch) == list(range(N)) for epoch in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    assert len(made) == 1


# -- how Keras reads the views ---------------------------------------------


def test_a_step_call_reads_steps_per_execution_batches():
    # The step guard resolves once per call of the compiled step, which
    # reads `steps_per_execution` batches in the graph.
    x, y, _ = _arrays()
    made = []
    data = _staged(
        x,
        made,
        y=y,
        batch_size=4,  # 6 batches an epoch, 3 calls of 2
        epochs=EPOCHS,
        steps_per_execution=2,
    )
    assert data.long_lived

    @tf.function
    def two_batches(iterator):
        return tf.concat([iterator.get_next()[0], iterator.get_next()[0]], 0)

    epochs = []
    for _ in range(EPOCHS):
        view = iter(data.pipeline)
        calls = [two_batches(resolve(view)).numpy().tolist() for _ in "abc"]
        iter(data.pipeline)
        epochs.append([v for call in calls for v in call])
    data.end_call()
    assert epochs == [list(range(N))] * EPOCHS
    assert len(made) == 1


def test_an_epoch_left_early_is_finished_before_the_next():
    # A callback's `stop_evaluating` ends an evaluation early; plain Keras
    # starts the next from a fresh iterator.
    keras.utils.set_random_seed(SEED)
    reference = _dataset()
    iterations = [_firsts(_values(b) for b in reference) for _ in range(6)]
    keras.utils.set_random_seed(SEED)
    made = []
    data = _staged(_dataset(), made, phase="test", role="val", epochs=EPOCHS)
    view = iter(data.pipeline)
    first = _values(next(view))
    assert first[0] == iterations[0][:BATCH]
    rest = _read_pipeline(data, epochs=2)
    data.end_call()
    assert _epochs([("v", v) for v in rest], "v") == [
        iterations[2],
        iterations[4],
    ]
    assert len(made) == 1  # the rest of the first epoch was read past


def test_an_epoch_of_arrays_left_early_restarts_at_the_next():
    x, y, _ = _arrays()
    made = []
    data = _staged(x, made, y=y, batch_size=BATCH, epochs=EPOCHS)
    view = iter(data.pipeline)
    assert _values(next(view))[0] == list(range(BATCH))
    rest = _read_pipeline(data, epochs=2)
    data.end_call()
    assert _epochs([("t", v) for v in rest], "t") == [list(range(N))] * 2
    assert len(made) == 2  # a new iterator, at the second epoch


def _words_model(**staged_input):
    words = [f"w{i}" for i in range(7)]
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput(**staged_input)(inputs)
    x = keras.layers.StringLookup(vocabulary=words, name="lookup")(x)
    x = keras.layers.Embedding(9, 4, name="emb")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1, name="head")(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    layer = model.layers[1]
    return model, layer, model._stage_plan()[1]


def test_arrays_start_a_new_iterator_when_the_pool_is_resized():
    _, layer, split = _words_model()
    words = np.array([f"w{i % 7}" for i in range(48)], dtype=object)
    labels = np.zeros((48, 1), "float32")
    made = []
    data = stage_data(
        layer,
        "train",
        words,
        labels,
        batch_size=16,
        split=split,
        epochs=3,
        costs=StageCosts(on_iterator=made.append),
    )
    pool = data.staged.thread_pool
    assert data.long_lived and pool is not None
    first = _read_epoch(data.pipeline, 3)
    pool.resize(1)  # what PrefetchCallback's verdict does between epochs
    second = _read_epoch(data.pipeline, 3)
    third = _read_epoch(data.pipeline, 3)
    data.end_call()
    assert first == second == third
    assert len(made) == 2


def test_a_dataset_on_the_adaptive_pool_runs_long_lived_unless_it_draws():
    _, layer, split = _words_model()
    words = np.array([f"w{i % 7}" for i in range(48)], dtype=object)
    labels = np.zeros((48, 1), "float32")
    ds = tf.data.Dataset.from_tensor_slices((words, labels)).batch(16)
    made = []
    data = stage_data(
        layer,
        "train",
        ds,
        split=split,
        epochs=3,
        costs=StageCosts(on_iterator=made.append),
    )
    assert data.staged.thread_pool is not None
    assert data.long_lived and data.epochs_restartable
    first = _read_epoch(data.pipeline, 3)
    data.staged.thread_pool.resize(1)  # the verdict, between epochs
    second = _read_epoch(data.pipeline, 3)
    third = _read_epoch(data.pipeline, 3)
    data.end_call()
    assert first == second == third
    assert len(made) == 2  # a new iterator on the resized pool
    # A drawing dataset's first epoch reads an iterator of its own, the
    # rest one more, on the pool sized from the first (see the next test).
    reshuffled = ds.shuffle(3, seed=SEED)
    data = stage_data(layer, "train", reshuffled, split=split, epochs=3)
    assert data.long_lived and not data.epochs_restartable
    data.end_call()


def _labelled_words(seed):
    """48 words, each example's label its own, shuffled from `seed`."""
    words = np.array([f"w{i % 7}" for i in range(48)], dtype=object)
    labels = np.arange(48, dtype="float32").reshape(-1, 1)
    ds = tf.data.Dataset.from_tensor_slices((words, labels))
    return ds.shuffle(48, seed=seed).batch(16)


def _labels_read(seen):
    """`(phase, labels)` of each batch a `_Recorder` saw."""
    return [(phase, values[-1]) for phase, values in seen]


class _Resize(keras.callbacks.Callback):
    """Resizes a pool after every epoch, as PrefetchCallback's verdict may."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool

    def on_epoch_end(self, epoch, logs=None):
        self.pool.resize(1 + epoch % 2)


@pytest.mark.parametrize("global_seed", [False, True])
def test_a_drawing_dataset_on_the_adaptive_pool_reads_plain_orders(
    global_seed,
):
    # keras.utils.set_random_seed + shuffle (the keras.io recipe), or a
    # shuffle's own seed: plain Keras draws a new order every epoch.
    def make(seed):
        return _labelled_words(None if global_seed else seed)

    _, layer, split = _words_model()
    keras.utils.set_random_seed(SEED)
    plain = _fit(make(3), validation_data=make(4))
    keras.utils.set_random_seed(SEED)
    train_x, val_x = make(3), make(4)
    made = []
    train, val = (
        stage_data(
            layer,
            phase,
            x,
            role=role,
            split=split,
            epochs=EPOCHS,
            alongside=(o,),
            costs=StageCosts(on_iterator=made.append),
        )
        for phase, role, x, o in (
            ("train", "train", train_x, val_x),
            ("test", "val", val_x, train_x),
        )
    )
    assert train.staged.thread_pool is not None
    assert train.long_lived and val.long_lived
    assert not train.epochs_restartable
    staged = _fit(
        train.pipeline,
        validation_data=val.pipeline,
        callbacks=[_Resize(train.staged.thread_pool)],
    )
    train.end_call()
    val.end_call()
    assert _labels_read(staged) == _labels_read(plain)
    trained = [
        labels for phase, labels in _labels_read(plain) if phase == "train"
    ]
    assert trained[:3] != trained[3:6]  # it draws a new order each epoch
    # Two for training: the first epoch's, and one for the rest on the
    # resized pool; one for validation, whose pool nothing resizes.
    assert len(made) == 3


@pytest.mark.parametrize("seeded_shuffle", [False, True])
def test_a_fit_on_a_dataset_on_the_adaptive_pool_trains_as_plain_keras(
    seeded_shuffle,
):
    words = np.array([f"w{i % 7}" for i in range(64)], dtype=object)
    labels = np.linspace(0.0, 1.0, 64, dtype="float32").reshape(-1, 1)

    def batched(ds):
        # keras.io's recipe: set_random_seed, then shuffle every epoch.
        return ds.shuffle(64).batch(8) if seeded_shuffle else ds.batch(8)

    def datasets():
        # Each model's own, made alike after the same global seed: a
        # shuffle's seed generator goes on from every iterator made.
        keras.utils.set_random_seed(SEED)
        pairs = tf.data.Dataset.from_tensor_slices
        return (
            batched(pairs((words, labels))),
            batched(pairs((words[:24], labels[:24]))),
        )

    staged, _, _ = _words_model()
    inputs = keras.Input(shape=(), dtype="string")
    x = keras.layers.StringLookup(
        vocabulary=[f"w{i}" for i in range(7)], name="lookup"
    )(inputs)
    x = keras.layers.Embedding(9, 4, name="emb")(x)
    plain = keras.Model(inputs, keras.layers.Dense(1, name="head")(x))
    plain.compile(optimizer="sgd", loss="mse")
    staged.set_weights(plain.get_weights())
    histories = []
    for model in (plain, staged):
        ds, val = datasets()
        history = model.fit(
            ds,
            epochs=4,
            validation_data=val,
            shuffle=False,
            verbose=0,
            callbacks=[keras_stage.callbacks.PrefetchCallback()]
            if model is staged
            else [],
        )
        histories.append(history)
    kept = staged._keras_stage_state.stages
    # A fit's validation reads a fed source (`FedSource`), on one iterator:
    # fed its passes with the unread iterators Keras makes between them.
    assert kept["val"].long_lived.feeds and kept["val"].carries()
    for role in ("train",) if seeded_shuffle else ("train", "val"):
        if seeded_shuffle:
            # Drawn anew each epoch: training's first epoch on an iterator
            # of its own, the other three on one more (the orders are
            # checked batch by batch above).
            assert kept[role].long_lived.epochs == 4
            assert kept[role].long_lived.stop is not None
        else:
            # One iterator, which their datasets (drawing nothing) let run
            # on into later calls.
            assert kept[role].long_lived.epochs is None
            assert kept[role].spans_calls and kept[role].carries()
    for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
        histories[0].history["val_loss"],
        histories[1].history["val_loss"],
        rtol=1e-6,
    )


# -- ends ------------------------------------------------------------------


def test_an_early_stop_leaves_nothing_running_after_end_call():
    x, y, _ = _arrays()
    made = []
    data = _staged(x, made, y=y, batch_size=BATCH, epochs=6)

    class StopAfterTwo(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = epoch == 1

    seen = _fit(data.pipeline, epochs=6, callbacks=[StopAfterTwo()])
    assert len(seen) == 2 * 3
    stats = data.staged.stats
    # The stage fills on past the epoch Keras ended.
    deadline = time.monotonic() + 10
    while stats.snapshot()["produced"] <= 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats.snapshot()["produced"] > 6
    real = weakref.ref(data.iterators._shared._iterator)
    # Its teardown runs on a thread of its own (it can block).
    data.end_call().join(10)
    gc.collect()
    assert real() is None
    produced = stats.snapshot()["produced"]
    time.sleep(0.3)
    assert stats.snapshot()["produced"] == produced
    with pytest.raises(RuntimeError, match="ended"):
        resolve(iter(data.pipeline))
    assert len(made) == 1


class _Teardown:
    """Stands for the thread tearing down a call's iterator."""

    def __init__(self):
        self.joined = False

    def join(self, timeout=None):
        self.joined = True

    def is_alive(self):
        return False


class _StuckTeardown(_Teardown):
    def is_alive(self):
        return True


def test_a_kept_stage_waits_for_the_last_iterators_teardown():
    # A call that runs a kept stage again opens its gate: what the last
    # call's iterator still finished must be gone by then, or it would
    # count in the stats the new iterator reads. (adaptive=False: these
    # short fits on data in memory would otherwise run unstaged once
    # measured, and keep no stage.)
    # (A fixed pool: a reshuffling dataset on an adaptive one keeps an
    # iterator per epoch.)
    staged, _, _ = _words_model(adaptive=False, num_threads=2)
    words = np.array([f"w{i % 7}" for i in range(32)], dtype=object)
    labels = np.zeros((32, 1), "float32")
    # A seeded shuffle: its iterator ends with each call (one that draws
    # nothing would run on into the next, see staged_data_test.py).
    ds = (
        tf.data.Dataset.from_tensor_slices((words, labels))
        .shuffle(32, seed=1)
        .batch(8)
    )
    staged.fit(ds, epochs=2, shuffle=False, verbose=0)
    entry = staged._keras_stage_state.stages["train"]
    assert entry.long_lived is not None and not entry.spans_calls
    entry.released.join(10)
    teardown = entry.released = _Teardown()
    staged.fit(ds, epochs=2, shuffle=False, verbose=0)
    assert staged._keras_stage_state.stages["train"] is entry
    assert teardown.joined
    assert entry.released is not teardown  # the second call's own
    # A teardown that does not end: the next call stages on its own.
    entry.released.join(10)
    stuck = entry.released = _StuckTeardown()
    staged.fit(ds, epochs=2, shuffle=False, verbose=0)
    assert stuck.joined
    assert staged._keras_stage_state.stages["train"] is entry
    assert entry.released is stuck  # the entry was not run again


def test_reading_more_epochs_than_announced_fails_clearly():
    x, y, _ = _arrays()
    data = _staged(x, [], y=y, batch_size=BATCH, epochs=2)
    _read_pipeline(data, epochs=2)
    with pytest.raises(RuntimeError, match="upper bound"):
        resolve(iter(data.pipeline))
    data.end_call()


def test_views_read_one_iterator_and_know_their_spec():
    x, y, _ = _arrays()
    data = _staged(x, [], y=y, batch_size=BATCH, epochs=2)
    first, second = iter(data.pipeline), iter(data.pipeline)
    assert isinstance(first, EpochView)
    assert first.element_spec == data.staged.pipeline.element_spec
    real = resolve(first)  # one call of the step: it reads a batch
    assert isinstance(real, tf.data.Iterator)
    assert _values(real.get_next())[0] == list(range(BATCH))
    assert _values(first.get_next())[0] == list(range(BATCH, 2 * BATCH))
    assert _values(next(first))[0] == list(range(2 * BATCH, 3 * BATCH))
    assert resolve(second) is real  # the next epoch, same iterator
    data.end_call()


# -- what keeps an iterator per epoch --------------------------------------


def _python_map(ds):
    return ds.map(
        lambda x, y: (tf.py_function(lambda v: v, [x], tf.float32), y)
    )


_VARIABLE = None


def _variable_map(ds):
    global _VARIABLE
    _VARIABLE = tf.Variable(1.0)
    return ds.map(lambda x, y: (x * _VARIABLE, y))


def _seeded_random_map(ds):
    tf.random.set_seed(SEED)
    return ds.map(lambda x, y: (x + tf.random.uniform(tf.shape(x)), y))


def _captured(ds):
    flat = tf.data.Dataset.range(1).flat_map(lambda _: ds)
    return flat.apply(tf.data.experimental.assert_cardinality(3))


def _generator():
    def batches():
        for i in range(3):
            yield np.full((BATCH,), i, "float32"), np.zeros((BATCH,), "float32")

    return batches()


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 3

    def __getitem__(self, index):
        return np.full((BATCH,), index, "float32"), np.zeros((BATCH,))


@pytest.mark.parametrize(
    "case, expected",
    [
        ("one_epoch", "one epoch"),
        ("steps_per_execution", "does not divide"),
        ("partial_evaluations", "part of the data"),
        ("ignored_exceptions", "skip batches"),
        ("predict", "predict"),
        ("generator", "not known"),
        ("py_dataset", "not in-memory arrays or a tf.data.Dataset"),
        ("python", "calls Python"),
        ("variable", "state"),
        ("seeded_random_map", "seeded stateful random op"),
        ("captured_dataset", "captured"),
        ("shared_with_validation", "same datasets"),
        ("big_seeded_arrays", "MiB"),
        ("strategy", "strategy"),
        ("max_steps_per_epoch", "max_steps_per_epoch"),
    ],
)
def test_unsafe_cases_keep_an_iterator_per_epoch(case, expected, monkeypatch):
    x, y, _ = _arrays()
    layer = _layer()
    kwargs = {"epochs": EPOCHS, "batch_size": BATCH}
    phase, data_x, data_y = "train", x, y
    if case == "one_epoch":
        kwargs["epochs"] = 1
    elif case == "steps_per_execution":
        kwargs["steps_per_execution"] = 2  # 3 batches: a call reads past
    elif case == "partial_evaluations":
        phase, kwargs["role"], kwargs["steps"] = "test", "val", 2
    elif case == "ignored_exceptions":
        layer = keras_stage.layers.StagedInput(
            ignored_exception_types=(tf.errors.InvalidArgumentError,)
        )
    elif case == "predict":
        phase, data_y = "predict", None
    elif case == "generator":
        data_x, data_y = _generator(), None
    elif case == "py_dataset":
        data_x, data_y = _Batches(), None
    elif case in (
        "python",
        "variable",
        "seeded_random_map",
        "captured_dataset",
    ):
        transform = {
            "python": _python_map,
            "variable": _variable_map,
            "seeded_random_map": _seeded_random_map,
            "captured_dataset": _captured,
        }[case]
        data_x, data_y = transform(_dataset()), None
        del kwargs["batch_size"]
    elif case == "shared_with_validation":
        data_x, data_y = _dataset(), None
        del kwargs["batch_size"]
        kwargs["alongside"] = (data_x.take(1),)
    elif case == "big_seeded_arrays":
        monkeypatch.setattr(source_passes, "REPLAY_LIMIT_BYTES", 64)
        kwargs["shuffle"] = True
    elif case == "strategy":
        kwargs["strategy"] = tf.distribute.OneDeviceStrategy("/cpu:0")
    elif case == "max_steps_per_epoch":
        monkeypatch.setattr(keras.config, "max_steps_per_epoch", lambda: 2)
    made = []
    costs = StageCosts(on_iterator=made.append)
    data = stage_data(layer, phase, data_x, data_y, costs=costs, **kwargs)
    assert not data.long_lived and data.epochs is None
    assert expected in data.long_lived_refusal
    if phase == "predict":
        data.end_call()
        return
    # Today's behaviour: an iterator per epoch read.
    pipeline = data.pipeline
    assert isinstance(pipeline, (DeferredPipeline, tf.data.Dataset))
    if case != "strategy":
        assert isinstance(pipeline, DeferredPipeline)
        for _ in range(2):
            view = iter(pipeline)
            resolve(view).get_next()
        assert len(made) == 2
    data.end_call()


def test_without_epochs_nothing_changes():
    x, y, _ = _arrays()
    made = []
    data = _staged(x, made, y=y, batch_size=BATCH)
    assert not data.long_lived and data.long_lived_refusal is None
    assert isinstance(data.pipeline, DeferredPipeline)
    for _ in range(EPOCHS):
        epoch = _read_epoch(data.pipeline, 3)
        assert _firsts(epoch) == list(range(N))
    data.end_call()
    assert len(made) == EPOCHS


def test_compat_reads_a_datasets_inputs_and_functions():
    base = tf.data.Dataset.range(3)
    mapped = base.map(lambda v: v + 1)
    assert _compat.dataset_inputs(mapped) == [base]
    (function,) = _compat.dataset_functions(mapped)
    assert "AddV2" in {op.type for op in function.graph.get_operations()}
    assert _compat.dataset_functions(base) == []


# -- a staged fit ----------------------------------------------------------


def _staged_fit_model(staged, steps_per_execution):
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(4,))
    x = inputs
    if staged:
        # A fixed pool: an adaptive one resized between epochs starts a new
        # iterator of arrays (see the pool test above).
        x = keras_stage.layers.StagedInput(adaptive=False, num_threads=2)(
            inputs
        )
    x = keras.layers.Normalization(mean=0.5, variance=0.1)(x)  # staged
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(1)(x)
    cls = keras_stage.Model if staged else keras.Model
    model = cls(inputs, outputs)
    extra = {"smart_stage": True} if staged else {}
    model.compile(
        optimizer="sgd",
        loss="mse",
        steps_per_execution=steps_per_execution,
        **extra,
    )
    return model


@pytest.mark.parametrize(
    "source, shuffle, steps_per_execution",
    [
        pytest.param("arrays", True, 1, marks=pytest.mark.long),
        ("arrays", "batch", 2),
        ("dataset", None, 1),
        pytest.param("dataset", None, 2, marks=pytest.mark.long),
    ],
)
def test_a_fit_on_long_lived_stages_trains_as_plain_keras(
    source, shuffle, steps_per_execution, monkeypatch
):
    # fit gives its training and validation stages the fit's epochs (4,
    # validating every epoch); each makes one real iterator for all four.
    from keras_stage.models.call import measure

    built, made = [], []

    def recording_stage_data(layer, phase, *args, **kwargs):
        assert kwargs["epochs"] == 4, kwargs
        assert kwargs["steps_per_execution"] == steps_per_execution
        data = stage_data(layer, phase, *args, **kwargs)
        built.append(data)
        return data

    def counting_made(self, seconds):
        made.append(self.staged.name)

    monkeypatch.setattr(measure, "stage_data", recording_stage_data)
    monkeypatch.setattr(StagedData, "_made", counting_made)
    rng = np.random.default_rng(0)
    x = rng.random((96, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def fit(model):
        keras.utils.set_random_seed(7)
        if source == "arrays":
            return model.fit(
                x,
                y,
                batch_size=16,
                epochs=4,
                shuffle=shuffle,
                validation_data=(x[:32], y[:32]),
                verbose=0,
            )
        train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=5)
        val = tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).shuffle(32)
        return model.fit(
            train.batch(16),
            epochs=4,
            validation_data=val.batch(16),
            shuffle=False,
            verbose=0,
        )

    plain_model = _staged_fit_model(False, steps_per_execution)
    plain = fit(plain_model)
    staged_model = _staged_fit_model(True, steps_per_execution)
    staged = fit(staged_model)
    assert [data.long_lived for data in built] == [True, True]
    assert sorted(made) == sorted(data.staged.name for data in built)
    # What the stage holds when an epoch begins is that epoch's: the
    # buffer is not read as emptied at every epoch.
    assert max(staged.history["stage_buffer_fill"][1:]) > 0
    for a, b in zip(
        plain_model.get_weights(), staged_model.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert staged.history["val_loss"] == plain.history["val_loss"]


# -- strategies ------------------------------------------------------------


class _Replicas:
    """What `strategy_refusal` reads of a strategy of several replicas."""

    num_replicas_in_sync = 2


def test_which_strategies_let_keras_read_views_of_one_iterator():
    plain = tf.data.Dataset.range(8).batch(2)
    assert strategy_refusal(None, plain) is None
    assert "one replica" in strategy_refusal(
        tf.distribute.OneDeviceStrategy("/cpu:0"), plain
    )
    assert strategy_refusal(_Replicas(), plain) is None
    assert strategy_refusal(_Replicas(), None) is None  # in-memory arrays
    # An order that follows the iterators made: Keras's extra one a call
    # would take a draw.
    seeded = tf.data.Dataset.range(8).shuffle(8, seed=1).batch(2)
    assert "seeded draws" in strategy_refusal(_Replicas(), seeded)
    # No seed at all (the suite's global one cleared): no order to keep.
    tf.random.set_seed(None)
    unseeded = tf.data.Dataset.range(8).shuffle(8).batch(2)
    assert strategy_refusal(_Replicas(), unseeded) is None
