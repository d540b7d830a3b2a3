"""SmartStage's planner: finds the longest prefix training does not change.

`plan_model` stages each call whose trace (`state_access.py`) touches no
state training changes and picks a transfer-aware cut; `StageSplit` makes
the prefix (run by the stage) and trunk (run by the step) models.
"""

import functools
import inspect
import re
import time

import keras
import tensorflow as tf

from keras_stage import _compat
from keras_stage.data.tfio_support import explain_tfio_error
from keras_stage.layers.staged_input import StagedInput
from keras_stage.planner import subclass_graph
from keras_stage.planner.stage_plan import BoundaryTensor, StagePlan
from keras_stage.planner.state_access import (
    TraceError,
    all_layers,
    is_preprocessing_layer,
    run_graph,
    seed_states,
    trace_access,
)

# A longest cut this many times a shorter one's bytes per example stages
# less (uint8 pixels rescaled to float32, exactly 4x, stay staged).
CUT_INFLATION_LIMIT = 4
# Nor below this many bytes per example: a small copy beats moving layers.
CUT_INFLATION_MIN_BYTES = 1024


def graph_model(model):
    """The functional graph of `model`, or None for a subclassed model."""
    if isinstance(model, keras.Sequential):
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            return None
        if not inputs:
            return None
        # A functional view of the same layers and nodes.
        return keras.Model(inputs, outputs, name=model.name)
    if isinstance(model, _compat.keras_functional_class()):
        return model
    return None


def _has_trainable_weights(layer):
    # Keras ops (x[:, 0], x + 1) in a functional graph are not layers.
    return bool(getattr(layer, "trainable_weights", None))


def _own_reason(layer, access, changing, seeds, backend):
    """Why `layer`'s call cannot be staged, from its trace; or None."""
    if _has_trainable_weights(layer):
        return "has trainable weights"
    if access.failure is not None:
        return (
            f"cannot run in tf.data on the {backend.name} "
            "backend (only Keras preprocessing layers and layers of "
            "TensorFlow ops can): its trace failed with "
            f"{type(access.failure.error).__name__}"
        )
    if not backend.native_tf and not _shares_safely(layer):
        return (
            f"holds variables, which the {backend.name} backend "
            "cannot share with tf.data (only Keras preprocessing layers' "
            "fixed state is staged there)"
        )
    writes = [v for v in access.writes if id(v) not in seeds]
    if writes:
        return f"updates {', '.join(v.name for v in writes)} during training"
    if access.table_writes:
        return "updates a lookup table during training"
    changed = [v for v in access.reads if id(v) in changing]
    if changed:
        return f"reads variable '{changed[0].name}' that training changes"
    if access.foreign:
        _, op_type = access.foreign[0]
        return (
            f"uses a tf.Variable that is not a model weight (in a {op_type} "
            "op): training may change it. Make it a weight of the layer "
            "(add_weight(trainable=False)) to let it be staged"
        )
    if access.adds_loss:
        return "adds a loss during training"
    return None


def _shares_safely(layer):
    """Whether a tf.data trace may read a layer's state as constants: true of
    preprocessing layers, which replace it when adapted (`_state_slots`),
    and of a nested model of them (a `FeatureSpace`'s)."""
    if not getattr(layer, "variables", None):
        return True
    if isinstance(layer, _compat.keras_functional_class()):
        return all(_shares_safely(inner) for inner in layer.layers)
    return is_preprocessing_layer(layer)


class _Tensors:
    """Names of the tensors and calls of a functional graph, for the plan."""

    def __init__(self, model, nodes):
        self._names = {}
        self._calls = {}
        for t in model.inputs:
            self._names[id(t)] = t.name
        calls = {}
        for node in nodes:
            layer = node.operation
            calls[id(layer)] = calls.get(id(layer), 0) + 1
        seen = {}
        for node in nodes:
            layer = node.operation
            _, outputs = _compat.node_inputs(node)
            k = seen.get(id(layer), 0)
            seen[id(layer)] = k + 1
            base = layer.name + (f"@{k}" if calls[id(layer)] > 1 else "")
            self._calls[node] = base
            for i, t in enumerate(outputs):
                self._names[id(t)] = base + (
                    f"[{i}]" if len(outputs) > 1 else ""
                )

    def name(self, tensor):
        return self._names.get(id(tensor), tensor.name)

    def call(self, node):
        """The name of a layer call: `layer@k` for a layer called twice."""
        return self._calls[node]


def _kind(spec):
    if isinstance(spec, tf.SparseTensorSpec):
        return "sparse"
    if isinstance(spec, tf.RaggedTensorSpec):
        return "ragged"
    return "dense"


def plan_model(
    model,
    boundary_layer=None,
    smart_stage=True,
    backend=None,
    input_specs=None,
):
    """Plans built `model` from its `StagedInput` `boundary_layer` (None: its
    inputs); returns `(StagePlan, StageSplit or None)`, no split when nothing
    past the boundary can be staged or there is no functional graph.

    `smart_stage`: `True` for the transfer-aware cut (the longest prefix
    unless its cut inflates past `CUT_INFLATION_LIMIT`), `"longest"` for the
    longest prefix always. `backend`: the steps' `Backend`, which says what
    can run in tf.data (default: the model's). `input_specs`: for a
    subclassed model, the `tf.TensorSpec`s of its inputs
    (`subclass_graph.input_specs`): the graph of its call is planned.

    Example:

    >>> import keras, keras_stage
    >>> from keras_stage.planner import plan_model
    >>> inputs = keras.Input(shape=(1,), dtype="int64")
    >>> x = keras_stage.layers.StagedInput(name="stage")(inputs)
    >>> x = keras.layers.IntegerLookup(vocabulary=[3, 5], name="ids")(x)
    >>> x = keras.layers.CategoryEncoding(
    ...     100_000, output_mode="one_hot", name="onehot"
    ... )(x)
    >>> model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    >>> plan, split = plan_model(model, model.get_layer("stage"))
    >>> plan.candidate_cuts
    [('stage', 8), ('ids', 8), ('onehot', 400000)]
    >>> plan.staged_layers
    ['stage', 'ids']
    >>> plan_model(model, smart_stage="longest")[0].staged_layers
    ['stage', 'ids', 'onehot']
    """
    if not (
        smart_stage is True
        or (isinstance(smart_stage, str) and smart_stage == "longest")
    ):
        raise ValueError(
            "Invalid value for argument `smart_stage`. Expected True or "
            f'"longest". Received: smart_stage={smart_stage!r}'
        )
    if backend is None:
        backend = getattr(model, "_stage_backend", None)
    if backend is None:
        raise ValueError(
            f"plan_model: model '{model.name}' is a {type(model).__name__}, "
            "not a keras_stage model, so it does not say which backend runs "
            "its steps. Pass `backend=keras_stage.models.backends.get()`, "
            "or plan a keras_stage.Model."
        )
    graph = graph_model(model)
    if graph is not None:
        return _plan_graph(model, graph, boundary_layer, smart_stage, backend)
    if isinstance(model, keras.Sequential):
        return _unplanned(
            model,
            boundary_layer,
            f"Sequential model '{model.name}' has no inputs yet: add "
            "keras.Input first to let smart_stage look inside it, or the "
            "stage covers the input data only.",
            "inside a model without inputs",
        ), None
    return _plan_subclass(
        model, boundary_layer, smart_stage, backend, input_specs
    )


def _plan_subclass(model, boundary_layer, smart_stage, backend, specs):
    """`plan_model` of a subclassed model, from the graph of its call on
    inputs of `specs` (`subclass_graph`); its input only where none."""
    name = f"Subclassed model '{model.name}'"
    if specs is None:
        plan = _unplanned(
            model,
            boundary_layer,
            f"{name} has not seen data yet: smart_stage plans it from the "
            "specs of the data of its first fit, evaluate or predict (or "
            "of its first call). Until then the stage covers the input "
            "data only.",
            "not planned before the model's inputs are known",
        )
        plan.pending = True
        return plan, None
    try:
        graphs = subclass_graph.trace(model, specs)
    except subclass_graph.Untraceable as e:
        return _unplanned(
            model,
            boundary_layer,
            f"{name} is not planned: {e}. The stage covers the input data "
            "only, and the model trains as it would without smart_stage.",
            "inside a subclassed model that is not planned",
        ), None
    plan, split = _plan_graph(
        model, graphs.graph(True), boundary_layer, smart_stage, backend
    )
    if not graphs.branches:
        return plan, split
    inference, other = _plan_graph(
        model, graphs.graph(False), boundary_layer, smart_stage, backend
    )
    if (plan.staged_layers, _configs(plan.boundary)) != (
        inference.staged_layers,
        _configs(inference.boundary),
    ):
        return _unplanned(
            model,
            boundary_layer,
            f"{name} is not planned: its call stages "
            f"{plan.staged_layers} in training and "
            f"{inference.staged_layers} otherwise (it branches on "
            "`training` before its trunk). The stage covers the input "
            "data only.",
            "inside a subclassed model that is not planned",
        ), None
    if split is not None:
        split.add_inference(other)
    return plan, split


def _configs(boundary):
    return [b.get_config() for b in boundary]


def _plan_graph(model, graph, boundary_layer, smart_stage, backend):
    """`plan_model` of functional `graph` (the model's own, or its call's)."""
    nodes = _compat.functional_nodes(graph)
    # Calls with trainable weights are in the trunk whatever they trace.
    untraced = [n for n in nodes if _has_trainable_weights(n.operation)]
    try:
        # On another backend an untraceable call goes to the trunk.
        accesses, specs = trace_access(
            graph,
            nodes,
            keep_going=not backend.native_tf,
            skip=untraced,
            by_layer=not backend.native_tf,
        )
    except TraceError as e:
        # A tensorflow-io op that cannot load fails every later trace too.
        tfio_message = explain_tfio_error(e.error)
        if tfio_message is not None:
            raise ImportError(
                f"smart_stage could not trace layer '{e.layer_name}' of "
                f"model '{model.name}': {tfio_message}"
            ) from e.error
        return _unplanned(
            model,
            boundary_layer,
            f"smart_stage could not trace model '{model.name}' in a "
            f"tf.function ({e}), so the "
            "stage covers the input data only. Make every layer's call "
            "traceable (no NumPy conversion of its inputs) to plan it.",
            "the model could not be traced",
        ), None
    seeds = {id(s) for s in seed_states(model)}
    changing = {id(v) for v in model.trainable_variables}
    for access in accesses.values():
        changing |= {id(v) for v in access.writes if id(v) not in seeds}
    for node in nodes:
        if node not in accesses:
            # Not traced: any state of its layer may change in training.
            layer = node.operation
            variables = getattr(layer, "variables", None) or []
            changing |= {id(v) for v in variables if id(v) not in seeds}

    # A node whose cut output cannot cross goes to the trunk; plan again.
    held = {}
    assign = functools.partial(
        _assign, graph, nodes, accesses, boundary_layer, changing, seeds
    )
    while True:
        staged_nodes, trunk_nodes, reasons, available = assign(held, backend)
        cut = _cut(graph, trunk_nodes, available)
        blocked = _uncrossable(cut, staged_nodes, accesses, boundary_layer)
        if not blocked:
            break
        held.update(blocked)

    names = _Tensors(graph, nodes)
    candidates, ordered = _candidate_cuts(
        graph, nodes, staged_nodes, accesses, boundary_layer, specs, names
    )
    chosen, cut_reason, moved_reason = _choose_cut(candidates, smart_stage)
    if chosen.count < len(ordered):
        # Every candidate passed `_uncrossable`: this round is the last.
        held.update(dict.fromkeys(ordered[chosen.count :], moved_reason))
        staged_nodes, trunk_nodes, reasons, available = assign(held, backend)
        cut = _cut(graph, trunk_nodes, available)

    plan = StagePlan(
        model.name,
        list(dict.fromkeys(n.operation.name for n in staged_nodes)),
        list(dict.fromkeys(n.operation.name for n in trunk_nodes)),
        reasons,
        [_boundary_tensor(t, specs, names) for t in cut],
        automatic=boundary_layer is None,
        layer_types={
            n.operation.name: type(n.operation).__name__ for n in nodes
        },
        cut_reason=cut_reason,
        candidate_cuts=[(c.label, c.size) for c in candidates],
    )
    real_staged = [n for n in staged_nodes if n.operation is not boundary_layer]
    if not real_staged:
        return plan, None
    staged_seeds = []
    for node in real_staged:
        for v in accesses[node].writes:
            if id(v) in seeds and all(v is not s for s in staged_seeds):
                staged_seeds.append(v)
    split = StageSplit(
        graph, cut, specs, trunk_nodes, plan, staged_seeds, backend
    )
    return plan, split


def _unplanned(model, boundary_layer, note, reason):
    """A plan that stages no layer, with a note saying why."""
    names = [layer.name for layer in model.layers]
    return StagePlan(
        model.name,
        [],
        names,
        dict.fromkeys(names, reason),
        [],
        automatic=boundary_layer is None,
        note=note,
    )


def _assign(
    graph, nodes, accesses, boundary_layer, changing, seeds, held, backend
):
    """Splits `nodes` (producers first) into staged and trunk; `held` maps
    nodes kept in the trunk to the reason. Also returns the reasons and the
    ids of the staged tensors."""
    available = {id(t) for t in graph.inputs}
    producer = {}
    staged_nodes, trunk_nodes = [], []
    reasons = {}
    for node in nodes:
        layer = node.operation
        inputs, outputs = _compat.node_inputs(node)
        access = accesses.get(node)
        if access is None and _has_trainable_weights(layer):
            reason = "has trainable weights"
        elif access is None:
            # Not traced: it needs a trunk call or is not connected.
            reason = "is not connected to the model inputs"
            for t in inputs:
                if id(t) not in available and id(t) in producer:
                    reason = f"depends on trunk layer '{producer[id(t)].name}'"
                    break
        elif layer is boundary_layer:
            reason = None
        elif node in held:
            reason = held[node]
        else:
            reason = _own_reason(layer, access, changing, seeds, backend)
            if reason is None:
                for t in inputs:
                    if id(t) not in available:
                        reason = (
                            f"depends on trunk layer '{producer[id(t)].name}'"
                        )
                        break
        for t in outputs:
            producer[id(t)] = layer
        if reason is None:
            staged_nodes.append(node)
            available |= {id(t) for t in outputs}
        else:
            trunk_nodes.append(node)
            reasons.setdefault(layer.name, reason)
    return staged_nodes, trunk_nodes, reasons, available


def _cut(graph, trunk_nodes, available):
    """Staged tensors the trunk consumes or the model returns, in order."""
    cut, seen = [], set()
    consumed = [t for node in trunk_nodes for t in _compat.node_inputs(node)[0]]
    for t in consumed + list(graph.outputs):
        if id(t) in available and id(t) not in seen:
            cut.append(t)
            seen.add(id(t))
    return cut


def _uncrossable(cut, staged_nodes, accesses, boundary_layer):
    """Staged nodes whose outputs on the cut cannot cross the stage."""
    on_cut = {id(t) for t in cut}
    blocked = {}
    for node in staged_nodes:
        if node.operation is boundary_layer:
            continue
        _, outputs = _compat.node_inputs(node)
        access = accesses[node]
        for t, spec in zip(outputs, access.outputs, strict=True):
            if id(t) in on_cut and spec.shape.rank == 0:
                # The stage hands the trunk batches.
                blocked[node] = "returns a tensor without a batch dimension"
    return blocked


def _boundary_tensor(tensor, specs, names):
    spec = specs[id(tensor)]
    return BoundaryTensor(
        names.name(tensor),
        spec.dtype.name,
        tuple(spec.shape.as_list()),
        _kind(spec),
    )


class _Candidate:
    """A cut after the first `count` staged calls: `label` names the last
    (None: the model inputs), `size` is its bytes per example (or None)."""

    def __init__(self, label, size, count):
        self.label = label
        self.size = size
        self.count = count

    def where(self):
        if self.label is None:
            return "at the model inputs"
        return f"after '{self.label}'"


def _candidate_cuts(
    graph, nodes, staged_nodes, accesses, boundary_layer, specs, names
):
    """The valid cuts after each staged call, shortest prefix first, and the
    staged nodes in the order the prefixes grow (the `StagedInput` first)."""
    base = [n for n in staged_nodes if n.operation is boundary_layer]
    ordered = base + [
        n for n in staged_nodes if n.operation is not boundary_layer
    ]
    candidates = []
    for count in range(len(base), len(ordered) + 1):
        # A prefix of a topological order holds its nodes' staged inputs.
        prefix = set(ordered[:count])
        rest = [n for n in nodes if n not in prefix]
        available = {id(t) for t in graph.inputs}
        for node in ordered[:count]:
            available |= {id(t) for t in _compat.node_inputs(node)[1]}
        cut = _cut(graph, rest, available)
        if _uncrossable(cut, ordered[:count], accesses, boundary_layer):
            continue
        sizes = [
            _boundary_tensor(t, specs, names).bytes_per_example for t in cut
        ]
        size = None if any(s is None for s in sizes) else sum(sizes)
        label = names.call(ordered[count - 1]) if count else None
        candidates.append(_Candidate(label, size, count))
    return candidates, ordered


def _transfer_aware(candidates):
    """The candidate the transfer-aware rule picks; see `plan_model`."""
    longest = candidates[-1]
    known = [c for c in candidates[:-1] if c.size is not None]
    if longest.size is None or not known:
        return longest
    smallest = min(c.size for c in known)
    if (
        longest.size <= CUT_INFLATION_LIMIT * smallest
        or longest.size <= CUT_INFLATION_MIN_BYTES
    ):
        return longest
    # The longest prefix among those with the fewest bytes.
    return [c for c in known if c.size == smallest][-1]


def _choose_cut(candidates, smart_stage):
    """Returns the chosen candidate, why, and why later calls are trunk."""
    longest = candidates[-1]
    smaller = _transfer_aware(candidates)
    at = f"{longest.where()}, the longest prefix"
    if smaller is longest:
        if smart_stage == "longest":
            reason = f"{at} (smart_stage='longest')"
        elif longest.size is None:
            reason = (
                f"{at}: its size is not static, so the transfer-aware rule "
                "does not apply"
            )
        else:
            reason = (
                f"{at}: no shorter prefix's cut is more than "
                f"{CUT_INFLATION_LIMIT}x smaller, or the cut is at most "
                f"{CUT_INFLATION_MIN_BYTES:,} bytes/example (transfer-aware)"
            )
        return longest, reason, None
    if smart_stage == "longest":
        reason = (
            f"{at} (smart_stage='longest'); the transfer-aware cut "
            f"{smaller.where()} would carry {smaller.size:,} instead of "
            f"{longest.size:,} bytes/example"
        )
        return longest, reason, None
    sizes = f"{smaller.size:,} -> {longest.size:,} bytes/example"
    reason = (
        f"{smaller.where()} (transfer-aware): staging the rest would "
        f"inflate the cut {sizes}, more than {CUT_INFLATION_LIMIT}x; "
        "smart_stage='longest' stages it"
    )
    moved = (
        f"staging it would inflate the cut {sizes} (transfer-aware cut; "
        "smart_stage='longest' stages it)"
    )
    return smaller, reason, moved


def _input_name(name, taken):
    base = re.sub(r"\W", "_", name) + "_cut"
    candidate, i = base, 1
    while candidate in taken:
        candidate = f"{base}_{i}"
        i += 1
    taken.add(candidate)
    return candidate


def _state_slots(model):
    """`(layer, attribute, value)` of the tensors and resources a trace
    captures by identity; a re-adapted or loaded layer swaps them."""
    found = []
    for layer in all_layers(model):
        for name, value in vars(layer).items():
            if _is_state(type(value), value):
                found.append((layer, name, value))
    return found


# Per type, whether a trace captures it (`ops.is_tensor` is slow to ask).
_STATE_TYPES = {}


def _is_state(kind, value):
    known = _STATE_TYPES.get(kind)
    if known is None:
        # is_tensor: another backend's (JAX's) arrays, read as constants.
        known = isinstance(
            value, (tf.Tensor, tf.saved_model.experimental.TrackableResource)
        ) or (
            not isinstance(value, keras.Variable) and keras.ops.is_tensor(value)
        )
        _STATE_TYPES[kind] = known
    return known


def _slots_hold(slots):
    """Whether every slot of `_state_slots` still holds the same object."""
    return all(vars(layer).get(name) is value for layer, name, value in slots)


def _takes_training(layer):
    """Whether `layer`'s own call can differ in training (not a mere relay)."""
    passes_on = (_compat.keras_functional_class().call, keras.Sequential.call)
    if isinstance(layer, StagedInput) or type(layer).call in passes_on:
        return False
    return "training" in inspect.signature(layer.call).parameters


class StageSplit:
    """The two runnable halves of a planned model, on the user's own layers:
    `prefix` from the model inputs to the cut tensors (a list), `trunk` from
    them to the outputs (training it trains the model), and `seed_states`,
    the seed-state variables of the staged random layers."""

    def __init__(
        self, graph, cut, specs, trunk_nodes, plan, staged_seeds, backend
    ):
        self.plan = plan
        self.backend = backend
        self.seed_states = list(staged_seeds)
        self.prefix = keras.Model(
            graph.input, list(cut), name=f"{graph.name}_stage"
        )
        self._prefix_nodes = _compat.functional_nodes(self.prefix)
        taken = set()
        values = {}
        trunk_inputs = []
        # Where the backend takes no int64 (JAX without `jax_enable_x64`),
        # the stage casts the cut tensors Keras would truncate every step.
        self._narrow = backend.narrows_int64()
        for t, b in zip(cut, plan.boundary, strict=True):
            spec = specs[id(t)]
            dtype = spec.dtype.name
            if self._narrow and dtype == "int64":
                dtype = "int32"
            new = keras.Input(
                shape=tuple(spec.shape.as_list())[1:],
                dtype=dtype,
                sparse=b.kind == "sparse",
                ragged=b.kind == "ragged",
                name=_input_name(b.name, taken),
            )
            values[id(t)] = new
            trunk_inputs.append(new)
        for node in trunk_nodes:
            inputs, outputs = _compat.node_inputs(node)
            if any(id(t) not in values for t in inputs):
                continue
            for t, v in zip(
                outputs, _compat.call_node(node, values), strict=True
            ):
                values[id(t)] = v
        outputs = keras.tree.pack_sequence_as(
            graph.output, [values[id(t)] for t in graph.outputs]
        )
        self.trunk = keras.Model(
            trunk_inputs, outputs, name=f"{graph.name}_trunk"
        )
        # `_ordinal` counts the elements entering a training stage, so each
        # gets its own seeds; `unnumbered` is set when an iterator is
        # restored (`DataBackup`) and cleared as an element is numbered.
        self._ordinal = self.unnumbered = None
        if self.seed_states:
            self._ordinal = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.unnumbered = tf.Variable(False, trainable=False)
        # Per training flag: (the state objects it was traced with, fn);
        # one for both where the flag changes nothing (`_trace_key`).
        self._stage_fns = {}
        self._training_free = None  # see `_trace_key`
        self.trace_seconds = 0.0
        # A subclass whose call branches on `training`: the split of its
        # inference graph (`add_inference`), the same staged layers.
        self._inference = None

    def add_inference(self, other):
        """Runs `other`, the split of the same model's call in inference
        (same staged layers and cut), for calls with `training` off."""
        self._inference = other
        self._training_free = False

    def trunk_for(self, training):
        """The trunk a step with this `training` flag runs."""
        return self._for(training).trunk

    def _for(self, training):
        """The split of this `training` flag's graph."""
        if not training and self._inference is not None:
            return self._inference
        return self

    @property
    def ordinal(self):
        """The count of elements numbered so far (a `tf.Variable`), or None."""
        return self._ordinal

    def number(self, dataset, writes=True):
        """Tags each element with its ordinal, in data order, if seeds need
        it; `writes` also stores it in `ordinal` (not for an iterator run
        across calls, which sets it itself)."""
        if self._ordinal is None:
            return dataset
        ordinal, unnumbered = self._ordinal, self.unnumbered

        def step(count, element):
            # `scan` passes a tuple element whole; `fn` takes a tuple.
            if not isinstance(element, tuple):
                element = (element,)
            started, last = count
            # The first element reads where earlier iterators stopped.
            n = tf.cond(started, lambda: last, ordinal.read_value) + 1
            if not writes:
                return (True, n), (n, element)
            updates = [ordinal.assign(n), unnumbered.assign(False)]
            with tf.control_dependencies(updates):
                return (True, n), (tf.identity(n), element)

        return dataset.scan((False, tf.constant(0, tf.int64)), step)

    def stage_fn(self, training):
        """The staged computation of an element of a `number`ed dataset: the
        cut tensors replace `x` of Keras's `(x, y, sample_weight)` or a bare
        `x`. Traced again when a staged layer holds new state objects."""
        key = self._trace_key(training)
        cached = self._stage_fns.get(key)
        if cached is not None and _slots_hold(cached[0]):
            return cached[1]
        state = _state_slots(self.prefix)
        element_fn = self._element_fn(training)

        def traced(element):
            started = time.perf_counter()
            try:
                return element_fn(element)
            finally:
                self.trace_seconds += time.perf_counter() - started

        fn = tf.function(traced, autograph=False, reduce_retracing=True)
        self._stage_fns[key] = (state, fn)
        return fn

    def traced(self, training):
        """Whether `stage_fn(training)` has a trace kept from earlier calls."""
        return self._trace_key(training) in self._stage_fns

    def _trace_key(self, training):
        """The `_stage_fns` key: one for both flags if neither matters."""
        if self._training_free is None:
            self._training_free = self._ordinal is None and not any(
                _takes_training(layer) for layer in all_layers(self.prefix)
            )
        return None if self._training_free else bool(training)

    def numbers(self, training):
        """Whether a stage of this `training` flag stages `number`ed data."""
        return self._ordinal is not None and bool(training)

    def _element_fn(self, training):
        numbered = self.numbers(training)

        def fn(element):
            ordinal = None
            if numbered:
                ordinal, element = element
                if len(element) == 1:
                    element = element[0]
            if isinstance(element, (tuple, list)):
                x, rest = element[0], tuple(element[1:])
            else:
                x, rest = element, None
            if numbered:
                with self._seeded(ordinal):
                    cut = self._run_prefix(x, training)
            else:
                cut = self._run_prefix(x, training)
            # Keras returns a one-output model's output bare.
            cut = keras.tree.flatten(cut)
            if self._narrow:
                cut = [
                    tf.cast(t, tf.int32) if t.dtype == tf.int64 else t
                    for t in cut
                ]
            cut = cut[0] if len(cut) == 1 else tuple(cut)
            return (cut,) if rest is None else (cut,) + rest

        return fn

    def _run_prefix(self, x, training):
        """The cut tensors of `x`, in TensorFlow; on another backend call by
        call, as its Keras would convert graph tensors to its own arrays."""
        split = self._for(training)
        if self.backend.native_tf:
            return split.prefix(x, training=training)
        return run_graph(split.prefix, x, training, split._prefix_nodes)

    def _seeded(self, ordinal):
        """A scope giving each staged seed state the element's own seeds, as
        scope updates (`state_mapping` would make graph tensors JAX arrays)."""
        scope = keras.StatelessScope()
        for state in self.seed_states:
            base = tf.cast(state.value, tf.int64)
            folded = tf.random.experimental.stateless_fold_in(base, ordinal)
            scope.add_update((state, tf.cast(folded, state.dtype)))
        return scope
