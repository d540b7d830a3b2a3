"""The functional graph of a subclassed model's `call`, for the planner.

A subclass's `call` run on symbolic inputs (`keras.Input`s shaped as its
data) gives a functional graph of the subclass's own layer objects, which
the planner cuts as it cuts a functional model. A `call` that branches on
`training` gives a graph per flag (`SubclassGraphs`); one that cannot run
on symbolic inputs, sets an attribute or makes a layer as it runs is not
planned, nor a class whose step calls a layer itself or whose loss reads
`x` (`Untraceable` says why, by name).

Example:

>>> import keras, keras_stage, numpy as np
>>> from keras_stage.planner import subclass_graph
>>> class Ids(keras_stage.Model):
...     def __init__(self):
...         super().__init__(name="ids")
...         self.lookup = keras.layers.IntegerLookup(
...             vocabulary=[3, 5], name="lookup"
...         )
...         self.out = keras.layers.Dense(1, name="out")
...     def call(self, inputs):
...         return self.out(self.lookup(inputs))
>>> specs = subclass_graph.input_specs(np.zeros((4, 1), "int64"))
>>> graphs = subclass_graph.trace(Ids(), specs)
>>> [layer.name for layer in graphs.graph(True).layers]
['inputs', 'lookup', 'out']
"""

import dis
import inspect
import threading

import keras
import numpy as np
import tensorflow as tf

from keras_stage import _compat
from keras_stage.planner.state_access import all_layers, is_preprocessing_layer


class Untraceable(Exception):
    """A subclass's `call` that cannot be planned; `str()` says why."""


class SubclassGraphs:
    """The functional graphs of a subclass's `call`: one for both training
    flags, or one per flag where the call branches on it or passes it to
    its layers (`branches`)."""

    def __init__(self, graphs):
        self._graphs = graphs

    @property
    def branches(self):
        """Whether the call builds a different graph in training."""
        return len(self._graphs) > 1

    def graph(self, training):
        """The graph of a call with this `training` flag."""
        return self._graphs.get(bool(training), self._graphs.get(None))


def spec_of(value):
    """The `tf.TensorSpec` of a batch `value` (an array or tensor), its
    first dimension unknown; None if it is neither."""
    if isinstance(value, tf.TypeSpec):
        spec = value
    elif tf.is_tensor(value) and hasattr(value, "dtype"):
        spec = tf.TensorSpec(value.shape, tf.as_dtype(value.dtype))
    elif isinstance(value, np.ndarray):
        dtype = tf.string if value.dtype.kind in "OSU" else value.dtype
        spec = tf.TensorSpec(value.shape, dtype)
    else:
        try:  # another backend's array (JAX, torch)
            array = keras.ops.convert_to_numpy(value)
        except Exception:
            return None
        return spec_of(array)
    if not isinstance(spec, tf.TensorSpec) or spec.shape.rank in (None, 0):
        return None
    return tf.TensorSpec([None, *spec.shape[1:]], spec.dtype)


def input_specs(x):
    """The specs of the model inputs in data `x` (arrays, tensors, a dict
    or list of them, or a `tf.data.Dataset` of `(x, y, ...)` or `x`); None
    if they cannot be told without reading it (a generator, a
    `PyDataset`)."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        if isinstance(spec, tuple):
            spec = spec[0]
        x = spec
    if x is None:
        return None
    leaves = keras.tree.flatten(x)
    specs = [spec_of(leaf) for leaf in leaves]
    if not specs or any(s is None for s in specs):
        return None
    return keras.tree.pack_sequence_as(x, specs)


def symbolic_inputs(specs, name=None):
    """`keras.Input`s for `specs`, named by their keys in a dict, else
    `name` (numbered in a list)."""

    def make(spec, name=None):
        return keras.Input(
            shape=tuple(spec.shape[1:]), dtype=spec.dtype.name, name=name
        )

    if isinstance(specs, dict):
        return {
            key: keras.tree.map_structure(make, value)
            if not isinstance(value, tf.TypeSpec)
            else make(value, key)
            for key, value in specs.items()
        }
    if isinstance(specs, tf.TypeSpec):
        return make(specs, name)
    if isinstance(specs, (list, tuple)) and name is not None:
        return type(specs)(
            make(spec, f"{name}_{i}")
            if isinstance(spec, tf.TypeSpec)
            else keras.tree.map_structure(make, spec)
            for i, spec in enumerate(specs)
        )
    return keras.tree.map_structure(make, specs)


def _argument_name(model):
    """The name of the first argument of the subclass's `call`."""
    parameters = list(inspect.signature(model.call).parameters)
    return parameters[0] if parameters else None


def takes_training(model):
    """Whether the subclass's `call` takes a `training` argument."""
    return "training" in inspect.signature(model.call).parameters


def build(model, specs):
    """Builds an unbuilt subclass from its input `specs` as Keras would
    from a batch: `build(input_shape)` (the user's, if defined) after its
    call has built its layers on symbolic inputs."""
    if model.built:
        return
    try:
        _built_around(
            model,
            specs,
            lambda: _called(
                model, symbolic_inputs(specs, _argument_name(model)), None
            ),
        )
    except Untraceable:
        pass  # `trace` says why; Keras builds it from a batch


def _built_around(model, specs, call):
    """Runs `call()` (the model's call), building the model as Keras does:
    the user's `build` first (it makes what the call needs), else after,
    marking it built (its layers are, by the call)."""
    shapes = keras.tree.map_structure(lambda s: tuple(s.shape.as_list()), specs)
    if model.built:
        return call()
    if type(model).build is not keras.Model.build:
        model.build(shapes)
        return call()
    outputs = call()
    model.build(shapes)
    return outputs


class _Tracing(threading.local):
    """Whether a call is being traced (`on`), with which training flag."""

    flag = None
    on = False


_tracing = _Tracing()


def inlines(args):
    """Whether a call on `args` runs inline (`inline_call`): that of a
    keras_stage subclass called inside a traced call, on symbolic inputs.
    Keras's `Layer.__call__` would make the whole sub-model one node."""
    return (
        _tracing.on
        and bool(args)
        and all(
            isinstance(t, keras.KerasTensor)
            for t in keras.tree.flatten(args[0])
        )
    )


def inline_call(model, inputs, **kwargs):
    """`model`'s own call on symbolic `inputs`, its layers nodes of the
    traced graph (a query or candidate tower's lookups can be staged)."""
    if "training" not in kwargs and takes_training(model):
        kwargs["training"] = _tracing.flag
    if kwargs.get("training") is None:
        kwargs.pop("training", None)
    specs = keras.tree.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), inputs
    )
    return _built_around(model, specs, lambda: _own_call(model, inputs, kwargs))


def _own_call(model, inputs, kwargs):
    """The subclass's own call, the attributes it sets listed (`_called`)."""
    outer = model.__dict__.get(SETS_ATTRIBUTE)
    if outer is None:
        object.__setattr__(model, SETS_ATTRIBUTE, [])
    try:
        outputs = type(model).call(model, inputs, **kwargs)
    finally:
        changed = model.__dict__[SETS_ATTRIBUTE]
        if outer is None:
            del model.__dict__[SETS_ATTRIBUTE]
    if changed:
        raise Untraceable(
            f"the call of '{model.name}' sets its attribute '{changed[0]}', "
            "a side effect the stage's ahead-of-time run would not repeat"
        )
    return outputs


def trace(model, specs):
    """The `SubclassGraphs` of subclass `model`'s call on inputs of
    `specs`; raises `Untraceable` saying why there is none (its call, or an
    override of its class, `refuse_overrides`)."""
    refuse_overrides(model)
    build(model, specs)
    flags = (True, False) if takes_training(model) else (None,)
    graphs, layouts = {}, {}
    held = _held(model)
    for flag in flags:
        inputs = symbolic_inputs(specs, _argument_name(model))
        outputs = _called(model, inputs, flag)
        graph = keras.Model(inputs, outputs, name=model.name)
        _check_layers(graph, held)
        graphs[flag], layouts[flag] = graph, _layout(graph, held)
    if (
        len(graphs) == 2
        and layouts[True] == layouts[False]
        and not _passes_training(graphs[True])
    ):
        # Only the flag differs, and the layers read it as they run.
        graphs = {None: graphs[True]}
    return SubclassGraphs(graphs)


def _called(model, inputs, training):
    """The outputs of the subclass's own `call` on symbolic `inputs`, the
    keras_stage sub-models it calls inlined (`inline_call`)."""
    kwargs = {} if training is None else {"training": training}
    _tracing.on, _tracing.flag = True, training
    try:
        outputs = _own_call(model, inputs, kwargs)
    except Untraceable:
        raise
    except Exception as e:
        raise Untraceable(
            f"its call cannot run on symbolic inputs ({type(e).__name__}: "
            f"{_first_line(e)}); a call that branches on tensor values or "
            "converts them to NumPy is not planned"
        ) from e
    finally:
        _tracing.on, _tracing.flag = False, None
    if not all(
        isinstance(t, keras.KerasTensor) for t in keras.tree.flatten(outputs)
    ):
        raise Untraceable(
            "its call returns values that are not tensors of its inputs"
        )
    return outputs


# The attribute listing what a traced call sets (see `_called`).
SETS_ATTRIBUTE = "_keras_stage_sets"


def _check_layers(graph, held):
    """Raises `Untraceable` if the call used a layer with state that the
    model does not hold (`held`: made in `call`, a new one at every call)."""
    for node in _compat.functional_nodes(graph):
        layer = node.operation
        if (
            isinstance(layer, keras.layers.Layer)
            and id(layer) not in held
            # A merge or reshaping layer (`keras.layers.concatenate`) holds
            # nothing: a new one at every call computes the same.
            and (layer.weights or is_preprocessing_layer(layer))
        ):
            raise Untraceable(
                f"its call makes layer '{layer.name}' as it runs; make it "
                "in __init__ to let the call be planned"
            )


def _held(model):
    """The ids of the layers `model` holds."""
    return {id(layer) for layer in all_layers(model)}


def _layout(graph, held):
    """What a graph computes: its calls, in order, with their inputs
    (`held`: the ids of the model's layers)."""
    ids = {id(t): i for i, t in enumerate(keras.tree.flatten(graph.inputs))}
    layout = []
    for node in _compat.functional_nodes(graph):
        inputs, outputs = _compat.node_inputs(node)
        op = node.operation
        # Keras ops (`keras.ops.cast`) and merge layers made in the call
        # are new objects at every call.
        key = id(op) if id(op) in held else type(op)
        layout.append((key, tuple(ids.get(id(t)) for t in inputs)))
        for t in outputs:
            ids[id(t)] = len(ids)
    outputs = keras.tree.flatten(graph.outputs)
    return layout, tuple(ids.get(id(t)) for t in outputs)


# Steps and loss methods a subclass may override: planned when they reach
# the model's layers through `self(...)` only (the stage runs the prefix).
_STEPS = ("train_step", "test_step", "predict_step")
_LOSSES = ("compute_loss", "compute_metrics")


def refuse_overrides(model):
    """Raises `Untraceable` naming an override of the model's
    class that cannot run on the trunk: a step calling one of its layers
    directly (not through `self(...)`), or a loss or metrics method that
    reads its `x` (which the stage has replaced with the cut tensors)."""
    held = {
        name
        for name, value in vars(model).items()
        if isinstance(value, keras.layers.Layer)
    }
    for method in _STEPS + _LOSSES:
        fn = _override(type(model), method)
        if fn is None:
            continue
        code = fn.__code__
        if method in _LOSSES:
            if _reads_local(code, "x"):
                raise Untraceable(
                    f"its {method} reads its `x` argument, which in a "
                    "staged step holds the cut tensors, not the raw inputs"
                )
            continue
        called = sorted(held & _attributes_read(code))
        if called:
            raise Untraceable(
                f"its {method} calls layer '{called[0]}' directly, which "
                "may be staged; call the model (`self(x)`) instead"
            )


def _override(cls, method):
    """The function of `method` that `cls` defines below Keras's classes
    (keras_stage's own steps excluded), or None."""
    for klass in cls.__mro__:
        if klass.__module__.startswith(("keras.", "keras_stage.")):
            return None
        fn = vars(klass).get(method)
        if fn is not None:
            return getattr(fn, "__wrapped__", fn)
    return None


def _reads_local(code, name):
    return any(
        i.opname in ("LOAD_FAST", "LOAD_DEREF", "LOAD_FAST_CHECK")
        and i.argval == name
        for i in dis.get_instructions(code)
    )


def _attributes_read(code):
    return {
        i.argval
        for i in dis.get_instructions(code)
        if i.opname in ("LOAD_ATTR", "LOAD_METHOD")
    }


def _passes_training(graph):
    """Whether a call of the graph was given `training=` (which each
    graph keeps as traced: a graph per flag)."""
    return any(
        "training" in _compat.node_call_kwargs(node)
        for node in _compat.functional_nodes(graph)
    )


def _first_line(error):
    text = str(error).strip().splitlines()
    return text[0] if text else ""
