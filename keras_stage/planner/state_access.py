"""Which state each layer call of a functional model reads and writes.

One training-mode trace of the call nodes maps each captured resource their
ops touch to its Keras variable or table and classifies each use, through
nested functions; anything unclassified is a write. The trace also gives
every tensor's true dtype and shape.
"""

import inspect

import keras
import tensorflow as tf

from keras_stage import _compat
from keras_stage.layers.staged_input import StagedInput

# Ops that only read the resource they are given.
_READ_OPS = frozenset(
    {
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VariableShape",
        "VarIsInitializedOp",
        "LookupTableFindV2",
        "LookupTableSizeV2",
        "LookupTableExportV2",
    }
)
# Ops that pass a resource through unchanged.
_FORWARD_OPS = frozenset({"Identity", "IdentityN"})
# A resource used only by these is a table, not a variable.
_TABLE_OPS = frozenset(
    {
        "LookupTableFindV2",
        "LookupTableSizeV2",
        "LookupTableExportV2",
        "LookupTableInsertV2",
        "LookupTableRemoveV2",
        "LookupTableImportV2",
    }
)
# Ops calling functions: where the function arguments start.
_CALL_OPS = {
    "PartitionedCall": 0,
    "StatefulPartitionedCall": 0,
    "If": 1,
    "StatelessIf": 1,
    "Case": 1,
    "StatelessCase": 1,
    "While": 0,
    "StatelessWhile": 0,
}
_MAX_FUNCTION_DEPTH = 16


class TraceError(Exception):
    """A layer's call failed inside the planner's `tf.function` trace."""

    def __init__(self, layer_name, error):
        lines = str(error).strip().splitlines()
        first = lines[0] if lines else ""
        super().__init__(
            f"layer '{layer_name}' failed: {type(error).__name__}: {first}"
        )
        self.layer_name = layer_name
        self.error = error


class NodeAccess:
    """What one call node touched, found in the trace: the Keras variables it
    `reads` and `writes`, whether it writes a lookup table or `adds_loss`,
    `(kind, op_type)` of each `foreign` resource (not a model variable), its
    `outputs`' TypeSpecs, and the `TraceError` of a failed call."""

    def __init__(self):
        self.reads = []
        self.writes = []
        self.table_writes = False
        self.foreign = []
        self.adds_loss = False
        self.outputs = []
        self.failure = None


def _input_spec(tensor):
    """The TypeSpec of a model input KerasTensor."""
    shape = tuple(tensor.shape)
    if getattr(tensor, "ragged", False):
        return tf.RaggedTensorSpec(shape, tensor.dtype)
    if getattr(tensor, "sparse", False):
        return tf.SparseTensorSpec(shape, tensor.dtype)
    return tf.TensorSpec(shape, tensor.dtype)


def accepts_training(layer):
    """Whether `layer`'s call takes a `training` argument."""
    try:
        parameters = inspect.signature(layer.call).parameters
    except (TypeError, ValueError):
        return False
    return "training" in parameters


def _variable_handles(model):
    """`id(resource handle)` -> Keras variable, seed states included."""
    handles = {}
    for variable in list(model.variables) + seed_states(model):
        value = getattr(variable, "value", None)
        handle = getattr(value, "handle", None)
        if handle is not None:
            handles[id(handle)] = variable
    return handles


def _called_functions(node_def):
    """Names of the functions a call op's NodeDef calls."""
    names = []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names


def _classify_in_function(library, name, arg_index, depth, uses):
    """Adds the uses of argument `arg_index` inside function `name`."""
    fdef = library.get(name)
    if fdef is None or depth > _MAX_FUNCTION_DEPTH:
        uses.add(("write", "call to unknown function"))
        return
    if arg_index >= len(fdef.signature.input_arg):
        return
    refs = {fdef.signature.input_arg[arg_index].name}
    # Nodes are in no particular order: sweep until nothing new is found.
    seen = set()
    changed = True
    while changed:
        changed = False
        for node_def in fdef.node_def:
            if node_def.name in seen:
                continue
            positions = [
                i
                for i, source in enumerate(node_def.input)
                if not source.startswith("^")
                and (source in refs or source.split(":")[0] in refs)
            ]
            if not positions:
                continue
            seen.add(node_def.name)
            changed = True
            op_type = node_def.op
            if op_type in _FORWARD_OPS:
                refs.add(node_def.name)
            elif op_type in _CALL_OPS:
                _classify_call(library, node_def, positions, depth, uses)
            else:
                uses.add(_classify_op(op_type))


def _classify_call(library, node_def, positions, depth, uses):
    """Adds the uses, in the functions a call op calls, of its inputs at
    `positions` (the resource's places among the op's inputs)."""
    offset = _CALL_OPS[node_def.op]
    for function in _called_functions(node_def):
        for position in positions:
            if position >= offset:
                _classify_in_function(
                    library, function, position - offset, depth + 1, uses
                )


def _classify_op(op_type):
    if op_type in _READ_OPS:
        return ("read", op_type)
    # Any other op is a write, to be safe.
    return ("write", op_type)


def _resource_uses(op_consumers, library, tensor, depth=0):
    """{(kind, op_type)} for every use of resource `tensor` in the graph."""
    uses = set()
    for op in op_consumers(tensor):
        if op.type in _FORWARD_OPS:
            for out in op.outputs:
                uses |= _resource_uses(op_consumers, library, out, depth)
        elif op.type in _CALL_OPS:
            positions = [i for i, t in enumerate(op.inputs) if t is tensor]
            _classify_call(library, op.node_def, positions, depth, uses)
        else:
            uses.add(_classify_op(op.type))
    return uses


def trace_access(model, nodes, keep_going=False, skip=(), by_layer=False):
    """Traces call `nodes` of `model` (producers first) in training mode;
    returns `{node: NodeAccess}` of the nodes traced and `{id(KerasTensor):
    tf.TypeSpec}` of the tensors they made. `keep_going`: record a failed
    call in its `NodeAccess` and go on instead of raising `TraceError`;
    `skip`: nodes not to call. Calls needing either's outputs get no access.
    `by_layer`: see `run_node`.
    """
    skip = set(skip)
    model_inputs = list(model.inputs)
    specs = [_input_spec(t) for t in model_inputs]
    accesses = {}
    tensor_specs = {}
    node_ops = {}

    def walk(*flat):
        graph = tf.compat.v1.get_default_graph()
        values = {id(t): v for t, v in zip(model_inputs, flat, strict=True)}
        for t, v in zip(model_inputs, flat, strict=True):
            tensor_specs[id(t)] = tf.type_spec_from_value(v)
        for node in nodes:
            inputs, outputs = _compat.node_inputs(node)
            if node in skip or any(id(t) not in values for t in inputs):
                continue
            first = len(graph.get_operations())
            layer = node.operation
            extra = {}
            if accepts_training(layer):
                extra["training"] = True
            try:
                out = run_node(node, values, by_layer=by_layer, **extra)
            except Exception as e:
                if keep_going:
                    access = NodeAccess()
                    access.failure = TraceError(layer.name, e)
                    accesses[node] = access
                    node_ops[node] = []
                    continue
                # Raised after the trace: AutoGraph would rewrap it.
                failures.append(TraceError(layer.name, e))
                break
            access = NodeAccess()
            access.adds_loss = bool(getattr(layer, "losses", None)) and any(
                getattr(loss, "graph", None) is graph for loss in layer.losses
            )
            for t, v in zip(outputs, out, strict=True):
                values[id(t)] = v
                tensor_specs[id(t)] = tf.type_spec_from_value(v)
                access.outputs.append(tensor_specs[id(t)])
            accesses[node] = access
            node_ops[node] = graph.get_operations()[first:]
        return tf.constant(0)

    failures = []
    # AutoGraph off, as in Keras's own compiled steps.
    traced = tf.function(walk, autograph=False)
    graph = traced.get_concrete_function(*specs).graph
    _clear_trace_losses(nodes)
    if failures:
        raise failures[0]

    handles = _variable_handles(model)
    internal_to_external = {id(i): e for e, i in graph.captures}
    library = {
        f.signature.name: f for f in graph.as_graph_def().library.function
    }
    consumers = {}
    for op in graph.get_operations():
        for t in op.inputs:
            consumers.setdefault(id(t), []).append(op)

    def op_consumers(tensor):
        return consumers.get(id(tensor), [])

    for node, ops in node_ops.items():
        access = accesses[node]
        own = {id(op) for op in ops}
        for external_id, internal in _resources_used(ops, graph):
            external = internal_to_external.get(external_id)
            uses = _resource_uses(
                lambda t, own=own: [o for o in op_consumers(t) if id(o) in own],
                library,
                internal,
            )
            if not uses:
                continue
            variable = handles.get(id(external))
            kinds = {kind for kind, _ in uses}
            if variable is not None:
                # By identity: Keras variables compare by value.
                if "read" in kinds and not _has(access.reads, variable):
                    access.reads.append(variable)
                if "write" in kinds and not _has(access.writes, variable):
                    access.writes.append(variable)
                continue
            op_types = {op_type for _, op_type in uses}
            if op_types <= _TABLE_OPS:
                if "write" in kinds:
                    access.table_writes = True
                continue  # a table only read is fixed during fit
            access.foreign.append(("variable", sorted(op_types)[0]))
    return accesses, tensor_specs


def run_node(node, values, by_layer=False, **kwargs):
    """Calls a node's layer on traced values; a `StagedInput` passes them.

    `by_layer`, off TensorFlow, where Keras's `Layer.__call__` would convert
    graph tensors to the backend's arrays: a nested functional model (a
    `FeatureSpace`'s, say) runs call by call (`run_graph`), and a layer
    other than Keras's preprocessing layers (which switch to TensorFlow ops
    in tf.data themselves) runs its `call` on the graph tensors, so a layer
    of TensorFlow ops traces and one of the backend's ops fails.
    """
    layer = node.operation
    if isinstance(layer, StagedInput):
        inputs, _ = _compat.node_inputs(node)
        return [values[id(t)] for t in inputs]
    if not by_layer or is_preprocessing_layer(layer):
        return _compat.call_node(node, values, **kwargs)
    args, call_kwargs = _compat.node_arguments(node, values)
    if isinstance(layer, _compat.keras_functional_class()):
        return run_graph(layer, args[0], kwargs.get("training"))
    return keras.tree.flatten(layer.call(*args, **call_kwargs, **kwargs))


def run_graph(model, inputs, training, nodes=None):
    """The flat outputs of functional `model` on graph tensors `inputs`,
    its calls run one by one (`run_node(by_layer=True)`); `nodes`: its
    `_compat.functional_nodes`, if known."""
    if isinstance(model.input, dict):
        pairs = [(t, inputs[name]) for name, t in model.input.items()]
    else:
        pairs = zip(
            keras.tree.flatten(model.input),
            keras.tree.flatten(inputs),
            strict=True,
        )
    values = {id(t): _as_input(v, t) for t, v in pairs}
    for node in nodes or _compat.functional_nodes(model):
        extra = {}
        if accepts_training(node.operation):
            extra["training"] = bool(training)
        outputs = run_node(node, values, by_layer=True, **extra)
        for t, v in zip(node.outputs, outputs, strict=True):
            values[id(t)] = v
    return [values[id(t)] for t in model.outputs]


def _as_input(value, tensor):
    """`value` with the dtype and rank of the model input `tensor`, as
    Keras's functional call casts and expands or squeezes its inputs."""
    value = tf.convert_to_tensor(value) if not tf.is_tensor(value) else value
    rank = len(tensor.shape)
    if isinstance(value, tf.Tensor) and value.shape.rank is not None:
        if value.shape.rank == rank - 1 and tensor.shape[-1] == 1:
            value = tf.expand_dims(value, -1)
        elif value.shape.rank == rank + 1 and value.shape[-1] == 1:
            value = tf.squeeze(value, -1)
    dtype = tf.as_dtype(tensor.dtype)
    if value.dtype != dtype and value.dtype != tf.string and dtype != tf.string:
        value = tf.cast(value, dtype)
    return value


def is_preprocessing_layer(layer):
    """Whether `layer` is one of Keras's preprocessing layers: its
    `__call__` runs TensorFlow ops on graph tensors on any backend, and it
    replaces its state when adapted (`_state_slots`)."""
    return type(layer).__module__.startswith("keras.src.layers.preprocessing")


def _has(variables, variable):
    return any(v is variable for v in variables)


def _resources_used(ops, graph):
    """(id of the capture placeholder, placeholder) for resources `ops` use."""
    placeholders = {id(i): i for _, i in graph.captures}
    found = {}
    for op in ops:
        for t in op.inputs:
            if t.dtype == tf.resource and id(t) in placeholders:
                found[id(t)] = t
    return list(found.items())


def _clear_trace_losses(nodes):
    """Drops the trace's graph losses, which must not reach `model.losses`."""
    for node in nodes:
        layer = node.operation
        if isinstance(layer, keras.layers.Layer) and layer.losses:
            _compat.clear_layer_losses(layer)


def seed_states(model):
    """The state variables of the SeedGenerators of `model`'s layers: random
    state, not model state, that random layers assign on every call."""
    states = []
    for layer in all_layers(model):
        for value in vars(layer).values():
            for item in _items(value):
                if isinstance(item, keras.random.SeedGenerator):
                    states.append(item.state)
        states.extend(g.state for g in _compat.backend_seed_generators(layer))
    return states


def all_layers(model):
    """`model`'s layers and, recursively, the layers they hold."""
    layers = []
    stack = list(model.layers)
    seen = set()
    while stack:
        layer = stack.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        layers.append(layer)
        for value in vars(layer).values():
            for item in _items(value):
                if isinstance(item, keras.layers.Layer):
                    stack.append(item)
    return layers


def _items(value):
    """The values an attribute holds: a list's, tuple's or dict's items
    (Keras tracks layers kept in each), else the value itself."""
    if isinstance(value, (list, tuple)):
        return value
    if isinstance(value, dict):
        return list(value.values())
    return [value]
