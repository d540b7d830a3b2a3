"""Tests of `keras_stage.data.stage`: values, bounds, threads, errors, stats."""

import gc
import os
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from keras_stage.data import (
    StagedDataset,
    StageTimeoutError,
    live_stages,
    stage,
)
from keras_stage.data.options import StageOptions
from keras_stage.data.staging import build_stage
from keras_stage.data.stats import StageStats
from tests.helpers import counters_with, wait_until

BAD_CSV = tf.errors.InvalidArgumentError


def _ints(dataset):
    return [int(x) for x in dataset]


def _stage_threads(name=None):
    prefix = "keras_stage" if name is None else f"keras_stage-{name}"
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(prefix) and t.is_alive()
    ]


def _py_map(python_fn, dtype=tf.int64):
    """A staged fn running `python_fn` on a scalar in a tf.py_function."""

    def fn(x):
        y = tf.py_function(python_fn, [x], dtype)
        y.set_shape(())
        return y

    return fn


class _Concurrency:
    """Counts calls started and the peak number running at once."""

    def __init__(self, sleep=0.0):
        self.sleep = sleep
        self.lock = threading.Lock()
        self.started = 0
        self.active = 0
        self.peak = 0

    def __call__(self, x):
        with self.lock:
            self.started += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            if self.sleep:
                time.sleep(self.sleep)
            return x
        finally:
            with self.lock:
                self.active -= 1


# -- values and order --------------------------------------------------------


@pytest.mark.timeout(60)
def test_fn_applied_to_every_element_in_order():
    staged = stage(
        tf.data.Dataset.range(40), lambda x: x * 3, capacity=4, num_threads=4
    )
    assert isinstance(staged, StagedDataset)
    assert isinstance(staged, tf.data.Dataset)
    assert _ints(staged) == [3 * i for i in range(40)]


@pytest.mark.timeout(60)
def test_order_kept_when_elements_finish_out_of_order():
    # Early elements sleep longest, so with 4 workers later ones finish
    # first; deterministic=True (the default) must still yield in order.
    def slow_first(x):
        time.sleep(0.05 * (8 - int(x)) if int(x) < 8 else 0)
        return x

    staged = stage(
        tf.data.Dataset.range(12),
        _py_map(slow_first),
        capacity=2,
        num_threads=4,
    )
    assert _ints(staged) == list(range(12))


@pytest.mark.timeout(60)
def test_non_deterministic_yields_every_element_once():
    staged = stage(
        tf.data.Dataset.range(30),
        lambda x: x + 1,
        num_threads=3,
        deterministic=False,
    )
    assert sorted(_ints(staged)) == list(range(1, 31))


@pytest.mark.timeout(60)
def test_non_deterministic_lets_ready_elements_pass_a_slow_one():
    # Element 0 is held until another element has reached the consumer,
    # not for a fixed time a loaded machine may not finish the others in:
    # were it not passed, it would come first, after the 20 s.
    passed = threading.Event()

    def slow_zero(x):
        if int(x) == 0:
            passed.wait(20)
        return x

    staged = stage(
        tf.data.Dataset.range(8),
        _py_map(slow_zero),
        capacity=8,
        num_threads=4,
        deterministic=False,
    )
    got = []
    for x in staged:
        got.append(int(x))
        passed.set()
    assert sorted(got) == list(range(8))
    assert got[0] != 0


@pytest.mark.timeout(60)
def test_fn_none_stages_elements_unchanged():
    source = tf.data.Dataset.range(7).map(lambda x: x * x)
    staged = stage(source, capacity=1, num_threads=2)
    assert staged.element_spec == source.element_spec
    assert _ints(staged) == [i * i for i in range(7)]


@pytest.mark.timeout(60)
def test_default_options_yield_all_elements():
    staged = stage(tf.data.Dataset.range(25), lambda x: x - 1)
    assert _ints(staged) == [i - 1 for i in range(25)]


@pytest.mark.timeout(60)
def test_tuple_element_reaches_fn_as_one_structure():
    source = tf.data.Dataset.from_tensor_slices(([1, 2, 3], [10, 20, 30]))
    seen = []

    def fn(element):
        seen.append(element)
        a, b = element
        return a + b

    staged = stage(source, fn, capacity=2, num_threads=2)
    assert isinstance(seen[0], tuple) and len(seen[0]) == 2
    assert [int(x) for x in staged] == [11, 22, 33]


@pytest.mark.timeout(60)
def test_one_tuple_element_keeps_its_structure():
    # A dataset of 1-tuples (what Keras makes of `x` alone for predict)
    # must stage as 1-tuples, and fn must receive the tuple.
    source = tf.data.Dataset.from_tensor_slices(([1, 2, 3],))
    staged = stage(source)
    assert staged.element_spec == source.element_spec
    assert [tuple(int(v) for v in e) for e in staged] == [(1,), (2,), (3,)]

    seen = []
    stage(source, lambda e: seen.append(e) or e)
    assert isinstance(seen[0], tuple), (
        f"fn received {seen[0]!r} instead of the 1-tuple element"
    )


@pytest.mark.timeout(60)
def test_dict_and_nested_structures_round_trip():
    source = tf.data.Dataset.from_tensor_slices(
        {
            "id": [1, 2, 3],
            "features": (
                [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
                {"tag": ["a", "b", "c"]},
            ),
        }
    )
    staged = stage(source, capacity=2, num_threads=2)
    assert staged.element_spec == source.element_spec
    got = list(staged)
    want = list(source)
    assert len(got) == 3
    for g, w in zip(got, want, strict=True):
        tf.nest.assert_same_structure(g, w)
        for gl, wl in zip(tf.nest.flatten(g), tf.nest.flatten(w), strict=True):
            assert gl.dtype == wl.dtype
            np.testing.assert_array_equal(gl.numpy(), wl.numpy())


@pytest.mark.timeout(60)
def test_dict_fn_output():
    source = tf.data.Dataset.from_tensor_slices({"a": [1, 2], "b": [3, 4]})
    staged = stage(
        source,
        lambda d: {"sum": d["a"] + d["b"], "pair": (d["a"], d["b"])},
        num_threads=2,
    )
    got = [
        (int(e["sum"]), int(e["pair"][0]), int(e["pair"][1])) for e in staged
    ]
    assert got == [(4, 1, 3), (6, 2, 4)]


@pytest.mark.timeout(60)
def test_string_leaves_round_trip():
    words = ["alpha", "", "γάμμα", "d" * 1000]
    staged = stage(
        tf.data.Dataset.from_tensor_slices(words),
        lambda s: (s, tf.strings.upper(s)),
        capacity=1,
        num_threads=2,
    )
    got = [(a.numpy().decode(), b.numpy().decode()) for a, b in staged]
    assert got == [(w, w.upper() if w.isascii() else w) for w in words]


@pytest.mark.timeout(60)
def test_ragged_leaves_round_trip():
    rows = [[1, 2], [3], [], [4, 5, 6], [7]]
    source = tf.data.Dataset.from_tensor_slices(tf.ragged.constant(rows)).batch(
        2
    )
    staged = stage(source, capacity=1, num_threads=2)
    assert staged.element_spec == source.element_spec
    got = list(staged)
    assert all(isinstance(r, tf.RaggedTensor) for r in got)
    assert [r.to_list() for r in got] == [rows[0:2], rows[2:4], rows[4:5]]

    doubled = stage(source, lambda r: r * 2, num_threads=2)
    assert [r.to_list() for r in doubled] == [
        [[v * 2 for v in row] for row in rows[i : i + 2]] for i in (0, 2, 4)
    ]


@pytest.mark.timeout(60)
def test_sparse_leaves_round_trip():
    sparse = tf.sparse.SparseTensor(
        indices=[[0, 0], [1, 2], [3, 1]],
        values=[1.0, 2.0, 3.0],
        dense_shape=[4, 3],
    )
    source = tf.data.Dataset.from_tensor_slices(sparse)
    staged = stage(source, capacity=1, num_threads=2)
    assert staged.element_spec == source.element_spec
    got = list(staged)
    assert all(isinstance(s, tf.sparse.SparseTensor) for s in got)
    dense = tf.sparse.to_dense(sparse).numpy()
    for i, s in enumerate(got):
        np.testing.assert_array_equal(tf.sparse.to_dense(s).numpy(), dense[i])

    scaled = stage(source, lambda s: tf.sparse.map_values(tf.multiply, s, 2.0))
    for i, s in enumerate(scaled):
        np.testing.assert_array_equal(
            tf.sparse.to_dense(s).numpy(), 2 * dense[i]
        )


@pytest.mark.timeout(60)
def test_staged_dataset_composes_like_any_dataset():
    staged = stage(tf.data.Dataset.range(10), lambda x: x + 100, name="comp")
    assert staged.name == "comp"
    assert _ints(staged.batch(4).map(tf.reduce_sum)) == [406, 422, 217]
    assert _ints(staged.take(2)) == [100, 101]


def test_default_names_are_unique():
    a = stage(tf.data.Dataset.range(1))
    b = stage(tf.data.Dataset.range(1))
    assert a.name and b.name and a.name != b.name


# -- capacity bound ----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity, num_threads", [(1, 1), (3, 2), (2, 4)])
def test_capacity_bound_is_exact(capacity, num_threads):
    counter = _Concurrency()
    staged = stage(
        tf.data.Dataset.range(1000),
        _py_map(counter),
        capacity=capacity,
        num_threads=num_threads,
    )
    consumed = 3
    iterator = iter(staged)
    assert [int(next(iterator)) for _ in range(consumed)] == [0, 1, 2]
    bound = capacity + num_threads
    # The consumer stalls: the stage fills its buffer and its workers, and
    # then must start nothing more.
    reached = wait_until(lambda: counter.started - consumed >= bound, 20)
    # Then a while longer, for an element started past the bound to show
    # (a slow machine only makes this check less sharp, never fail).
    time.sleep(0.5)
    ahead = counter.started - consumed
    assert ahead <= bound, (
        f"{ahead} elements started ahead of the consumer; capacity="
        f"{capacity} + num_threads={num_threads} allows {bound}"
    )
    assert reached and ahead == bound, (
        f"only {ahead} elements started ahead of a stalled consumer; the "
        f"buffer should fill to capacity + num_threads = {bound}"
    )
    assert staged.stats.snapshot()["buffered_peak"] <= bound
    # And the stage goes on where it stopped.
    assert [int(next(iterator)) for _ in range(3)] == [3, 4, 5]
    assert staged.close() is True


# -- num_threads -------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_threads", [4, 8])
def test_num_threads_run_at_once_even_on_few_cores(num_threads):
    tracker = _Concurrency(sleep=0.2)
    staged = stage(
        tf.data.Dataset.range(3 * num_threads),
        _py_map(tracker),
        capacity=2,
        num_threads=num_threads,
    )
    assert _ints(staged) == list(range(3 * num_threads))
    assert tracker.peak == num_threads


@pytest.mark.timeout(60)
def test_auto_threads_grow_past_the_cores_for_io_bound_work():
    tracker = _Concurrency(sleep=0.1)
    n = 60
    staged = stage(tf.data.Dataset.range(n), _py_map(tracker))
    assert _ints(staged) == list(range(n))
    cpus = os.cpu_count() or 1
    assert tracker.peak > cpus, (
        f"num_threads='auto' ran at most {tracker.peak} sleeping calls at "
        f"once on {cpus} cores; IO-bound stages must be allowed more"
    )


@pytest.mark.timeout(60)
def test_auto_threads_stay_within_thread_pool_size():
    tracker = _Concurrency(sleep=0.1)
    staged = stage(
        tf.data.Dataset.range(20), _py_map(tracker), thread_pool_size=3
    )
    assert _ints(staged) == list(range(20))
    assert 1 <= tracker.peak <= 3


# -- ignored_exception_types -------------------------------------------------

_CSV_LINES = ["1,a", "2,b", "x,c", "4,d", "5,e", "y,f", "z,g", "8,h", "9,i"]
_CSV_GOOD = [(1, "a"), (2, "b"), (4, "d"), (5, "e"), (8, "h"), (9, "i")]
_CSV_BAD = ["x", "y", "z"]


def _decode_csv(line):
    number, text = tf.io.decode_csv(line, [[0], [""]])
    return number, text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_threads", [1, 3])
def test_ignored_errors_skip_exactly_the_bad_elements(num_threads):
    staged = stage(
        tf.data.Dataset.from_tensor_slices(_CSV_LINES),
        _decode_csv,
        capacity=2,
        num_threads=num_threads,
        ignored_exception_types=(BAD_CSV,),
        name="csv_reader",
    )
    got = [(int(n), t.numpy().decode()) for n, t in staged]
    assert got == _CSV_GOOD
    snap = staged.stats.snapshot()
    assert snap["skipped"] == len(_CSV_BAD)
    assert snap["produced"] == snap["consumed"] == len(_CSV_GOOD)
    messages = snap["skipped_messages"]
    assert len(messages) == len(_CSV_BAD)
    for message, bad in zip(messages, _CSV_BAD, strict=True):
        assert message.startswith("InvalidArgumentError")
        assert f"not a valid int32: {bad}" in message


@pytest.mark.timeout(60)
def test_ignored_base_class_covers_subclasses():
    staged = stage(
        tf.data.Dataset.from_tensor_slices(_CSV_LINES),
        _decode_csv,
        ignored_exception_types=(tf.errors.OpError,),
    )
    assert [int(n) for n, _ in staged] == [n for n, _ in _CSV_GOOD]
    assert staged.stats.snapshot()["skipped"] == len(_CSV_BAD)


@pytest.mark.timeout(30)
def test_error_not_ignored_keeps_its_type_and_names_the_stage(tmp_path):
    present = tmp_path / "present.txt"
    present.write_text("hello")
    missing = tmp_path / "missing.txt"
    staged = stage(
        tf.data.Dataset.from_tensor_slices([str(present), str(missing)]),
        tf.io.read_file,
        capacity=1,
        num_threads=1,
        ignored_exception_types=(tf.errors.InvalidArgumentError,),
        name="file_reader",
    )
    iterator = iter(staged)
    assert next(iterator).numpy() == b"hello"
    started = time.monotonic()
    with pytest.raises(tf.errors.NotFoundError) as info:
        next(iterator)
    assert time.monotonic() - started < 10
    message = info.value.message
    assert "missing.txt" in message
    assert "raised inside stage 'file_reader'" in message
    assert staged.stats.snapshot()["skipped"] == 0


@pytest.mark.timeout(30)
def test_error_with_default_policies_keeps_its_type():
    staged = stage(
        tf.data.Dataset.from_tensor_slices(["1,a", "x,b"]),
        _decode_csv,
        name="strict_csv",
    )
    iterator = iter(staged)
    assert int(next(iterator)[0]) == 1
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        next(iterator)
    assert "not a valid int32: x" in info.value.message
    assert "raised inside stage 'strict_csv'" in info.value.message


# -- closed_exception_types --------------------------------------------------


@pytest.mark.timeout(30)
def test_closed_error_ends_iteration_after_the_elements_before_it(tmp_path):
    paths = []
    for i in range(3):
        path = tmp_path / f"shard_{i}.txt"
        path.write_text(f"shard {i}")
        paths.append(str(path))
    paths += [str(tmp_path / "gone.txt"), paths[0]]
    staged = stage(
        tf.data.Dataset.from_tensor_slices(paths),
        tf.io.read_file,
        capacity=2,
        num_threads=2,
        closed_exception_types=(tf.errors.NotFoundError,),
    )
    iterator = iter(staged)
    got = [next(iterator).numpy() for _ in range(3)]
    assert got == [b"shard 0", b"shard 1", b"shard 2"]
    with pytest.raises(StopIteration):
        next(iterator)


@pytest.mark.timeout(30)
def test_closed_csv_error_ends_a_for_loop():
    staged = stage(
        tf.data.Dataset.from_tensor_slices(_CSV_LINES),
        _decode_csv,
        num_threads=3,
        closed_exception_types=(BAD_CSV,),
    )
    assert [int(n) for n, _ in staged] == [1, 2]


# -- timeout -----------------------------------------------------------------


def _blocking_source(release, block_at=2, n=5):
    def gen():
        for i in range(n):
            if i == block_at:
                release.wait(30)
            yield i

    return tf.data.Dataset.from_generator(
        gen, output_signature=tf.TensorSpec((), tf.int64)
    )


@pytest.mark.timeout(30)
def test_timeout_raises_stage_timeout_error_naming_the_stage():
    release = threading.Event()
    try:
        staged = stage(
            _blocking_source(release),
            capacity=1,
            num_threads=1,
            timeout=1.0,
            name="hung_source",
        )
        iterator = iter(staged)
        assert [int(next(iterator)) for _ in range(2)] == [0, 1]
        started = time.monotonic()
        with pytest.raises(StageTimeoutError) as info:
            next(iterator)
        waited = time.monotonic() - started
    finally:
        release.set()
    assert 0.9 <= waited < 10
    assert isinstance(info.value, tf.errors.DeadlineExceededError)
    message = info.value.message
    assert "Stage 'hung_source' timed out" in message
    assert "timeout=1 s" in message
    assert "Likely cause" in message


@pytest.mark.timeout(30)
def test_timeout_inside_staged_fn():
    release = threading.Event()

    def hang_on_3(x):
        if int(x) == 3:
            release.wait(30)
        return x

    try:
        staged = stage(
            tf.data.Dataset.range(6),
            _py_map(hang_on_3),
            capacity=1,
            num_threads=1,
            timeout=1.0,
            name="hung_fn",
        )
        iterator = iter(staged)
        assert [int(next(iterator)) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(StageTimeoutError, match="Stage 'hung_fn'"):
            next(iterator)
    finally:
        release.set()


@pytest.mark.timeout(30)
def test_abandoned_helper_thread_exits_once_its_call_returns():
    release = threading.Event()
    try:
        staged = stage(
            _blocking_source(release),
            capacity=1,
            num_threads=1,
            timeout=1.0,
            name="abandoned",
        )
        iterator = iter(staged)
        next(iterator)
        next(iterator)
        with pytest.raises(StageTimeoutError):
            next(iterator)
    finally:
        release.set()
    # The source is unblocked: the helper thread that was left waiting on
    # it has nothing left to do and must not linger.
    assert wait_until(
        lambda: staged.close(timeout=1.0) and not _stage_threads("abandoned"),
        20,
    ), f"left behind: {[t.name for t in _stage_threads('abandoned')]}"


@pytest.mark.timeout(30)
def test_slow_but_within_timeout_does_not_raise():
    # Ten times the element's time: a loaded machine's first fetch (the
    # pipeline starting) must not pass for a stall.
    staged = stage(
        tf.data.Dataset.range(4),
        _py_map(_Concurrency(sleep=0.3)),
        capacity=1,
        num_threads=1,
        timeout=3.0,
    )
    assert _ints(staged) == [0, 1, 2, 3]


@pytest.mark.timeout(30)
def test_timeout_none_uses_no_helper_thread():
    before = threading.active_count()
    staged = stage(
        tf.data.Dataset.range(10), lambda x: x * 2, num_threads=2, timeout=None
    )
    iterator = iter(staged)
    assert int(next(iterator)) == 0
    assert threading.active_count() == before
    assert [int(x) for x in iterator] == [2 * i for i in range(1, 10)]
    assert threading.active_count() == before
    assert not _stage_threads(staged.name)


# -- buffered fetches skip the timeout's helper thread ------------------------


def _fetch(iterator):
    """`next(iterator)` as an int, with the thread that fetched it."""
    return threading.get_ident(), int(next(iterator))


def _fetch_after_buffering(staged, iterator, buffered=8):
    """One fetch, then `buffered` more once that many are counted.

    Returns `[(thread, value)]` of every fetch, each made through the
    stage's runner with `elements=1`.
    """
    # Counted by an earlier iterator of the stage and never consumed.
    left = staged.stats.unconsumed()
    # An iterator's first call starts its pipeline: it waits, on the helper.
    got = [staged.runner.call(_fetch, iterator, elements=1)]
    assert wait_until(lambda: staged.stats.unconsumed() - left >= buffered, 20)
    for _ in range(buffered):
        got.append(staged.runner.call(_fetch, iterator, elements=1))
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"fn": lambda x: x + 1, "deterministic": False, "num_threads": 2},
        {"fn": lambda x: x + 1, "num_threads": 1},
        {"fn": lambda x: x + 1, "num_threads": 4},
    ],
    ids=["nothing-to-compute", "unordered", "one-thread", "ordered-parallel"],
)
def test_buffered_fetches_run_in_the_callers_thread(settings):
    staged = stage(
        tf.data.Dataset.range(30), capacity=8, timeout=5.0, **settings
    )
    step = 1 if "fn" in settings else 0
    iterator = iter(staged.pipeline)
    here = threading.get_ident()
    got = _fetch_after_buffering(staged, iterator)
    values = [value for _, value in got]
    if settings.get("deterministic", True):
        assert values == list(range(step, 9 + step))
    else:
        # Whichever finished first: 9 distinct elements of the source.
        assert len(set(values)) == 9
        assert set(values) <= set(range(step, 30 + step))
    assert got[0][0] != here
    assert [thread for thread, _ in got[1:]] == [here] * 8
    # Without `elements` every call takes the helper thread.
    assert staged.runner.call(_fetch, iterator)[0] != here


@pytest.mark.timeout(60)
def test_an_ordered_stage_whose_earlier_element_hangs_still_times_out():
    # Its workers finish elements out of order: here every element after
    # the third is done while the third hangs. They are counted as the
    # ordered map delivers them, so none counts as ready, and the fetch of
    # the third waits on the helper thread and times out.
    release = threading.Event()

    def slow(x):
        if int(x) == 2:
            release.wait(30)
        return x + 1

    def fn(x):
        return tf.py_function(slow, [x], tf.int64)

    try:
        staged = stage(
            tf.data.Dataset.range(12),
            fn,
            capacity=8,
            num_threads=4,
            timeout=1.0,
            name="ordered_hang",
        )
        iterator = iter(staged.pipeline)
        here = threading.get_ident()
        got = [staged.runner.call(_fetch, iterator, elements=1)]
        got.append(staged.runner.call(_fetch, iterator, elements=1))
        assert [value for _, value in got] == [1, 2]
        # Elements 4, 5 and 6 are finished by the other workers...
        time.sleep(1.0)
        # ...and none is counted ahead of the hung one.
        assert staged.stats.unconsumed() == 0
        started = time.monotonic()
        with pytest.raises(StageTimeoutError, match="Stage 'ordered_hang'"):
            staged.runner.call(_fetch, iterator, elements=1)
        assert 0.9 <= time.monotonic() - started < 10
        assert here not in [thread for thread, _ in got[:1]]
    finally:
        release.set()


@pytest.mark.timeout(60)
def test_an_auto_stage_skips_the_hand_off_at_any_pool_size():
    # Counted in the order they are delivered, buffered elements are known
    # ready whether the pool runs one thread or several.
    staged = stage(
        tf.data.Dataset.range(30), lambda x: x + 1, capacity=8, timeout=5.0
    )
    here = threading.get_ident()
    for size in (1, 2):
        staged.thread_pool.resize(size)
        got = _fetch_after_buffering(staged, iter(staged.pipeline))
        assert [value for _, value in got] == list(range(1, 10))
        assert [thread for thread, _ in got[1:]] == [here] * 8


@pytest.mark.timeout(60)
def test_a_source_that_stalls_after_the_buffer_still_times_out():
    # The buffered elements are fetched in the caller's thread; the first
    # fetch that has to wait on the stalled source goes to the helper
    # thread and times out.
    release = threading.Event()
    try:
        staged = stage(
            _blocking_source(release, block_at=6, n=8),
            capacity=8,
            num_threads=1,
            timeout=1.0,
            name="stalls",
        )
        iterator = iter(staged)
        assert int(next(iterator)) == 0
        assert wait_until(lambda: staged.stats.unconsumed() >= 5, 20)
        assert [int(next(iterator)) for _ in range(5)] == [1, 2, 3, 4, 5]
        started = time.monotonic()
        with pytest.raises(StageTimeoutError, match="Stage 'stalls'"):
            next(iterator)
        assert 0.9 <= time.monotonic() - started < 10
    finally:
        release.set()


@pytest.mark.timeout(60)
def test_an_earlier_iterator_alive_keeps_every_call_on_the_helper():
    # Both iterators count in the same counters: the second cannot tell
    # which counted elements are its own.
    staged = stage(tf.data.Dataset.range(20), capacity=4, timeout=5.0)
    here = threading.get_ident()
    first = iter(staged.pipeline)
    assert staged.runner.call(_fetch, first, elements=1)[1] == 0
    second = iter(staged.pipeline)
    got = [staged.runner.call(_fetch, second, elements=1)]
    assert wait_until(lambda: staged.stats.unconsumed() >= 6, 20)
    got += [staged.runner.call(_fetch, second, elements=1) for _ in range(3)]
    assert [value for _, value in got] == [0, 1, 2, 3]
    assert here not in [thread for thread, _ in got]
    del first


# -- threads -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_close_after_full_pass_leaves_no_thread():
    # Compared with the threads alive before, so that a leak of another
    # test (reported there) does not fail this one.
    before = set(_stage_threads())
    staged = stage(tf.data.Dataset.range(10), lambda x: x + 1, num_threads=2)
    assert _ints(staged) == list(range(1, 11))
    assert _stage_threads(staged.name)
    assert staged.close() is True
    left = set(_stage_threads()) - before
    assert not left, f"threads left behind: {[t.name for t in left]}"


@pytest.mark.timeout(60)
def test_close_after_partial_pass_leaves_no_thread():
    staged = stage(tf.data.Dataset.range(100), num_threads=2, name="partial")
    iterator = iter(staged)
    next(iterator)
    assert staged.close() is True
    assert not _stage_threads("partial")


@pytest.mark.timeout(60)
def test_close_after_an_error_leaves_no_thread():
    staged = stage(
        tf.data.Dataset.from_tensor_slices(["1,a", "x,b"]),
        _decode_csv,
        name="failed",
    )
    with pytest.raises(tf.errors.InvalidArgumentError):
        list(staged)
    assert staged.close() is True
    assert not _stage_threads("failed")


# A thread a cycle leaked shows after one; `make test-long` runs the 15.
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "cycles", [4, pytest.param(15, marks=pytest.mark.long)]
)
def test_repeated_cycles_do_not_grow_the_thread_count(cycles):
    # Threads the cycles started and left behind; a thread of an earlier
    # test that ends meanwhile is not one (the count alone would drop).
    before = set(threading.enumerate())
    stage_threads_before = set(_stage_threads())
    for cycle in range(cycles):
        staged = stage(
            tf.data.Dataset.range(5),
            lambda x: x * 2,
            capacity=2,
            num_threads=2,
            name=f"cycle_{cycle}",
        )
        assert _ints(staged) == [0, 2, 4, 6, 8]
        assert staged.close() is True
    left = [t for t in threading.enumerate() if t not in before]
    assert not left, f"threads left behind: {[t.name for t in left]}"
    assert set(_stage_threads()) <= stage_threads_before


@pytest.mark.timeout(60)
def test_stage_dropped_without_close_leaves_no_thread():
    # `for x in stage(...)`, as in the docstring example, never calls
    # close(): once the stage is garbage, its helper thread must go too,
    # whether the stage was read to the end or only in part.
    for _ in range(2):
        assert _ints(stage(tf.data.Dataset.range(3), name="dropped")) == [
            0,
            1,
            2,
        ]
    partial = iter(stage(tf.data.Dataset.range(50), name="dropped"))
    assert int(next(partial)) == 0
    del partial
    gc.collect()
    assert not [s for s in live_stages() if s.name == "dropped"], (
        "stages read without close() are never garbage-collected"
    )
    assert wait_until(lambda: not _stage_threads("dropped"), 20), (
        f"{len(_stage_threads('dropped'))} helper threads outlived their stages"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", [None, lambda x: x + 1], ids=["none", "fn"])
def test_closed_gate_drops_elements_finished_afterwards(fn):
    # An iterator a finished call left alive must stop counting in (and
    # delivering from) its stage: its late elements fail instead.
    staged = stage(
        tf.data.Dataset.range(1000), fn, capacity=1, num_threads=1, name="gate"
    )
    iterator = iter(staged)
    next(iterator)
    staged.runner.close_gate()
    delivered = 0
    with pytest.raises(tf.errors.InvalidArgumentError, match="was closed"):
        for _ in range(10):
            next(iterator)
            delivered += 1
    # Only what was finished before the gate closed still arrives: the
    # buffer (capacity 1) and the element being produced.
    assert delivered <= 2
    produced = staged.stats.snapshot()["produced"]
    assert produced <= 3
    assert staged.close() is True


@pytest.mark.timeout(60)
def test_close_keeps_a_stage_usable():
    # close() ends the helper thread; a user's stage can be read again
    # (Keras calls close it after each fit that reads it).
    staged = stage(tf.data.Dataset.range(3), lambda x: x * 2, name="again")
    assert _ints(staged) == [0, 2, 4]
    assert staged.close() is True
    assert _ints(staged) == [0, 2, 4]
    assert staged.close() is True


@pytest.mark.timeout(60)
def test_two_iterators_interleaved():
    staged = stage(tf.data.Dataset.range(5), lambda x: x * 10)
    first, second = iter(staged), iter(staged)
    pairs = [(int(a), int(b)) for a, b in zip(first, second, strict=True)]
    assert pairs == [(i * 10, i * 10) for i in range(5)]


# -- stats -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_stats_count_every_element_of_a_full_pass():
    staged = stage(
        tf.data.Dataset.range(17), lambda x: x, capacity=3, num_threads=2
    )
    assert _ints(staged) == list(range(17))
    snap = staged.stats.snapshot()
    assert snap["produced"] == snap["consumed"] == 17
    assert snap["skipped"] == 0
    assert snap["skipped_messages"] == []


@pytest.mark.timeout(60)
def test_stats_wait_seconds_grow_when_the_stage_is_the_bottleneck():
    staged = stage(
        tf.data.Dataset.range(5),
        _py_map(_Concurrency(sleep=0.05)),
        capacity=1,
        num_threads=1,
    )
    assert _ints(staged) == list(range(5))
    snap = staged.stats.snapshot()
    assert snap["wait_seconds"] > 0
    assert snap["produced"] == snap["consumed"] == 5


def _consume_slowly(staged):
    got = []
    for x in staged:
        got.append(int(x))
        time.sleep(0.03)  # a slow consumer lets the buffer fill
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity, num_threads", [(1, 1), (2, 3)])
def test_stats_buffer_fill_within_bound(capacity, num_threads):
    n = 12
    staged = stage(
        tf.data.Dataset.range(n), capacity=capacity, num_threads=num_threads
    )
    assert _consume_slowly(staged) == list(range(n))
    snap = staged.stats.snapshot()
    bound = capacity + num_threads
    assert snap["produced"] == snap["consumed"] == n
    assert snap["buffered_peak"] <= bound
    # The fill sampled at each of the n fetches never exceeds the bound,
    # and a slow consumer finds elements waiting.
    assert 0 < snap["buffered_sum"] <= bound * n


@pytest.mark.timeout(60)
def test_stats_buffered_peak_with_auto_capacity():
    staged = stage(tf.data.Dataset.range(12), num_threads=2)
    assert _consume_slowly(staged) == list(range(12))
    snap = staged.stats.snapshot()
    assert snap["buffered_peak"] >= 1
    assert snap["buffered_sum"] <= snap["buffered_peak"] * 12


# -- inside tf.function ------------------------------------------------------


@pytest.mark.timeout(60)
def test_iteration_inside_tf_function():
    staged = stage(
        tf.data.Dataset.range(10), lambda x: x * 2, capacity=2, num_threads=2
    )

    @tf.function
    def total(dataset):
        result = tf.constant(0, tf.int64)
        for x in dataset:
            result += x
        return result

    @tf.function
    def first_two():
        iterator = iter(staged)
        return next(iterator) + next(iterator)

    assert int(total(staged)) == 90
    assert int(first_two()) == 2
    # The counters are ops of the pipeline, so they count in graph mode too.
    assert staged.stats.snapshot()["consumed"] == 12


@pytest.mark.timeout(60)
def test_errors_keep_their_type_inside_tf_function(tmp_path):
    bad_csv = stage(
        tf.data.Dataset.from_tensor_slices(["1,a", "x,b"]),
        lambda line: _decode_csv(line)[0],
        name="graph_csv",
    )
    missing = stage(
        tf.data.Dataset.from_tensor_slices([str(tmp_path / "no_file")]),
        tf.io.read_file,
        name="graph_reader",
    )

    @tf.function
    def consume(dataset):
        count = tf.constant(0)
        for _ in dataset:
            count += 1
        return count

    # Only the type and the original text are promised in graph mode (the
    # Python-side policies do not run there; TF 2.16 does not even name the
    # failing transformation).
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="not a valid int32: x"
    ):
        consume(bad_csv)
    with pytest.raises(tf.errors.NotFoundError, match="no_file"):
        consume(missing)


@pytest.mark.timeout(60)
def test_timeout_still_fires_after_a_full_pass():
    # The end of the data is a fetch that never finishes: the next pass's
    # waits must still be measured from their own start.
    release = threading.Event()
    passes = []

    def gen():
        passes.append(1)
        for i in range(3):
            if len(passes) == 2 and i == 1:
                release.wait(30)
            yield i

    source = tf.data.Dataset.from_generator(
        gen, output_signature=tf.TensorSpec((), tf.int64)
    )
    staged = stage(
        source, capacity=1, num_threads=1, timeout=1.0, name="second_pass"
    )
    try:
        assert [int(x) for x in staged] == [0, 1, 2]
        iterator = iter(staged)
        assert int(next(iterator)) == 0
        started = time.monotonic()
        with pytest.raises(StageTimeoutError, match="Stage 'second_pass'"):
            next(iterator)
        assert time.monotonic() - started < 10
    finally:
        release.set()


def test_fetches_counted_in_python_join_every_count():
    # Calls whose batch was buffered run without recording their fetch
    # (`StageStats.count_taken`): every reader of the consumed count adds
    # them until the next epoch's `mark_request` moves them into the
    # counters.
    stats = StageStats("taken", track_peak=True)
    stats._counters.assign(counters_with(stats, 5))
    stats.count_taken(2, buffered=3)
    assert stats.unconsumed() == 3
    snapshot = stats.snapshot()
    assert snapshot["consumed"] == 2
    assert snapshot["buffered_sum"] == 6
    assert snapshot["buffered_peak"] == 3
    # A step's report carries the graph's counters, which lack them.
    assert stats.take_report(list(stats._counters.numpy())) == 3
    stats.mark_request()
    counters = stats._counters.numpy()
    assert counters[2] == 2  # the consumed slot
    assert counters[7] == 3  # left unconsumed before this epoch
    assert stats.unconsumed() == 3
    assert stats.snapshot()["consumed"] == 2


@pytest.mark.parametrize("consumer_records", [False, True])
def test_a_stage_whose_consumer_records_builds_no_fetch_map(consumer_records):
    options = StageOptions(name="recorded", capacity=2, num_threads=1)
    staged = build_stage(
        tf.data.Dataset.range(4),
        lambda x: x * 2,
        options,
        stats=StageStats("recorded"),
        consumer_records=consumer_records,
    )
    graph = staged._as_serialized_graph().numpy()
    assert (b"recorded_fetch" in graph) is not consumer_records
    lean = staged.lean_pipeline._as_serialized_graph().numpy()
    assert b"recorded_fetch" not in lean
    assert [int(x) for x in staged.lean_pipeline] == [0, 2, 4, 6]
    staged.close()
