"""Python sources that fail name themselves: which source, which batch, why.

A generator or PyDataset that raises, yields a batch unlike its first ones
(dtype, rank, size, structure) or yields nothing gets an error naming the
source and the batch, with the original error chained and its type kept,
directly and through a staged `fit`/`evaluate`/`predict`; a good source
trains exactly like plain Keras.

The end-to-end tests go through `stage_data`, which calls `check_source`
on `x`.
"""

import pickle
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.layers import StagedInput
from keras_stage.models.data_adapters.python_sources import (
    SourceBatchError,
    SourceError,
    check_source,
)
from tests.helpers import stage_threads, sweep

pytestmark = pytest.mark.reliability

BATCH = 4
NUM_BATCHES = 6
FEATURES = 2
LAST = 2  # rows of the last, smaller batch of the good sources
# fault: (the batch it hits, what the message says of a bad batch)
FAULTS = {
    "raise": (3, None),
    "dtype": (2, r"`x` has dtype float64 but the first batch's has float32"),
    "rank": (
        2,
        r"`x` has rank 3 \(shape \(4, 2, 1\)\) but the first batch's has "
        r"rank 2",
    ),
    "size": (
        2,
        r"`x` has shape \(4, 3\) but the first batches fixed it to "
        r"\(None, 2\)",
    ),
    "structure": (
        2,
        r"it holds \[x, y, sample_weight\] but the first batch held \[x, y\]",
    ),
}
KINDS = ["generator", "py_dataset"]
SOURCE_NAMES = {
    "generator": "generator 'make_batches'",
    "py_dataset": "PyDataset 'MyData'",
}
WHERE = {
    "generator": r"batch {index} \(counting from 0\)",
    "py_dataset": r"batch {index} \(`__getitem__\({index}\)`\)",
}


def _batch(index, fault=None, rows=BATCH):
    """Batch `index`: seeded features and labels, spoiled by `fault`."""
    rng = np.random.default_rng(index)
    shape = {"rank": (rows, FEATURES, 1), "size": (rows, FEATURES + 1)}
    x = rng.normal(size=shape.get(fault, (rows, FEATURES)))
    x = x.astype("float64" if fault == "dtype" else "float32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    if fault == "raise":
        raise ValueError(f"corrupt record {index}")
    if fault == "structure":
        return x, y, np.ones((rows,), "float32")
    return x, y


def _rows(index, num_batches):
    return LAST if index == num_batches - 1 else BATCH


def make_batches(fault=None, at=None, num_batches=NUM_BATCHES, x_only=False):
    for i in range(num_batches):
        batch = _batch(i, fault if i == at else None, _rows(i, num_batches))
        yield batch[:1] if x_only else batch


class MyData(keras.utils.PyDataset):
    def __init__(
        self, fault=None, at=None, num_batches=NUM_BATCHES, x_only=False, **kw
    ):
        super().__init__(**kw)
        self.fault = fault
        self.at = at
        self.num_batches_ = num_batches
        self.x_only = x_only
        self.epochs_ended = 0

    def __len__(self):
        return self.num_batches_

    def __getitem__(self, index):
        fault = self.fault if index == self.at else None
        batch = _batch(index, fault, _rows(index, self.num_batches_))
        return batch[:1] if self.x_only else batch

    def on_epoch_end(self):
        self.epochs_ended += 1
        if self.fault == "epoch_end":
            raise RuntimeError("could not reshuffle the files")


def _source(kind, **kwargs):
    return make_batches(**kwargs) if kind == "generator" else MyData(**kwargs)


def _read_all(source):
    """Every batch of a (wrapped) source, read as Keras reads it."""
    if isinstance(source, keras.utils.PyDataset):
        return [source[i] for i in range(len(source))]
    return list(source)


def _expected(kind, fault):
    index, detail = FAULTS[fault]
    where = WHERE[kind].format(index=index)
    name = SOURCE_NAMES[kind]
    if fault == "raise":
        return index, rf"{name} raised ValueError at {where}: corrupt record 3"
    return (
        index,
        rf"{name}, {where}, does not match the first batches: {detail}",
    )


def _twins():
    """A plain and a staged model with the same initial weights."""
    inputs_ = keras.Input(shape=(FEATURES,))
    plain = keras.Model(inputs_, keras.layers.Dense(1)(inputs_))
    staged_inputs = keras.Input(shape=(FEATURES,))
    x = StagedInput(capacity=2, num_threads=2, name="src")(staged_inputs)
    staged = keras_stage.Model(staged_inputs, keras.layers.Dense(1)(x))
    staged.set_weights(plain.get_weights())
    for model in (plain, staged):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return plain, staged


def _call(model, method, source):
    if method == "fit":
        # Steps given: a generator of unknown length makes plain Keras warn
        # when it ends, and warnings are errors here.
        return model.fit(
            source,
            epochs=1,
            steps_per_epoch=NUM_BATCHES,
            shuffle=False,  # Keras warns that it cannot shuffle a generator
            verbose=0,
        )
    return getattr(model, method)(source, verbose=0)


# -- read directly -------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("kind", KINDS)
def test_bad_source_names_itself_and_the_batch(kind, fault):
    index, message = _expected(kind, fault)
    with pytest.raises(SourceError, match=message) as info:
        _read_all(check_source(_source(kind, fault=fault, at=index)))

    error = info.value
    assert error.source == SOURCE_NAMES[kind]
    assert error.index == index
    assert isinstance(error, ValueError)
    if fault == "raise":
        # The user's own error: kept as its cause, its type kept too.
        assert type(error).__name__ == "SourceValueError"
        assert type(error.__cause__) is ValueError
        assert str(error.__cause__) == "corrupt record 3"
        assert "comes from the source's own code" in str(error)
    else:
        assert isinstance(error, SourceBatchError)
        assert "Yield" in str(error)  # the fix


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_good_source_passes_through_unchanged(kind):
    # The same batches, in the same order, the smaller last one included.
    wrapped = _read_all(check_source(_source(kind)))
    plain = _read_all(_source(kind))
    assert len(wrapped) == len(plain) == NUM_BATCHES
    assert wrapped[-1][0].shape == (LAST, FEATURES)
    for got, want in zip(wrapped, plain, strict=True):
        for got_part, want_part in zip(got, want, strict=True):
            np.testing.assert_array_equal(got_part, want_part)


@pytest.mark.timeout(30)
def test_generator_batches_are_the_very_objects_yielded():
    batches = [_batch(i) for i in range(3)]
    wrapped = list(check_source(b for b in batches))
    assert all(a is b for a, b in zip(wrapped, batches, strict=True))


@pytest.mark.timeout(30)
def test_axis_that_differs_in_the_first_two_batches_may_vary():
    # Keras leaves such an axis free (variable-length sequences): so does
    # the check; an axis the first two batches agree on is fixed.
    def sequences(lengths):
        for length in lengths:
            yield np.ones((BATCH, length, 1), "float32"), np.ones((BATCH, 1))

    assert len(list(check_source(sequences([3, 5, 4, 7, 2])))) == 5
    with pytest.raises(SourceBatchError, match=r"batch 2 .*\(None, 3, 1\)"):
        list(check_source(sequences([3, 3, 4])))


@pytest.mark.timeout(30)
def test_text_batches_of_different_string_lengths_are_fine():
    def text():
        for words in (["a", "bb"], ["ccc", "d"], ["eeeeeee", "f"]):
            yield np.array(words), np.ones((2, 1), "float32")

    assert len(list(check_source(text()))) == 3


@pytest.mark.timeout(30)
def test_other_data_is_returned_as_is_and_wrapping_is_idempotent():
    x = np.ones((4, 2))
    dataset = tf.data.Dataset.from_tensor_slices(x)
    for data in (x, {"a": x}, dataset, [x, x], None):
        assert check_source(data) is data
    generator = check_source(make_batches())
    assert check_source(generator) is generator
    py_dataset = check_source(MyData())
    assert check_source(py_dataset) is py_dataset


@pytest.mark.timeout(30)
def test_wrapped_py_dataset_reports_the_source_settings():
    source = MyData(workers=3, use_multiprocessing=False, max_queue_size=7)
    wrapped = check_source(source)
    assert isinstance(wrapped, keras.utils.PyDataset)
    assert (wrapped.workers, wrapped.max_queue_size) == (3, 7)
    assert wrapped.use_multiprocessing is False
    assert wrapped.num_batches == len(wrapped) == NUM_BATCHES
    wrapped.on_epoch_end()
    assert source.epochs_ended == 1


@pytest.mark.timeout(30)
def test_py_dataset_epoch_hook_error_names_the_hook():
    wrapped = check_source(MyData(fault="epoch_end"))
    with pytest.raises(
        RuntimeError,
        match=(
            r"PyDataset 'MyData' raised RuntimeError in `on_epoch_end`: "
            r"could not reshuffle the files"
        ),
    ) as info:
        wrapped.on_epoch_end()
    assert isinstance(info.value, SourceError)
    assert info.value.index is None


@pytest.mark.timeout(30)
def test_error_whose_type_needs_more_than_a_message_is_still_named():
    # UnicodeDecodeError cannot be built from a message alone: the error
    # is a plain SourceError, still chained from the original.
    def broken():
        yield _batch(0)
        b"\xff".decode("utf-8")

    with pytest.raises(SourceError, match="raised UnicodeDecodeError") as info:
        list(check_source(broken()))
    assert type(info.value) is SourceError
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


@pytest.mark.timeout(30)
def test_key_error_message_is_not_quoted_twice():
    def broken():
        yield _batch(0)
        raise KeyError("label")

    with pytest.raises(KeyError) as info:
        list(check_source(broken()))
    assert str(info.value).startswith(
        "generator 'broken' raised KeyError at batch 1 (counting from 0): "
        "'label'\n"
    )


@pytest.mark.timeout(30)
def test_errors_and_wrapped_py_datasets_survive_pickling():
    # Keras's multiprocessing workers receive the dataset and send errors
    # back pickled.
    with pytest.raises(SourceError) as info:
        _read_all(check_source(MyData(fault="raise", at=3)))
    error = pickle.loads(pickle.dumps(info.value))
    assert type(error) is type(info.value)
    assert isinstance(error, ValueError)
    assert str(error) == str(info.value)
    assert (error.source, error.index) == ("PyDataset 'MyData'", 3)

    with pytest.raises(SourceBatchError) as info:
        _read_all(check_source(MyData(fault="dtype", at=2)))
    error = pickle.loads(pickle.dumps(info.value))
    assert type(error) is SourceBatchError
    assert error.index == 2

    wrapped = pickle.loads(pickle.dumps(check_source(MyData("size", at=2))))
    assert len([wrapped[0], wrapped[1]]) == 2  # the reference batches
    with pytest.raises(SourceBatchError, match=r"`x` has shape \(4, 3\)"):
        wrapped[2]


@pytest.mark.timeout(60)
def test_check_adds_a_few_microseconds_per_batch():
    batches = [_batch(i) for i in range(2)] * 1000
    # The best of a few rounds, as timeit does: a round a loaded machine
    # preempted says nothing of the check's own cost.
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in check_source(b for b in batches):
            pass
        rounds.append((time.perf_counter() - started) / len(batches))
    # Small beside a Keras step, which takes milliseconds.
    assert min(rounds) < 100e-6, rounds


# -- through a staged fit/evaluate/predict ----------------------------------


# Each fault and each kind of source in `make test`; the other four pairs
# in `make test-long`.
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind, fault",
    [
        ("generator", "raise"),
        ("py_dataset", "rank"),
        ("generator", "size"),
        ("py_dataset", "structure"),
        pytest.param("py_dataset", "raise", marks=pytest.mark.long),
        pytest.param("generator", "rank", marks=pytest.mark.long),
        pytest.param("py_dataset", "size", marks=pytest.mark.long),
        pytest.param("generator", "structure", marks=pytest.mark.long),
    ],
)
def test_staged_fit_names_the_bad_source_with_plain_keras_error_type(
    kind, fault
):
    plain, staged = _twins()
    index, message = _expected(kind, fault)
    with pytest.raises(tf.errors.OpError) as plain_info:
        _call(plain, "fit", _source(kind, fault=fault, at=index))
    before = stage_threads()

    with pytest.raises(tf.errors.OpError, match=message) as info:
        _call(staged, "fit", _source(kind, fault=fault, at=index))

    # The type plain Keras gives (TensorFlow's for the Python error).
    assert type(info.value) is type(plain_info.value)
    assert "raised inside stage 'src_train'" in str(info.value)
    # Plain Keras does not name the source.
    assert SOURCE_NAMES[kind] not in str(plain_info.value)
    if fault == "raise":
        # The original traceback travels in the message.
        assert "ValueError: corrupt record 3" in str(info.value)
    assert not stage_threads() - before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sweep(KINDS, kept=("generator",)))
def test_staged_fit_rejects_a_dtype_plain_keras_casts_silently(kind):
    plain, staged = _twins()
    index, message = _expected(kind, "dtype")
    # Plain Keras trains on the float64 batch, cast to float32.
    _call(plain, "fit", _source(kind, fault="dtype", at=index))

    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        _call(staged, "fit", _source(kind, fault="dtype", at=index))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind, method",
    [
        ("generator", "evaluate"),
        ("py_dataset", "predict"),
        pytest.param("py_dataset", "evaluate", marks=pytest.mark.long),
        pytest.param("generator", "predict", marks=pytest.mark.long),
    ],
)
def test_staged_evaluate_and_predict_name_the_failing_source(kind, method):
    _, staged = _twins()
    index, message = _expected(kind, "raise")
    source = _source(kind, fault="raise", at=index, x_only=method == "predict")
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        _call(staged, method, source)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_error_in_a_first_batch_reaches_fit_as_the_python_error(kind, at):
    # Keras reads the first two batches in the caller to infer the spec:
    # there the error is a real Python error, chained from the original.
    _, staged = _twins()
    with pytest.raises(ValueError, match="corrupt record") as info:
        _call(staged, "fit", _source(kind, fault="raise", at=at))
    assert isinstance(info.value, SourceError)
    assert info.value.index == at
    assert str(info.value.__cause__) == f"corrupt record {at}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_empty_generator_is_named(method):
    _, staged = _twins()
    with pytest.raises(
        SourceBatchError,
        match=(
            r"generator 'make_batches' yielded no batches; fit, evaluate "
            r"and predict need at least one. A generator can be iterated "
            r"only once"
        ),
    ):
        _call(staged, method, make_batches(num_batches=0))


@pytest.mark.timeout(60)
def test_exhausted_generator_is_named():
    _, staged = _twins()
    generator = make_batches()
    _call(staged, "fit", generator)
    with pytest.raises(ValueError, match="'make_batches' yielded no batches"):
        _call(staged, "fit", generator)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_empty_py_dataset_is_named(method):
    _, staged = _twins()
    with pytest.raises(
        SourceBatchError,
        match=(
            r"PyDataset 'MyData' yielded no batches: its `__len__` "
            r"returned 0"
        ),
    ):
        _call(staged, method, MyData(num_batches=0))


# The good sources: a smaller last batch; shuffling PyDatasets (Keras's
# order comes from the global seed); one read by Keras's worker threads.
GOOD = {
    "generator": (
        lambda: make_batches(),
        {"steps_per_epoch": NUM_BATCHES, "shuffle": False},
    ),
    "py_dataset_shuffled": (lambda: MyData(), {"shuffle": True, "epochs": 3}),
    "py_dataset_workers": (
        lambda: MyData(workers=2),
        {"shuffle": False, "epochs": 2},
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", sorted(GOOD))
def test_good_source_trains_exactly_like_plain_keras(source):
    make, fit_kwargs = GOOD[source]
    plain, staged = _twins()
    histories = []
    for model in (plain, staged):
        keras.utils.set_random_seed(7)
        histories.append(
            model.fit(make(), verbose=0, **fit_kwargs).history["loss"]
        )

    plain_loss, staged_loss = histories
    assert len(plain_loss) == fit_kwargs.get("epochs", 1)
    np.testing.assert_allclose(staged_loss, plain_loss, rtol=1e-6)
    for plain_w, staged_w in zip(
        plain.get_weights(), staged.get_weights(), strict=True
    ):
        np.testing.assert_allclose(staged_w, plain_w, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(120)
def test_variable_length_generator_trains_exactly_like_plain_keras():
    def sequences():
        for i, length in enumerate([3, 5, 4, 7, 2, 6]):
            rng = np.random.default_rng(i)
            x = rng.normal(size=(BATCH, length, 1)).astype("float32")
            yield x, rng.normal(size=(BATCH, 1)).astype("float32")

    def build(staged):
        inputs_ = keras.Input(shape=(None, 1))
        x = StagedInput(capacity=2)(inputs_) if staged else inputs_
        x = keras.layers.GlobalAveragePooling1D()(x)
        model_class = keras_stage.Model if staged else keras.Model
        return model_class(inputs_, keras.layers.Dense(1)(x))

    plain, staged = build(False), build(True)
    staged.set_weights(plain.get_weights())
    losses = []
    for model in (plain, staged):
        model.compile(optimizer="sgd", loss="mse")
        losses.append(
            model.fit(
                sequences(), steps_per_epoch=6, shuffle=False, verbose=0
            ).history
        )
    np.testing.assert_allclose(losses[1]["loss"], losses[0]["loss"], rtol=1e-6)
