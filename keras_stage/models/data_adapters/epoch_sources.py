"""One source for all the epochs of a call, in plain Keras's epoch orders.

A stage that runs across epochs (see `models/iterators/kept_iterators.py`)
reads one dataset spanning every epoch of the call:
`range(epochs).flat_map` of the epoch's source. Plain Keras makes a new
iterator of that source every epoch, and some sources draw differently from
a new iterator than from the next pass of a running one. Measured on Keras
3.15 / TF 2.21 (tests/models/data_adapters/epoch_sources_test.py keeps each
fact checked):

- State kept by a resource outlives iterators: a seeded
  `shuffle(reshuffle_each_iteration=True)` (a global seed is enough) draws
  a new seed from its seed generator at each iterator it makes, nested or
  not. Plain Keras makes two iterators per epoch and reads the first
  (`EpochIterator` makes the next one when an epoch ends and again when
  the next begins); with `steps_per_epoch` it keeps its iterator across
  epochs and makes one per pass. So plain's epoch k reads the (2k-1)-th
  draw, or the k-th with `steps_per_epoch`, as do its validation runs
  (two per run). The long-lived source makes the same iterators: each
  pass opens and drops an unread iterator of the source after the one it
  reads (`_opened`), where plain Keras does.
- State kept by a kernel restarts with each iterator: a stateful random
  op with a fixed seed (`tf.random.shuffle`, `tf.random.uniform` in a map
  under a global seed) draws the same values in every fresh iterator, and
  on in one that runs on. Keras's own shuffling of in-memory arrays is
  such an op (`tf.random.shuffle` of the indices): under a global seed
  plain Keras trains every epoch on the same permutation (and, with
  `shuffle="batch"`, the same order within each batch). Without a seed
  each iterator draws afresh, and so does each pass. A source of arrays
  with a seeded shuffle therefore replays its first pass (`cache`) in
  every later one; other sources with such ops are not run long-lived.
- Python state (generators, `py_function`) and variables read or written
  by the source can change between epochs in ways a pass read ahead
  cannot follow; sources holding them are not run long-lived either.
"""

import re
import weakref

import tensorflow as tf

from keras_stage import _compat
from keras_stage.models.iterators.kept_iterators import _unconverted, one_pass

# A seeded replay keeps one epoch of the arrays in memory (a copy of them,
# in batches); above this it is not worth the memory.
REPLAY_LIMIT_BYTES = 256 * 2**20

# Ops whose effect a pass run ahead of Keras's epoch could change: Python
# calls, and the state of variables and of `tf.random.Generator`s.
_PYTHON_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
_STATE_OPS = frozenset(
    {
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VarHandleOp",
        "VariableV2",
        "Variable",
        "RngSkip",
        "RngReadAndSkip",
    }
)
_STATE_PREFIXES = (
    "Assign",
    "ResourceScatter",
    "ResourceStridedSliceAssign",
    "StatefulUniform",
    "StatefulStandardNormal",
    "StatefulTruncatedNormal",
    "StatefulRandomBinomial",
    "LookupTableInsert",
    "LookupTableRemove",
    "LookupTableImport",
)
# Datasets that hide what they are built on.
_OPAQUE_DATASETS = frozenset({"_VariantDataset"})
# Datasets that draw seeds from a seed generator for each iterator
# (`shuffle`, `shuffle_and_repeat`, `Dataset.random`; `sample_from_datasets`
# is built on the latter).
_DRAWING_DATASETS = re.compile("Shuffle|Random")


class EpochSource:
    """One epoch of a call's data, from its input type's `epoch_source`.

    Args:
        adapter: Keras's data adapter of the call's data.
        dataset: What the stage stages: one epoch as Keras would iterate
            it, or its row-index batches where `gather` is given.
        arrays: `(x, y, sample_weight)` of in-memory arrays, else None.
        gather: The `ArrayBatches` a stage with work of its own gathers
            from in its own map, or None.
        keeps: Whether the model may keep its stage for later calls on the
            same object (a user's `tf.data.Dataset`).
        long_lived: Whether its epochs may run on one iterator.
    """

    def __init__(
        self,
        adapter,
        dataset,
        arrays=None,
        gather=None,
        keeps=False,
        long_lived=True,
    ):
        self.adapter = adapter
        self.dataset = dataset
        self.arrays = arrays
        self.gather = gather
        self.keeps = keeps
        self.long_lived = long_lived


class SourceFacts:
    """What one epoch's source does that a long-lived pass must respect.

    Attributes:
        objects: The ids of the `tf.data.Dataset` objects it is built on
            (itself included): two sources sharing one share its state.
        kernel_seeded: Whether it holds a stateful random op with a fixed
            seed (it draws the same in every fresh iterator).
        iterator_draws: Whether making an iterator of it may change what
            the next iterator reads: it holds a dataset that draws from a
            resource when an iterator starts (a `shuffle` or `random`
            dataset's seed generator), or it cannot be told (`refusal`).
        kinds: The class names of the datasets it is built on.
        runs_functions: Whether any of them runs a traced function of its
            own (a map, a filter, an interleave).
        seeded_draws: Whether a dataset that draws per iterator has a
            fixed seed (its orders follow the iterators made before).
        refusal: Why it cannot run long-lived at all, or None.
        cardinality: Its `cardinality()` as an int once a call asked
            (`datasets.cardinality`), else None.
    """

    def __init__(self):
        self.objects = set()
        # The class names of the datasets it is built on, and whether any
        # of them runs a function of its own (a map, a filter...).
        self.kinds = set()
        self.runs_functions = False
        self.kernel_seeded = False
        self.resource_seeded = False
        self.seeded_draws = False
        self.refusal = None
        self.cardinality = None

    @property
    def iterator_draws(self):
        return self.resource_seeded or self.refusal is not None

    @property
    def free_passes(self):
        """Whether any pass of one iterator stands for a fresh iterator's.

        Every pass reads what plain Keras's fresh iterator reads (nothing
        drawn), or an order nobody can replay (a `shuffle` with no seed,
        neither its own nor the global one), whatever iterators were made
        before: so one iterator can run on across calls and start again
        at any pass (see `long_lived_source(epochs=None)`).
        """
        return (
            self.refusal is None
            and not self.kernel_seeded
            and not self.seeded_draws
        )

    def refuse(self, reason):
        if self.refusal is None:
            self.refusal = reason


def inspect_source(dataset):
    """The `SourceFacts` of `dataset`: its datasets and their functions.

    Kept per dataset object (datasets do not change): a user's dataset
    passed to every call is read once.
    """
    try:
        facts = _inspected.get(dataset)
    except TypeError:  # not weakly referable
        return _inspect(dataset)
    if facts is None:
        facts = _inspected[dataset] = _inspect(dataset)
    return facts


_inspected = weakref.WeakKeyDictionary()


def _inspect(dataset):
    facts = SourceFacts()
    stack = [dataset]
    while stack:
        current = stack.pop()
        if id(current) in facts.objects:
            continue
        facts.objects.add(id(current))
        facts.kinds.add(type(current).__name__)
        if _DRAWING_DATASETS.search(type(current).__name__):
            facts.resource_seeded = True
            if _compat.dataset_seeded(current):
                facts.seeded_draws = True
        if type(current).__name__ in _OPAQUE_DATASETS:
            facts.refuse("it is built on a dataset whose content is hidden")
            continue
        inputs = _compat.dataset_inputs(current)
        functions = _compat.dataset_functions(current)
        if inputs is None or functions is None:
            facts.refuse(
                f"it is built on a {type(current).__name__} that does not "
                "tell what it reads"
            )
            continue
        stack.extend(inputs)
        facts.runs_functions = facts.runs_functions or bool(functions)
        for function in functions:
            _inspect_function(function, facts)
    return facts


def _inspect_function(function, facts):
    """Notes what one traced function of the source does in `facts`."""
    if any(t.dtype == tf.variant for t in function.captured_inputs):
        facts.refuse("a function of it reads a dataset it captured")
    graph_def = function.graph.as_graph_def()
    nodes = list(graph_def.node)
    for nested in graph_def.library.function:
        nodes.extend(nested.node_def)
    for node in nodes:
        op = node.op
        if op in _PYTHON_OPS:
            facts.refuse("it calls Python")
        elif op in _STATE_OPS or op.startswith(_STATE_PREFIXES):
            facts.refuse(f"it reads or changes state ({op})")
        elif any(
            node.attr[key].i != 0
            for key in ("seed", "seed2")
            if key in node.attr
        ):
            facts.kernel_seeded = True


def nbytes(values):
    """Bytes held by nested arrays/tensors, or None if one cannot tell."""
    total = 0
    for leaf in tf.nest.flatten(values):
        if leaf is None:
            continue
        size = getattr(leaf, "nbytes", None)
        if size is None:
            try:
                count = tf.TensorShape(leaf.shape).num_elements()
                size = None if count is None else count * leaf.dtype.size
            except (AttributeError, TypeError, ValueError):
                size = None
        if size is None:
            return None
        total += int(size)
    return total


def long_lived_source(
    dataset, epochs, replay=False, opens=0, start=None, stop=None
):
    """`epochs` passes of `dataset` on one iterator, plain Keras's orders.

    Args:
        dataset: One epoch's source.
        epochs: The passes, or None for as many as are read (a source
            whose passes are free, see `SourceFacts.free_passes`).
        replay: Whether every pass replays the first (a source whose
            kernels draw the same in every fresh iterator, see the module
            docstring); the first is kept in memory.
        opens: Iterators of `dataset` plain Keras makes and does not read
            after each one it reads (0 or 1).
        start: A `tf.Variable` holding the first pass an iterator made from
            now on reads, or None to always start at the first. Read when
            an iterator reaches each pass, so an iterator made after it is
            set starts there (see `LongLivedIterator`).
        stop: With `start`, a `tf.Variable` holding the pass an iterator
            made from now on ends before, or None for `epochs`. Both are
            then read once, when the iterator reads its first element: an
            iterator that ends with its first pass must not open the next
            (a pass of a drawing source takes a draw when it opens) however
            late its threads get there.

    Returns:
        The long-lived dataset, with `dataset`'s options.
    """
    if epochs is None:
        return dataset.repeat().with_options(dataset.options())
    epoch = dataset.cache() if replay else dataset
    epoch = one_pass(epoch, opens)
    passes = tf.data.Dataset.range(epochs)
    if stop is not None:
        passes = tf.data.Dataset.range(1).flat_map(
            _unconverted(
                lambda _: tf.data.Dataset.range(
                    start.read_value(), tf.minimum(stop.read_value(), epochs)
                )
            )
        )
    elif start is not None:
        # A pass before `start` is taken empty: one traced function (the
        # flat_map's), not a filter's too, which a first call pays.
        return passes.flat_map(
            _unconverted(
                lambda k: epoch.take(
                    tf.where(
                        k >= start.read_value(), tf.constant(-1, tf.int64), 0
                    )
                )
            )
        ).with_options(dataset.options())
    return passes.flat_map(_unconverted(lambda _: epoch)).with_options(
        dataset.options()
    )
