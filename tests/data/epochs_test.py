"""Tests for keras_stage/data/epochs.py, on plain pipelines.

One long-lived iterator read through the epoch views a staged call hands
Keras, on small `range` pipelines with no stage, so each rule (counting,
epoch boundaries, restarts, refusals, fed passes, the release of the real
iterator) is checked on its own; the same iterator behind `stage_data` and
a real `fit` is tests/models/data_adapters/epoch_plans_test.py's.
"""

import threading
import weakref

import pytest
import tensorflow as tf

from keras_stage.data import epochs as epochs_module
from keras_stage.data.epochs import (
    RELEASE_THREAD,
    FedSource,
    LongLivedEpochs,
    LongLivedIterator,
    release,
)
from keras_stage.models.iterators.kept_iterators import EpochView, resolve
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(60)

BATCHES, EPOCHS = 3, 3


class _Pool:
    """What `LongLivedIterator` reads of a `StagePool`: its size."""

    def __init__(self, size):
        self.size = size


def _epochs_source(start=None, epochs=EPOCHS):
    """`epochs` epochs of `BATCHES` elements: epoch k holds k*B..(k+1)*B-1.

    With `start`, an iterator begins at the epoch the variable holds then,
    as `source_passes.long_lived_source` does.
    """
    passes = tf.data.Dataset.range(epochs)
    if start is not None:
        passes = passes.filter(lambda k: k >= start.read_value())
    return passes.flat_map(
        lambda k: tf.data.Dataset.range(k * BATCHES, (k + 1) * BATCHES)
    )


def _shared(start=None, pool=None, steps_per_execution=1, epochs=EPOCHS):
    made = []
    source = _epochs_source(start, epochs)
    plan = LongLivedEpochs(epochs, BATCHES, steps_per_execution, start, source)
    shared = LongLivedIterator(
        source, plan, made.append, pool=pool, name="unit"
    )
    return shared, made


def _read(view, count):
    return [int(next(view)) for _ in range(count)]


# -- LongLivedIterator ------------------------------------------------------


def test_views_of_successive_epochs_read_one_real_iterator():
    shared, made = _shared()
    first, second = EpochView(shared, None), EpochView(shared, None)
    assert _read(first, BATCHES) == [0, 1, 2]
    assert shared.epoch == 1  # between epochs: the next
    assert _read(second, BATCHES) == [3, 4, 5]
    assert len(made) == 1
    assert shared.read_batches == 2 * BATCHES


def test_each_resolve_counts_steps_per_execution_batches():
    shared, made = _shared(steps_per_execution=3)
    view = EpochView(shared, None)
    real = resolve(view)
    assert shared.read_batches == 3
    assert [int(real.get_next()) for _ in range(3)] == [0, 1, 2]
    assert resolve(EpochView(shared, None)) is real  # the next epoch
    assert shared.read_batches == 6 and shared.epoch == 2  # its end


def test_an_epoch_left_early_is_read_to_its_end_without_a_start():
    shared, made = _shared()
    assert _read(EpochView(shared, None), 1) == [0]
    # The next epoch starts where a fresh iterator of it would.
    assert _read(EpochView(shared, None), BATCHES) == [3, 4, 5]
    assert len(made) == 1  # the rest of the first was read past


def test_an_epoch_left_early_restarts_on_a_new_iterator_with_a_start():
    start = tf.Variable(0, dtype=tf.int64)
    shared, made = _shared(start=start)
    assert _read(EpochView(shared, None), 1) == [0]
    assert _read(EpochView(shared, None), BATCHES) == [3, 4, 5]
    assert int(start.numpy()) == 1
    assert len(made) == 2


def test_more_epochs_than_announced_are_refused():
    shared, _ = _shared(epochs=1)
    _read(EpochView(shared, None), BATCHES)
    with pytest.raises(RuntimeError, match="built for 1 epochs.*upper bound"):
        resolve(EpochView(shared, None))


def test_a_closed_iterator_cannot_be_read():
    shared, _ = _shared()
    view = EpochView(shared, None)
    _read(view, 1)
    shared.close()
    assert shared.closed
    with pytest.raises(RuntimeError, match="Stage 'unit': its call has ended"):
        next(view)


class _Dropped:
    """Notes the thread that drops it (a stand-in for a tf.data iterator)."""

    def __init__(self, dropped_on):
        self._dropped_on = dropped_on

    def __del__(self):
        self._dropped_on.append(threading.current_thread().name)


def test_release_drops_the_iterator_on_its_own_thread():
    dropped_on = []
    held = [_Dropped(dropped_on)]
    thread = release(held)
    thread.join(10)
    assert held == []
    assert dropped_on == [RELEASE_THREAD]


def test_the_exit_waits_for_a_teardown_still_running():
    # A daemon thread stopped inside TensorFlow's teardown at exit could
    # crash it: the exit hook joins those still running.
    gate = threading.Event()

    class _Slow:
        def __del__(self):
            gate.wait(5)

    thread = release([_Slow()])
    assert thread.is_alive()
    threading.Timer(0.2, gate.set).start()
    epochs_module._finish_releases()
    assert not thread.is_alive()


def test_a_closed_iterator_drops_its_real_iterator_off_the_callers_thread():
    shared, _ = _shared()
    _read(EpochView(shared, None), 1)
    real = weakref.ref(shared._iterator)
    shared.close()
    # Nothing of the caller holds it: the release thread's drop deletes it.
    assert wait_until(lambda: real() is None, timeout=5.0)


def test_a_resized_pool_starts_a_new_iterator_at_the_epoch_boundary():
    start, pool = tf.Variable(0, dtype=tf.int64), _Pool(4)
    shared, made = _shared(start=start, pool=pool)
    _read(EpochView(shared, None), BATCHES)
    _read(EpochView(shared, None), BATCHES)
    assert len(made) == 1  # same pool: same iterator
    pool.size = 2
    assert _read(EpochView(shared, None), BATCHES) == [6, 7, 8]
    assert len(made) == 2


class _DroppedIterators:
    """A pipeline whose iterators (of `range(BATCHES * EPOCHS)`, from the
    epoch `start` holds) note the thread that drops them, as `_Dropped`."""

    def __init__(self, start):
        self.start = start
        self.dropped_on = []

    def __iter__(self):
        first = int(self.start.numpy()) * BATCHES
        return _DroppedIterator(range(first, BATCHES * EPOCHS), self)


class _DroppedIterator(_Dropped):
    def __init__(self, values, pipeline):
        super().__init__(pipeline.dropped_on)
        self._values = iter(values)

    def __next__(self):
        return next(self._values)


def test_the_iterator_a_resized_pool_replaces_is_dropped_off_the_reader():
    # A tf.data iterator's teardown waits for its autotuning thread to wake,
    # whose period doubles as it lives on: dropped on the training thread
    # between calls, it held a step for up to 25 s (`images`, 2 cores).
    start, pool = tf.Variable(0, dtype=tf.int64), _Pool(4)
    pipeline = _DroppedIterators(start)
    plan = LongLivedEpochs(EPOCHS, BATCHES, 1, start, pipeline)
    shared = LongLivedIterator(pipeline, plan, lambda _: None, pool=pool)
    assert _read(EpochView(shared, None), BATCHES) == [0, 1, 2]
    pool.size = 2
    assert _read(EpochView(shared, None), BATCHES) == [3, 4, 5]
    assert wait_until(lambda: pipeline.dropped_on, timeout=5.0)
    assert pipeline.dropped_on == [RELEASE_THREAD]


def test_without_a_start_a_resized_pool_keeps_the_iterator():
    pool = _Pool(4)
    shared, made = _shared(pool=pool)
    _read(EpochView(shared, None), BATCHES)
    pool.size = 1
    assert _read(EpochView(shared, None), BATCHES) == [3, 4, 5]
    assert len(made) == 1


def _fed(pool=None):
    """A `LongLivedIterator` of a `FedSource` of `BATCHES`-element passes."""

    def epoch(k):
        return tf.data.Dataset.range(k * BATCHES, (k + 1) * BATCHES)

    fed = FedSource(epoch(0).element_spec, epoch(0).options())
    made = []
    plan = LongLivedEpochs(None, BATCHES, 1, None, fed.dataset, feeds=True)
    plan.fed = fed
    shared = LongLivedIterator(
        fed.dataset, plan, made.append, pool=pool, name="fed"
    )
    return fed, shared, epoch, made


def test_a_fed_iterator_reads_each_calls_passes_in_turn():
    fed, shared, epoch, made = _fed()
    fed.feed(epoch(1), 2)
    assert _read(EpochView(shared, None), BATCHES) == [3, 4, 5]
    assert not shared.carries  # a pass fed and not read
    assert _read(EpochView(shared, None), BATCHES) == [3, 4, 5]
    assert shared.carries
    shared.detach()
    fed.feed(epoch(5), 1)  # the next call's, another dataset
    assert _read(EpochView(shared, None), BATCHES) == [15, 16, 17]
    assert len(made) == 1
    # Nothing fed past that: Keras beginning an epoch more is refused,
    # not left waiting for a pass.
    with pytest.raises(RuntimeError, match="built for 3 epochs"):
        resolve(EpochView(shared, None))
    shared.close()
    assert fed.closed


def test_a_fed_iterator_starts_no_new_iterator_for_an_epoch():
    # A new iterator would read the same queue: an epoch left early is
    # read to its end, and a resized pool runs in a stage built anew.
    pool = _Pool(2)
    fed, shared, epoch, made = _fed(pool)
    fed.feed(epoch(0), 2)
    assert not shared.restartable
    assert _read(EpochView(shared, None), 1) == [0]
    assert _read(EpochView(shared, None), BATCHES) == [0, 1, 2]
    assert shared.carries and len(made) == 1
    pool.size = 4
    assert not shared.carries
    shared.close()


def test_a_fed_source_holds_one_calls_passes_at_most():
    # A second feed before the first was read would wait for ever.
    fed, shared, epoch, made = _fed()
    fed.feed(epoch(0), 1)
    with pytest.raises(RuntimeError, match="fed while its last call"):
        fed.feed(epoch(1), 1)
    shared.close()
    with pytest.raises(RuntimeError, match="after it was closed"):
        fed.feed(epoch(1), 1)


def test_a_fed_source_closed_while_a_function_traces_closes_eagerly():
    # Its finalizer can run in a garbage collection inside another model's
    # step trace: the close must not become an op of that graph (which
    # would fail once this queue is gone).
    fed, _, _, _ = _fed()

    @tf.function
    def traced():
        fed.close()
        return tf.constant(1)

    graph = traced.get_concrete_function().graph
    assert not [op for op in graph.get_operations() if "Close" in op.type]
    assert fed.closed
    with pytest.raises(RuntimeError):
        fed.feed(tf.data.Dataset.range(3), 1)
