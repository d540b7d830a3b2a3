"""`stage()` under op determinism: it runs, counts, and keeps its timeout.

With `tf.config.experimental.enable_op_determinism()` TensorFlow refuses
`tf.timestamp`; a stage built then counts without the clock, its eager
iterator times each fetch on the host, and the timeout watches the
consumed count instead of in-graph marks.
"""

import math
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from keras_stage.data import (
    StageOptions,
    StageTimeoutError,
    pipeline_model,
    stage,
)
from keras_stage.data.runner import StageRunner
from keras_stage.data.stats import StageStats
from tests.op_determinism import op_determinism

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def determinism():
    with op_determinism():
        yield


def _parse(line):
    return tf.strings.to_number(line)


def _lines(bad_at=()):
    rows = [f"{i}.5" for i in range(12)]
    for i in bad_at:
        rows[i] = "not a number"
    return tf.data.Dataset.from_tensor_slices(rows).batch(2)


@pytest.mark.parametrize("num_threads", [1, 2, "auto"])
def test_eager_stage_runs_counts_and_times_fetches_on_the_host(
    determinism, num_threads
):
    staged = stage(
        _lines(bad_at=[5]),
        _parse,
        capacity=2,
        num_threads=num_threads,
        ignored_exception_types=(tf.errors.InvalidArgumentError,),
        name="deterministic_parse",
    )
    for epoch in range(2):
        batches = [b.numpy().tolist() for b in staged]
        assert batches == [
            [0.5, 1.5],
            [2.5, 3.5],
            [6.5, 7.5],
            [8.5, 9.5],
            [10.5, 11.5],
        ], epoch
    snapshot = staged.stats.snapshot()
    assert snapshot["consumed"] == 10
    assert snapshot["produced"] == 10
    assert snapshot["skipped"] == 2
    # The host timed each fetch; tf.data's model of the stage's iterators
    # timed the staged computation (the pipeline has no clock).
    assert math.isfinite(snapshot["wait_seconds"])
    assert snapshot["wait_seconds"] > 0.0
    if pipeline_model.AVAILABLE:
        assert snapshot["busy_seconds"] > 0.0
    else:  # TensorFlow 2.16: not measured
        assert math.isnan(snapshot["busy_seconds"])
    assert staged.close()


def test_a_stage_with_nothing_to_compute_has_no_busy_time(determinism):
    staged = stage(tf.data.Dataset.range(5), capacity=2, name="copy")
    assert [int(x) for x in staged] == [0, 1, 2, 3, 4]
    snapshot = staged.stats.snapshot()
    assert snapshot["busy_seconds"] == 0.0
    assert math.isfinite(snapshot["wait_seconds"])
    assert staged.close()


def test_deterministic_stage_gives_what_the_plain_dataset_gives(determinism):
    def noisy(x):
        noise = tf.random.stateless_uniform((3,), seed=tf.stack([x, 7]))
        return tf.cast(x, tf.float32) + noise

    source = tf.data.Dataset.range(20)
    staged = stage(source, noisy, capacity=4, num_threads=4, name="noisy")
    expected = np.stack([noisy(x).numpy() for x in source])
    np.testing.assert_array_equal(
        np.stack([x.numpy() for x in staged]), expected
    )
    assert staged.close()


def test_the_timeout_still_fires_on_a_stalled_source(determinism):
    release = threading.Event()

    def generate():
        for i in range(5):
            if i == 2:
                release.wait(30)
            yield i

    source = tf.data.Dataset.from_generator(
        generate, output_signature=tf.TensorSpec((), tf.int64)
    )
    try:
        staged = stage(
            source, capacity=1, num_threads=1, timeout=1.0, name="stalls"
        )
        iterator = iter(staged)
        assert [int(next(iterator)) for _ in range(2)] == [0, 1]
        started = time.monotonic()
        with pytest.raises(StageTimeoutError, match="Stage 'stalls' timed out"):
            next(iterator)
        waited = time.monotonic() - started
    finally:
        release.set()
    assert 0.9 <= waited < 10
    # The helper thread left blocked on the source ends once released.
    deadline = time.monotonic() + 10.0
    while not staged.close(timeout=1.0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert staged.close()


def test_a_slow_step_after_its_fetch_never_times_out(determinism):
    # Only the wait for input counts; without a clock the runner learns
    # that the fetch is over from the consumed count.
    options = StageOptions(name="slow_step", timeout=0.3)
    stats = StageStats(options.name)
    runner = StageRunner(options, stats)

    @tf.function
    def record(element):
        return stats.record_fetch(element, accumulate=True)[2]

    # Traced first: a trace slower than the timeout on a loaded machine
    # would be a wait before the fetch, which this test is not about.
    record.get_concrete_function(tf.constant(1.0))

    def step():
        record(tf.constant(1.0))
        time.sleep(1.2)  # the training step, well past the timeout
        return "trained"

    try:
        assert runner.call(step, elements=1) == "trained"
    finally:
        assert runner.close()


def test_a_stage_built_before_determinism_says_to_build_it_again():
    staged = stage(_lines(), _parse, capacity=2, num_threads=1, name="early")
    with op_determinism():
        with pytest.raises(
            tf.errors.FailedPreconditionError,
            match=(
                r"\[keras_stage\] raised inside stage 'early': its counters "
                r"were traced with a clock before op determinism was "
                r"enabled.*build the stage, and any step recording it, "
                r"again after tf\.config\.experimental\."
                r"enable_op_determinism\(\)"
            ),
        ) as info:
            next(iter(staged))
        assert "ignored_exception_types" not in info.value.message
        again = stage(_lines(), _parse, capacity=2, num_threads=1)
        assert len(list(again)) == 6
    assert staged.close() and again.close()


# The stateful ops tf.data's `make_deterministic` rewrite lets a pipeline
# hold and still run in parallel and buffered under op determinism
# (tensorflow/core/grappler/optimizers/data/make_deterministic.cc: dataset
# sources, legacy random ops, Print and Assert); function calls and
# control flow are judged by what they call.
_ALLOWED_STATEFUL = {
    "TensorSliceDataset",
    "RangeDataset",
    "TextLineDataset",
    "TFRecordDataset",
    "FixedLengthRecordDataset",
    "Print",
    "PrintV2",
    "Assert",
    "StatefulPartitionedCall",
    "_Arg",
    "_Retval",
    "If",
    "StatelessIf",
    "While",
    "StatelessWhile",
}


def _stateful_ops(dataset):
    """The stateful ops in `dataset`'s graph outside the allow-list."""
    from tensorflow.core.framework import graph_pb2
    from tensorflow.python.framework import op_def_registry

    graph = graph_pb2.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())
    nodes = list(graph.node)
    for function in graph.library.function:
        nodes.extend(function.node_def)
    found = set()
    for node in nodes:
        op_def = op_def_registry.get(node.op)
        if op_def is None or not op_def.is_stateful:
            continue
        if node.op.endswith("Dataset") or node.op.endswith("DatasetV2"):
            continue  # dataset ops are judged by their functions
        if node.op not in _ALLOWED_STATEFUL:
            found.add(node.op)
    return found


@pytest.mark.parametrize("fn", [None, _parse])
def test_a_stage_built_under_determinism_stays_parallel_and_buffered(
    determinism, fn
):
    # tf.data turns every parallel map of a pipeline sequential, and
    # empties every buffer, once any function of it holds another stateful
    # op (a counter's variable update): the stage's pipeline holds none.
    staged = stage(_lines(), fn, capacity=2, num_threads=2, name="bare")
    for pipeline in (staged, staged.pipeline, staged.lean_pipeline):
        assert _stateful_ops(pipeline) == set()
    # What it delivers is still counted (on the host, as it is fetched),
    # and its buffer's fill read from tf.data's model of its iterator.
    assert len(list(staged)) == 6
    snapshot = staged.stats.snapshot()
    assert snapshot["consumed"] == snapshot["produced"] == 6
    if not pipeline_model.AVAILABLE:  # TensorFlow 2.16: not measured
        assert math.isnan(snapshot["buffered_sum"])
        assert staged.close()
        return
    assert 0 <= snapshot["buffered_sum"] <= 6 * 2
    # tf.data's own view of the pipeline it runs: the buffer holds 2, the
    # map runs 2 elements at once.
    iterator = iter(staged.lean_pipeline)
    next(iterator)
    model = pipeline_model.read_model(iterator)
    buffer, stage_map = pipeline_model.stage_nodes(model, 0)
    assert {p.name: p.value for p in buffer.parameters} == {"buffer_size": 2}
    if fn is not None:
        assert stage_map.name == "ParallelMapV2"
        assert {p.name: p.value for p in stage_map.parameters} == {
            "parallelism": 2
        }
    del iterator
    assert staged.close()


def test_without_determinism_the_counters_are_in_the_pipeline():
    # The check above would catch them: they are there without it.
    staged = stage(_lines(), _parse, capacity=2, num_threads=2, name="full")
    assert "AssignAddVariableOp" in _stateful_ops(staged.lean_pipeline)
    assert staged.close()
