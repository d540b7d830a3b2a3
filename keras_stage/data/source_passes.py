"""A source's passes on one iterator, drawn as fresh iterators draw them.

`long_lived_source` spans the epochs plain Keras reads from an iterator
each; `SourceFacts` tells where a running iterator's next pass would draw
otherwise (tests/models/data_adapters/epoch_plans_test.py checks each):

- A seeded `shuffle(reshuffle_each_iteration=True)` draws a seed per
  iterator made. Plain Keras makes two per epoch and reads the first (one
  with `steps_per_epoch`): each pass makes the same unread one (`one_pass`).
- A fixed-seed stateful random op (Keras's `tf.random.shuffle` of array
  indices under a global seed) draws the same in every fresh iterator:
  arrays replay their first pass (`replay`); other sources are refused.
- Python calls and state (variables) can change between epochs in ways a
  pass read ahead cannot follow: refused.
"""

import re
import weakref

import tensorflow as tf

from keras_stage import _compat

# The most bytes of arrays a seeded replay keeps in memory (one epoch).
REPLAY_LIMIT_BYTES = 256 * 2**20

# Ops whose effect a pass read ahead could change: Python calls, and the
# state of variables and `tf.random.Generator`s.
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


class SourceFacts:
    """What one epoch's source does that a long-lived pass must respect.

    Attributes:
        objects: The ids of the datasets it is built on, itself included
            (two sources sharing one share its state); `kinds` their class
            names; `runs_functions` whether any runs a traced function.
        kernel_seeded: Whether a stateful random op has a fixed seed.
        resource_seeded: Whether a dataset draws a seed per iterator;
            `seeded_draws` whether from a fixed seed (its orders follow the
            iterators made before).
        refusal: Why it cannot run long-lived at all, or None.
        cardinality: Its `cardinality()` once a caller asked, else None.
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
        """Whether a new iterator may change what the next reads."""
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
    """Notes in `facts` what one traced function of the source does."""
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


def _unconverted(fn):
    """`fn` (no control flow) without AutoGraph's conversion, which costs
    more than its trace and plain Keras never pays."""
    return tf.autograph.experimental.do_not_convert(fn)


def one_pass(dataset, opens=0):
    """One pass of `dataset`, then `opens` (0 or 1) unread iterators of it
    (`choose_from_datasets` with an empty selector makes one, unread)."""
    if not opens:
        return dataset
    unread = tf.data.Dataset.choose_from_datasets(
        [dataset], tf.data.Dataset.range(0)
    )
    return dataset.concatenate(unread)  # it keeps `dataset`'s options


def long_lived_source(
    dataset, epochs, replay=False, opens=0, start=None, stop=None
):
    """`epochs` passes of `dataset` (one epoch) on one iterator, in fresh
    iterators' orders, with `dataset`'s options.

    Args:
        epochs: The passes, or None for as many as are read (a source of
            `SourceFacts.free_passes`).
        replay: Whether every pass replays the first, kept in memory.
        opens: The unread iterators made after each pass (see `one_pass`).
        start: A `tf.Variable`: the first pass an iterator made from now on
            reads, or None for the first.
        stop: With `start`, a `tf.Variable`: the pass such an iterator ends
            before, or None for `epochs`. Both are then read once, as the
            iterator starts: one ending with its first pass must not open
            the next (which would take a draw).
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
