"""`subclass_graph`: a subclass's call as a functional graph of its layers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.planner import subclass_graph


class Out(keras_stage.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.out = keras.layers.Dense(1, name="out")


class Lookup(Out):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lookup = keras.layers.IntegerLookup(
            vocabulary=[1, 2, 3], name="lookup"
        )


class Branches(Lookup):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.extra = keras.layers.Dense(2, name="extra")

    def call(self, inputs, training=False):
        y = self.out(self.lookup(inputs))
        if training:
            return y
        return y, self.extra(y)


def test_input_specs_from_arrays_tensors_and_datasets():
    words = np.array([["a"], ["b"]])
    specs = subclass_graph.input_specs({"w": words, "n": np.zeros((2, 3))})
    assert specs == {
        "w": tf.TensorSpec([None, 1], tf.string),
        "n": tf.TensorSpec([None, 3], tf.float64),
    }
    dataset = tf.data.Dataset.from_tensor_slices(
        (np.zeros((4, 2), "float32"), np.zeros(4))
    ).batch(2)
    assert subclass_graph.input_specs(dataset) == tf.TensorSpec(
        [None, 2], tf.float32
    )
    # A generator cannot tell without being read.
    assert subclass_graph.input_specs(iter([])) is None


def test_symbolic_inputs_are_named_by_keys_or_the_argument():
    specs = {"a": tf.TensorSpec([None, 2], tf.int64)}
    assert subclass_graph.symbolic_inputs(specs)["a"].name == "a"
    spec = tf.TensorSpec([None], tf.string)
    assert subclass_graph.symbolic_inputs(spec, "x").name == "x"
    pair = subclass_graph.symbolic_inputs([spec, spec], "x")
    assert [t.name for t in pair] == ["x_0", "x_1"]


def test_a_call_branching_on_training_has_a_graph_per_flag():
    model = Branches(name="branches")
    graphs = subclass_graph.trace(model, tf.TensorSpec([None, 1], tf.int64))
    assert graphs.branches
    assert len(graphs.graph(True).outputs) == 1
    assert len(graphs.graph(False).outputs) == 2
    # Built as Keras builds it, the layers the model's own.
    assert model.built
    assert graphs.graph(True).get_layer("out") is model.out


def test_a_call_ignoring_training_has_one_graph():
    class Same(Lookup):
        def call(self, inputs, training=False):
            return self.out(self.lookup(inputs))

    graphs = subclass_graph.trace(
        Same(name="same"), tf.TensorSpec([None, 1], tf.int64)
    )
    assert not graphs.branches
    assert graphs.graph(True) is graphs.graph(False)


@pytest.mark.parametrize(
    ("call", "why"),
    [
        (
            lambda self, x: self.out(x) if float(keras.ops.sum(x)) else x,
            "cannot run on symbolic inputs",
        ),
        (
            lambda self, x: setattr(self, "seen", 1) or self.out(x),
            "sets its attribute 'seen'",
        ),
        (
            lambda self, x: self.out(keras.layers.Dense(1, name="fresh")(x)),
            "makes layer 'fresh'",
        ),
    ],
    ids=["value_branch", "side_effect", "new_layer"],
)
def test_untraceable_calls_say_why(call, why):
    cls = type("Bad", (Out,), {"call": call})
    with pytest.raises(subclass_graph.Untraceable, match=why):
        subclass_graph.trace(
            cls(name="bad"), tf.TensorSpec([None, 1], tf.float32)
        )
