"""One source for all the epochs of a call, in plain Keras's epoch orders.

A stage that runs across epochs reads one dataset spanning them all:
`range(epochs).flat_map` of the epoch's source. Plain Keras makes a new
iterator of that source every epoch, and some sources draw differently from
a new iterator than from the next pass of a running one
(tests/models/data_adapters/epoch_sources_test.py checks each case):

- A seeded `shuffle(reshuffle_each_iteration=True)` draws a new seed from
  its seed generator at each iterator it makes. Plain Keras makes two
  iterators per epoch and reads the first (one per pass with
  `steps_per_epoch`): each long-lived pass makes the same unread iterator
  after the one it reads (`one_pass`).
- A stateful random op with a fixed seed (Keras's `tf.random.shuffle` of
  array indices under a global seed) draws the same values in every fresh
  iterator: a source of arrays then replays its first pass (`cache`);
  other sources with such ops are not run long-lived.
- Python state and variables can change between epochs in ways a pass read
  ahead cannot follow: sources holding them are not run long-lived.
"""

import re
import weakref

import tensorflow as tf

from keras_stage import _compat
from keras_stage.models.iterators.kept_iterators import _unconverted, one_pass

# The most bytes of arrays a seeded replay keeps in memory (one epoch).
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
# Datasets that draw seeds from a seed generator for each iterator.
_DRAWING_DATASETS = re.compile("Shuffle|Random")


class EpochSource:
    """One epoch of a call's data, from its input type's `epoch_source`.

    Args:
        dataset: One epoch as Keras would iterate it, or its row-index
            batches where `gather` (an `ArrayBatches`) is given.
        arrays: `(x, y, sample_weight)` of in-memory arrays, else None.
        keeps: Whether the model may keep its stage for later calls.
        long_lived: Whether its epochs may run on one iterator.
    """

    def __init__(
        self, dataset, arrays=None, gather=None, keeps=False, long_lived=True
    ):
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
            the next iterator reads (a dataset drawing from a seed
            generator), or it cannot be told (`refusal`).
        kinds: The class names of the datasets it is built on.
        runs_functions: Whether any of them runs a traced function.
        seeded_draws: Whether a dataset that draws per iterator has a
            fixed seed (its orders follow the iterators made before).
        refusal: Why it cannot run long-lived at all, or None.
        cardinality: Its `cardinality()` once a call asked, else None.
    """

    def __init__(self):
        self.objects = set()
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
        """Whether any pass of one iterator stands for a fresh iterator's:
        nothing drawn, or an order nobody can replay (an unseeded shuffle)."""
        return (
            self.refusal is None
            and not self.kernel_seeded
            and not self.seeded_draws
        )

    def refuse(self, reason):
        if self.refusal is None:
            self.refusal = reason


def inspect_source(dataset):
    """The `SourceFacts` of `dataset`, kept per dataset object."""
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
        replay: Whether every pass replays the first, kept in memory (a
            source whose kernels draw the same in every fresh iterator).
        opens: Iterators of `dataset` plain Keras makes and does not read
            after each one it reads (0 or 1).
        start: A `tf.Variable` holding the first pass an iterator made from
            now on reads, or None to always start at the first.
        stop: With `start`, a `tf.Variable` holding the pass an iterator
            made from now on ends before, or None for `epochs`. Both are
            then read once, when the iterator starts: one that ends with its
            first pass must not open the next (which would take a draw).

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
        # A pass before `start` is taken empty (no filter to trace).
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
