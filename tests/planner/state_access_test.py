"""Tests for keras_stage/planner/state_access.py: the planner's evidence.

`trace_access` traces a functional model's call nodes once, in training
mode, and says which Keras variables each reads and writes, which foreign
resources it touches and whether it adds a loss; `seed_states` and
`all_layers` find the random state and the nested layers. The plans built
on this evidence are tests/planner/planner_test.py's; here the evidence
itself is checked, node by node, on plain `keras.Model`s.
"""

import keras
import pytest
import tensorflow as tf

from keras_stage import _compat
from keras_stage.planner.state_access import (
    NodeAccess,
    TraceError,
    all_layers,
    seed_states,
    trace_access,
)


class _RawVariable(keras.layers.Layer):
    """Reads a `tf.Variable` that is no Keras variable of the model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.raw = tf.Variable(2.0, trainable=False)

    def call(self, x):
        return x * self.raw


class _CountsInACond(keras.layers.Layer):
    """Assigns its weight inside a `tf.cond` branch when training."""

    def build(self, input_shape):
        self.count = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="count"
        )

    def call(self, x, training=None):
        def add():
            self.count.assign_add(1.0)
            return tf.constant(0.0)

        if training:
            tf.cond(tf.reduce_sum(x) > 0, add, lambda: tf.constant(0.0))
        return x


class _AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(x))
        return x


class _FailsInTraining(keras.layers.Layer):
    def call(self, x, training=None):
        if training:
            raise ValueError("no good\nsecond line")
        return x


class _Block(keras.layers.Layer):
    """A layer holding layers: one as an attribute, two in a list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(2, name="inner")
        self.stack = [
            keras.layers.Dropout(0.5, name="block_drop"),
            self.inner,  # held twice, listed once
        ]

    def call(self, x):
        return self.inner(self.stack[0](x))


def _access(*layers, input_shape=(4,), dtype="float32"):
    """`{layer name: NodeAccess}`, the model and its tensor specs."""
    inputs = keras.Input(input_shape, dtype=dtype, name="x")
    x = inputs
    for layer in layers:
        x = layer(x)
    model = keras.Model(inputs, x)
    accesses, specs = trace_access(model, _compat.functional_nodes(model))
    by_name = {node.operation.name: a for node, a in accesses.items()}
    return by_name, model, specs


def _paths(variables):
    return sorted(v.path for v in variables)


def test_a_dense_layer_reads_its_weights_and_writes_nothing():
    access, _, _ = _access(keras.layers.Dense(3, name="dense"))
    dense = access["dense"]
    assert isinstance(dense, NodeAccess)
    assert _paths(dense.reads) == ["dense/bias", "dense/kernel"]
    assert dense.writes == []
    assert dense.foreign == [] and not dense.table_writes
    assert not dense.adds_loss
    assert dense.outputs == [tf.TensorSpec((None, 3), tf.float32)]


def test_batch_norm_in_training_writes_its_moving_statistics():
    access, _, _ = _access(keras.layers.BatchNormalization(name="bn"))
    assert _paths(access["bn"].writes) == [
        "bn/moving_mean",
        "bn/moving_variance",
    ]
    assert "bn/gamma" in _paths(access["bn"].reads)


def test_a_random_layer_writes_its_seed_state():
    drop = keras.layers.Dropout(0.5, name="drop")
    access, model, _ = _access(drop)
    writes = access["drop"].writes
    assert len(writes) == 1 and writes[0] is drop.seed_generator.state
    assert {id(s) for s in seed_states(model)} == {id(writes[0])}


def test_a_write_inside_a_nested_function_is_found():
    access, _, _ = _access(_CountsInACond(name="counter"))
    assert _paths(access["counter"].writes) == ["counter/count"]


def test_a_lookup_table_only_read_is_neither_a_write_nor_foreign():
    lookup = keras.layers.StringLookup(vocabulary=["a", "b"], name="lookup")
    access, _, _ = _access(lookup, input_shape=(), dtype="string")
    assert not access["lookup"].table_writes
    assert access["lookup"].foreign == []
    assert access["lookup"].outputs == [tf.TensorSpec((None,), tf.int64)]


def test_a_raw_variable_is_reported_as_foreign():
    access, _, _ = _access(_RawVariable(name="raw"))
    assert access["raw"].foreign == [("variable", "ReadVariableOp")]
    assert access["raw"].reads == [] and access["raw"].writes == []


def test_a_loss_is_seen_and_cleared_after_the_trace():
    access, model, _ = _access(_AddsLoss(name="loss"))
    assert access["loss"].adds_loss
    assert model.get_layer("loss").losses == []  # the trace's graph is gone
    assert model.losses == []


def test_traced_specs_give_the_true_dtype_of_every_tensor():
    ints = keras.layers.Lambda(lambda t: tf.cast(t > 0, "int64"), name="ints")
    _, model, specs = _access(ints)
    assert model.outputs[0].dtype == "float32"  # what Keras assumes
    assert specs[id(model.outputs[0])] == tf.TensorSpec((None, 4), tf.int64)
    assert specs[id(model.inputs[0])] == tf.TensorSpec((None, 4), tf.float32)


def test_a_failing_layer_raises_a_trace_error_naming_it():
    with pytest.raises(TraceError) as raised:
        _access(keras.layers.Dense(2), _FailsInTraining(name="broken"))
    error = raised.value
    # Only the first line: Keras's own wrapping of the error, here.
    assert str(error).startswith("layer 'broken' failed: ValueError: ")
    assert "\n" not in str(error)
    assert "no good\nsecond line" in str(error.error)
    assert error.layer_name == "broken"
    assert isinstance(error.error, ValueError)


def test_a_trace_error_of_an_empty_message_names_the_type():
    error = TraceError("lay", KeyError())
    assert str(error) == "layer 'lay' failed: KeyError: "


def test_all_layers_finds_nested_layers_once():
    inputs = keras.Input((4,))
    outputs = _Block(name="block")(keras.layers.Dense(4, name="first")(inputs))
    model = keras.Model(inputs, outputs)
    names = [layer.name for layer in all_layers(model)]
    assert sorted(names) == sorted(
        [model.layers[0].name, "first", "block", "inner", "block_drop"]
    )


def test_seed_states_include_nested_random_layers_only():
    inputs = keras.Input((4,))
    x = keras.layers.GaussianNoise(0.1, name="noise")(inputs)
    x = _Block(name="block")(keras.layers.Dense(4)(x))
    model = keras.Model(inputs, x)
    expected = {
        id(model.get_layer("noise").seed_generator.state),
        id(model.get_layer("block").stack[0].seed_generator.state),
    }
    assert {id(s) for s in seed_states(model)} == expected


def test_a_model_without_random_layers_has_no_seed_states():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert seed_states(model) == []
