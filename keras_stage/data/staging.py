"""`stage()`: a bounded, multi-threaded prefetch stage on tf.data.

Small maps around the fetch update the stage's counters; the policies and
the timeout are `runner.py`'s.
"""

import functools
import itertools
import time
import weakref

import tensorflow as tf

from keras_stage import _compat
from keras_stage.data.devices import resolve_device, stream_device
from keras_stage.data.eager_iterated import EagerIterated
from keras_stage.data.failover import ServiceLedger
from keras_stage.data.options import (
    AUTO,
    IDLE_CAPACITY,
    OPTIONS,
    StageOptions,
    document_options,
)
from keras_stage.data.packing import Packer
from keras_stage.data.pipeline_model import SAMPLE_FETCHES
from keras_stage.data.pool import StagePool
from keras_stage.data.runner import EndOfData, SkipElement, StageRunner
from keras_stage.data.service import distribute
from keras_stage.data.stats import StageStats, op_determinism_enabled

_name_counter = itertools.count()
# Live stages, so a test or a callback can check that none left a thread.
_live_stages = weakref.WeakSet()


class Placement:
    """Where a stage's finished elements wait (`device`: None for the host)
    and whether they are packed (`pack`: the `pack_transfer` option; its
    `"auto"` packs only if `unpacks`, the consumer unpacks in its step)."""

    def __init__(self, device=None, pack=False, unpacks=False):
        self.device = device
        self.pack = pack
        self.unpacks = unpacks
        # Set by `packer_for` when the elements are packed.
        self.packer = None
        self.unpacked_spec = None

    @classmethod
    def resolve(cls, options, distributed=False, unpacks=False):
        """The placement of a stage with `options` (on the host when a
        `tf.distribute` strategy copies each replica's elements)."""
        if distributed:
            return cls(None, False, unpacks)
        device = resolve_device(options.device)
        if device is not None and _is_host(device):
            device = None  # "/CPU:0" is where the buffer is anyway
        if options.stream is not None:
            device = stream_device(options.stream, device) or device
        return cls(device, options.pack_transfer, unpacks)

    def packer_for(self, element_spec):
        """The `Packer` for elements of `element_spec`, or None."""
        if self.device is None or self.pack is False:
            return None
        if self.pack == AUTO and not self.unpacks:
            return None
        packer = Packer(element_spec)
        if self.pack == AUTO and not packer.worth_packing:
            return None
        self.packer = packer
        self.unpacked_spec = element_spec
        return packer

    def unpack(self, element):
        """`element` as the stage's consumer expects it, on the device."""
        if self.packer is None:
            return element
        with tf.device(self.device):
            return self.packer.unpack(element)


def _is_host(device):
    spec = tf.DeviceSpec.from_string(device)
    return (
        spec.job in (None, "localhost")
        and spec.device_type == "CPU"
        and spec.device_index in (0, None)
    )


def graph_ready(fn):
    """Whether `fn` skips AutoGraph: a tf.function, or marked graph-ready."""
    return isinstance(fn, tf.types.experimental.PolymorphicFunction) or getattr(
        fn, "keras_stage_graph_ready", False
    )


def on_host(fn):
    """`fn` with its ops pinned to the host CPU, not fighting the training
    step for a GPU (DeepRec's `stage_subgraph_on_cpu`)."""

    def pinned(*args):
        with tf.device("/device:CPU:0"):
            return fn(*args)

    return pinned


def _build_pipeline(
    dataset,
    fn,
    options,
    stats,
    gate,
    placement,
    rebatch=None,
    cardinality=None,
    pool=None,
    pool_size=None,
    measured=True,
    ledger=None,
    reads_in_python=False,
):
    """The stage's pipelines `(lean, measured)`: `lean` runs the staged
    computation and buffers it, `measured` adds the consumer's counters
    around the fetch. `pool_size`: the size to run on, with a `StagePool`;
    the other arguments are `build_stage`'s."""
    name = options.name
    num_threads = (
        tf.data.AUTOTUNE if options.num_threads == AUTO else options.num_threads
    )
    capacity = (
        tf.data.AUTOTUNE if options.capacity == AUTO else options.capacity
    )
    if (
        capacity == tf.data.AUTOTUNE
        and placement.device is None
        and (fn is None or reads_in_python)
    ):
        # The autotuner keeps such a buffer at about one element.
        capacity = IDLE_CAPACITY

    # tf.data passes the items of a `tuple` element as separate arguments.
    unpacked = type(dataset.element_spec) is tuple
    staged_fn = None if fn is None else on_host(fn)

    # Under op determinism a stateful op would serialize the pipeline, so
    # it holds no counter, gate or fetch record (`count_nothing`).
    bare = op_determinism_enabled()

    def produce(*args):
        element = args if unpacked else args[0]
        if bare:
            return element if staged_fn is None else staged_fn(element)
        if staged_fn is None:
            stats.count_produced(None, gate)
            return element
        started = stats.start_busy()
        with tf.control_dependencies([] if started is None else [started]):
            out = staged_fn(element)
        # Count only elements whose computation finished.
        with tf.control_dependencies(tf.nest.flatten(out, True)):
            stats.count_produced(started, gate, ready=not count_after)
        return out

    if fn is None or graph_ready(fn):
        # A user's plain `fn` is converted as `map` would.
        produce = tf.autograph.experimental.do_not_convert(produce)

    if options.service is not None:
        # The workers run the source and `fn`; this process counts arrivals.
        dataset = _served(
            dataset,
            staged_fn,
            unpacked,
            options,
            num_threads,
            rebatch,
            cardinality,
            ledger,
        )
        unpacked = type(dataset.element_spec) is tuple
        staged_fn = fn = None

    # An ordered parallel map finishes elements out of order, so they are
    # also counted ready after it, in delivery order (`count_ready`).
    count_after = fn is not None and options.deterministic and not bare

    def staged(parallel):
        if fn is None:
            if bare:
                return dataset  # nothing to compute, nothing to count
            # Nothing to overlap: the counter runs in the buffer's thread.
            return _compat.inline_map(dataset, produce, f"{name}_map")
        mapped = dataset.map(
            produce,
            num_parallel_calls=parallel,
            deterministic=options.deterministic,
            name=f"{name}_map",
        )
        if not count_after:
            return mapped
        tupled = type(mapped.element_spec) is tuple

        def count_ready(*args):
            stats.count_ready()
            return args if tupled else args[0]

        return _compat.inline_map(mapped, count_ready, f"{name}_ready")

    threads = options.resolved_pool_size()
    if pool is None:
        produced = staged(num_threads)
    else:
        # Autotuned at its largest; else as many at once as it has threads.
        threads = pool_size
        produced = staged(
            tf.data.AUTOTUNE if pool_size == pool.largest else pool_size
        )
    # Packing is a copy, not the stage's work: not on the adaptive pool.
    packer = placement.packer_for(produced.element_spec)
    if bare:
        stats.count_nothing(
            computes=fn is not None, maps_above=int(packer is not None)
        )
    if packer is not None:
        produced = produced.map(
            on_host(packer.pack),
            num_parallel_calls=num_threads,
            deterministic=options.deterministic,
            name=f"{name}_pack",
        )

    opts = tf.data.Options()
    opts.threading.private_threadpool_size = threads
    # An injected prefetch would hide the consumer's wait.
    opts.experimental_optimization.inject_prefetch = False
    # An iterator checkpoint skips the counters and gate (variables).
    opts.experimental_external_state_policy = (
        tf.data.experimental.ExternalStatePolicy.IGNORE
    )
    if options.num_threads == AUTO:
        # The autotuner's model agrees with the threads the pool has.
        opts.autotune.cpu_budget = threads
    produced = produced.with_options(opts)

    def consume(started, element):
        stats.end_wait(started)
        return element

    def measure(buffered):
        # zip pulls the marker first, in the consumer's thread: it times the
        # wait on the buffer.
        markers = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
        markers = _compat.inline_map(
            markers.repeat(), lambda _: stats.begin_wait(), f"{name}_wait"
        )
        return _compat.inline_map(
            tf.data.Dataset.zip((markers, buffered)), consume, f"{name}_fetch"
        )

    device = placement.device
    to_device = tf.data.experimental.prefetch_to_device
    size = None if capacity == tf.data.AUTOTUNE else capacity
    if bare:
        # Each eager iterator is watched instead (`StageStats.watch`).
        if device is None:
            lean = produced.prefetch(capacity, name=f"{name}_buffer")
        else:
            lean = produced.apply(to_device(device, size))
        watched = _Watched(lean, stats)
        return watched, watched
    if device is None:
        lean = produced.prefetch(capacity, name=f"{name}_buffer")
        return lean, measure(lean) if measured else lean
    # The device buffer must end the pipeline: a measured pipeline counts
    # on the host side, one element in flight to the device.
    lean = produced.apply(to_device(device, size))
    if not measured:
        return lean, lean
    host = produced.prefetch(capacity, name=f"{name}_buffer")
    return lean, measure(host).apply(to_device(device, 1))


class _Watched(EagerIterated):
    """A pipeline whose eager iterators its stats watch (op determinism)."""

    def __init__(self, base, stats):
        self._stats = stats
        super().__init__(base)

    def eager_iter(self):
        iterator = iter(self._base)
        self._stats.watch(iterator)
        return iterator


def _stage_pool(fn, options, stats, start=None):
    """The `StagePool` the stage's work runs on, or None for a fixed pool
    (`start`: its first iterator's size; None: its largest)."""
    if fn is None or not options.adaptive_pool:
        return None
    if stats.pool is None:
        stats.pool = StagePool(
            options.name,
            largest=options.resolved_pool_size(),
            smallest=options.smallest_pool_size(),
            most=options.most_pool_size(),
            start=start,
        )
    return stats.pool


def _served(
    dataset,
    staged_fn,
    unpacked,
    options,
    num_threads,
    rebatch,
    cardinality,
    ledger,
):
    """`dataset` and `staged_fn` run by the tf.data service's workers."""
    if staged_fn is not None:
        dataset = dataset.map(
            lambda *args: staged_fn(args if unpacked else args[0]),
            num_parallel_calls=num_threads,
            deterministic=options.deterministic,
            name=f"{options.name}_served_map",
        )
    dataset = ledger.worker_side(dataset)
    dataset = distribute(dataset, options.service, options.processing_mode)
    dataset = ledger.client_side(dataset)
    if rebatch is not None:
        # A partial batch per worker varies the epoch's batch count.
        dataset = dataset.rebatch(rebatch)
    if cardinality is not None:
        assert_cardinality = tf.data.experimental.assert_cardinality
        dataset = dataset.apply(assert_cardinality(cardinality))
    return ledger.delivered(dataset)


class StagedDataset(tf.data.Dataset):
    """A `tf.data.Dataset` produced by `stage()`.

    Iterating it eagerly applies the stage's exception policies and
    timeout; inside a `tf.function` errors surface with their own types.
    """

    def __init__(
        self,
        pipeline,
        options,
        stats,
        lean_pipeline=None,
        gate=None,
        placement=None,
        thread_pool=None,
        service_ledger=None,
    ):
        self._pipeline = pipeline
        self.service_ledger = service_ledger
        self._thread_pool = thread_pool
        self._lean_pipeline = lean_pipeline
        self.placement = Placement() if placement is None else placement
        self.stage_options = options
        self.stats = stats
        self.runner = StageRunner(
            options,
            stats,
            gate=gate,
            # Counted ready in delivery order (`_build_pipeline`).
            counts_in_order=True,
            ledger=service_ledger,
        )
        super().__init__(_compat.dataset_variant(pipeline))
        _live_stages.add(self)
        # A stage iterated without close() still ends its helper thread.
        weakref.finalize(self, self.runner.close, 0)

    @property
    def name(self):
        return self.stage_options.name

    @property
    def pipeline(self):
        """The tf.data pipeline without the Python-side policies, for a
        consumer that applies `runner` itself around its step."""
        return self._pipeline

    @property
    def lean_pipeline(self):
        """The pipeline without the consumer's side of the counters, for a
        consumer recording its fetches in its step (`stats.record_fetch`)."""
        return self._lean_pipeline

    @property
    def thread_pool(self):
        """The stage's resizable `StagePool`, or None if its pool is fixed."""
        return self._thread_pool

    @property
    def element_spec(self):
        return self._pipeline.element_spec

    @property
    def device(self):
        """The device holding the stage's buffer, or None for the host."""
        return self.placement.device

    @property
    def packed(self):
        """Whether elements arrive packed (see `unpack`)."""
        return self.placement.packer is not None

    def unpack(self, element):
        """Restores a packed element's structure, on the buffer's device
        (identity for a stage that does not pack)."""
        return self.placement.unpack(element)

    def _inputs(self):
        return [self._pipeline]

    def __iter__(self):
        if not tf.executing_eagerly():
            return super().__iter__()
        return StageIterator(self)

    def close(self, timeout=5.0):
        """Stops the stage; True if no helper thread is left behind.

        The stage can be iterated again; `runner.close_gate()` ends it.
        """
        return self.runner.close(timeout)


def _timed_fetch(stats, iterator):
    """A fetch that may wait (its element is not known to be buffered)."""
    started = time.perf_counter()
    element = next(iterator)
    stats.record_host_fetch(time.perf_counter() - started)
    return element


class StageIterator:
    """Eager iterator of a `StagedDataset`: its policies, host-timed fetches."""

    def __init__(self, staged):
        self._staged = staged
        self._runner = staged.runner
        # Must not hold the stage: its helper thread would close it.
        self._fetch = functools.partial(_timed_fetch, staged.stats)
        self._iterator = iter(staged.lean_pipeline)
        self._fetches = 0

    def __iter__(self):
        return self

    def __next__(self):
        stats = self._staged.stats
        while True:
            try:
                element = self._runner.call(
                    self._fetch,
                    self._iterator,
                    elements=1,
                    ready_fn=next,
                    host_timed=True,
                )
                self._fetches += 1
                if stats.samples and self._fetches % SAMPLE_FETCHES == 0:
                    stats.sample()  # op determinism: see `count_nothing`
                return element
            except SkipElement:
                continue
            except EndOfData:
                stats.sample()  # the iterator's last figures
                ledger = self._staged.service_ledger
                if ledger is not None:
                    ledger.end_of_data()
                raise StopIteration from None

    @property
    def element_spec(self):
        return self._iterator.element_spec

    def get_next(self):
        return self.__next__()


@document_options
def stage(
    dataset,
    fn=None,
    capacity=AUTO,
    num_threads=AUTO,
    closed_exception_types=(tf.errors.OutOfRangeError,),
    ignored_exception_types=(),
    timeout=300.0,
    thread_pool_size=None,
    deterministic=True,
    name=None,
    device=AUTO,
    stream=None,
    pack_transfer=AUTO,
    service=None,
    processing_mode="distributed_epoch",
    worker_timeout=10.0,
):
    """Runs `fn` over `dataset` ahead of the consumer, in parallel, buffered.

    DeepRec's `tf.staged` on tf.data: `fn` runs on `num_threads` workers of
    a private thread pool, and at most `capacity` finished elements wait
    for the consumer. Keras users get it through `StagedInput`.

    Args:
        dataset: A `tf.data.Dataset`.
        fn: A function of one element (the element's structure, as one
            argument) returning the staged element; `None` stages the
            elements as they are. Defaults to `None`.
        {stage_options}

    Returns:
        A `StagedDataset` (a `tf.data.Dataset`).

    Example:

    >>> import tensorflow as tf
    >>> from keras_stage.data import stage
    >>> lines = tf.data.Dataset.from_tensor_slices(["1,a", "2,b"]).batch(2)
    >>> staged = stage(
    ...     lines,
    ...     lambda x: tf.io.decode_csv(x, [[0], [""]]),
    ...     capacity=2,
    ...     num_threads=2,
    ... )
    >>> [n.numpy().tolist() for n, _ in staged]
    [[1, 2]]
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            "Invalid value for argument `dataset`. Expected a "
            "tf.data.Dataset; wrap arrays with "
            "tf.data.Dataset.from_tensor_slices and generators with "
            f"tf.data.Dataset.from_generator. Received: dataset={dataset!r}"
        )
    if fn is not None and not callable(fn):
        raise TypeError(
            "Invalid value for argument `fn`. Expected a callable of one "
            f"element or None. Received: fn={fn!r}"
        )
    if name is None:
        name = f"stage_{next(_name_counter)}"
    # The stage options by name (`locals()` also holds `dataset` and `fn`).
    given = locals()
    options = StageOptions(**{o.name: given[o.name] for o in OPTIONS})
    return build_stage(dataset, fn, options)


def new_stats(options, name=None):
    """Fresh `StageStats` for a stage with `options`, named `name`."""
    return StageStats(
        options.name if name is None else name,
        track_peak=options.capacity == AUTO,
    )


def build_stage(
    dataset,
    fn,
    options,
    stats=None,
    distributed=False,
    unpacks=False,
    rebatch=None,
    cardinality=None,
    consumer_records=False,
    per_copy=None,
    reads_in_python=False,
    pool_start=None,
):
    """`stage()` with validated `StageOptions` and the `StageStats` to use.

    `consumer_records`: the consumer reads only the lean pipeline. With a
    service: `rebatch` the batch size to re-form, `cardinality` an epoch's
    batches, `per_copy` the examples one pass holds. `reads_in_python`: the
    consumer reads every element eagerly. `pool_start`: an adaptive pool's
    first size.
    """
    if stats is None:
        stats = new_stats(options)
    ledger = None
    if options.service is not None:
        if rebatch is None and per_copy is None:
            size = int(dataset.cardinality())
            per_copy = size if size >= 0 else None
        ledger = ServiceLedger(
            options.name,
            options.processing_mode,
            options.worker_timeout,
            per_copy,
            batched=rebatch is not None,
        )
    # Per pipeline: an ended call's iterator must stop counting.
    with tf.init_scope(), tf.device("/CPU:0"):
        gate = tf.Variable(True, trainable=False, name=f"{options.name}_open")
    placement = Placement.resolve(options, distributed, unpacks)
    pool = _stage_pool(fn, options, stats, pool_start)

    def build(pool_size=None):
        return _build_pipeline(
            dataset,
            fn,
            options,
            stats,
            gate,
            placement,
            rebatch,
            cardinality,
            pool,
            pool_size,
            measured=not consumer_records,
            ledger=ledger,
            reads_in_python=reads_in_python,
        )

    if pool is None:
        lean, measured = build()
    else:
        lean, measured = pool.pipelines(build)
    return StagedDataset(
        measured,
        options,
        stats,
        lean_pipeline=lean,
        gate=gate,
        placement=placement,
        thread_pool=pool,
        service_ledger=ledger,
    )


def live_stages():
    """Stages that have not been garbage-collected (for leak checks)."""
    return list(_live_stages)
