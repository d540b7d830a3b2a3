"""SmartStage's planner decides what to stage from a trace, not class names.

Each test builds a small functional model around one rule and asserts the
plan layer by layer: staged and trunk layers in topological order, the
reason for every trunk layer and the tensors crossing the cut.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.layers import StagedInput
from keras_stage.planner import plan_model
from keras_stage.planner.planner import (
    CUT_INFLATION_LIMIT,
    CUT_INFLATION_MIN_BYTES,
)


@keras.saving.register_keras_serializable(package="keras_stage_tests")
class ScaleByVariable(keras.layers.Layer):
    """Multiplies by a raw tf.Variable it captures (DeepRec issue #384)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = tf.Variable(2.0, trainable=False)

    def call(self, x):
        return x * self.scale


class ReadsOtherLayer(keras.layers.Layer):
    """Reads another layer's kernel: state that training changes."""

    def __init__(self, other, **kwargs):
        super().__init__(**kwargs)
        # A closure, so Keras does not track the other layer as ours.
        self._other = lambda: other

    def call(self, x):
        return x * keras.ops.sum(self._other().kernel)


class AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(x))
        return x


class CondOnSeed(keras.layers.Layer):
    """Reads a fixed weight inside a tf.cond (a nested function)."""

    def build(self, input_shape):
        self.threshold = self.add_weight(
            shape=(), initializer="zeros", trainable=False
        )

    def call(self, x):
        # The weight is read inside the branches: the If op gets it.
        return tf.cond(
            tf.reduce_sum(x) > 0,
            lambda: x + self.threshold,
            lambda: x - self.threshold,
        )


class CondAssign(keras.layers.Layer):
    """Assigns a non-trainable weight inside a tf.cond during training."""

    def build(self, input_shape):
        self.count = self.add_weight(
            shape=(), initializer="zeros", trainable=False, name="count"
        )

    def call(self, x, training=None):
        def count(step):
            def branch():
                self.count.assign_add(step)
                return tf.constant(0.0)

            return branch

        if training:
            tf.cond(tf.reduce_sum(x) > 0, count(1.0), count(0.0))
        return x


def _plan(inputs, outputs, staged_input=True):
    model = keras_stage.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    return model.get_stage_plan()


def _dense_model(*middle, staged=True):
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(name="stage")(inputs) if staged else inputs
    for layer in middle:
        x = layer(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    return inputs, outputs


def test_stateless_and_fixed_layers_are_staged():
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(np.random.default_rng(0).normal(size=(32, 4)))
    plan = _plan(
        *_dense_model(
            keras.layers.Rescaling(0.5, name="rescale"),
            norm,
            keras.layers.Activation("tanh", name="act"),
        )
    )
    assert plan.staged_layers == ["stage", "rescale", "norm", "act"]
    assert plan.trunk_layers == ["head"]
    assert plan.reasons == {"head": "has trainable weights"}
    [cut] = plan.boundary
    assert (cut.name, cut.dtype, cut.shape) == ("act", "float32", (None, 4))
    assert cut.bytes_per_example == 16
    assert not plan.automatic


def test_trainable_weights_stop_the_stage_and_downstream_follows():
    plan = _plan(
        *_dense_model(
            keras.layers.Dense(3, name="hidden"),
            keras.layers.Activation("relu", name="relu"),
        )
    )
    assert plan.staged_layers == ["stage"]
    assert plan.trunk_layers == ["hidden", "relu", "head"]
    assert plan.reasons["hidden"] == "has trainable weights"
    assert plan.reasons["relu"] == "depends on trunk layer 'hidden'"


def test_batch_norm_without_weights_updates_moving_statistics():
    # No trainable weights at all: only the trace shows the writes.
    bn = keras.layers.BatchNormalization(center=False, scale=False, name="bn")
    plan = _plan(*_dense_model(bn))
    assert plan.trunk_layers == ["bn", "head"]
    assert plan.reasons["bn"] == (
        "updates moving_mean, moving_variance during training"
    )


def test_frozen_layers_are_staged():
    frozen = keras.layers.Dense(3, name="frozen")
    frozen.trainable = False
    bn = keras.layers.BatchNormalization(name="frozen_bn")
    bn.trainable = False  # inference mode: no moving-statistics updates
    plan = _plan(*_dense_model(frozen, bn))
    assert plan.staged_layers == ["stage", "frozen", "frozen_bn"]
    assert plan.trunk_layers == ["head"]


def test_random_layers_are_staged():
    plan = _plan(
        *_dense_model(
            keras.layers.GaussianNoise(0.1, seed=1, name="noise"),
            keras.layers.Dropout(0.5, seed=2, name="drop"),
        )
    )
    assert plan.staged_layers == ["stage", "noise", "drop"]
    assert plan.trunk_layers == ["head"]


def test_lambda_capturing_a_raw_variable_stays_in_the_trunk():
    plan = _plan(*_dense_model(ScaleByVariable(name="scaled")))
    assert plan.staged_layers == ["stage"]
    assert plan.trunk_layers == ["scaled", "head"]
    assert "tf.Variable" in plan.reasons["scaled"]
    assert "add_weight(trainable=False)" in plan.reasons["scaled"]


def test_reading_a_weight_that_training_changes_stays_in_the_trunk():
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(name="stage")(inputs)
    head = keras.layers.Dense(1, name="head")
    head.build((None, 4))
    y = ReadsOtherLayer(head, name="reader")(x)
    outputs = head(y)
    plan = _plan(inputs, outputs)
    assert plan.trunk_layers == ["reader", "head"]
    assert plan.reasons["reader"] == (
        "reads variable 'kernel' that training changes"
    )


@pytest.mark.parametrize(
    "scaled, bn_reason",
    [
        # No trainable weights: the trace shows BN's writes.
        (False, "updates moving_mean, moving_variance during training"),
        # Trainable scale and offset: BN is not traced, and all its
        # variables count as changed by training.
        (True, "has trainable weights"),
    ],
)
def test_reading_a_moving_statistic_stays_in_the_trunk(scaled, bn_reason):
    # Reads BN's moving_mean, which BN assigns during training.
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(name="stage")(inputs)
    bn = keras.layers.BatchNormalization(center=scaled, scale=scaled, name="bn")
    bn.build((None, 4))

    class ReadsMean(keras.layers.Layer):
        def call(self, x):
            return x - bn.moving_mean

    y = ReadsMean(name="reader")(x)
    outputs = keras.layers.Dense(1, name="head")(bn(y))
    plan = _plan(inputs, outputs)
    assert plan.reasons["reader"] == (
        "reads variable 'moving_mean' that training changes"
    )
    assert plan.reasons["bn"] == bn_reason


class CountsCalls(keras.layers.Dense):
    """A Dense layer that counts its calls."""

    calls = 0

    def call(self, x):
        CountsCalls.calls += 1
        return super().call(x)


def test_the_plan_calls_no_layer_with_trainable_weights():
    # They are trunk whatever a trace would show, and so is what follows
    # them: the plan traces the prefix only (its cost on a first call).
    inputs, outputs = _dense_model(
        keras.layers.Rescaling(0.5, name="rescale"),
        CountsCalls(3, name="hidden"),
        keras.layers.Activation("relu", name="relu"),
    )
    CountsCalls.calls = 0
    plan = _plan(inputs, outputs)
    assert CountsCalls.calls == 0
    assert plan.staged_layers == ["stage", "rescale"]
    assert plan.reasons == {
        "hidden": "has trainable weights",
        "relu": "depends on trunk layer 'hidden'",
        "head": "has trainable weights",
    }
    [cut] = plan.boundary
    assert (cut.name, cut.dtype, cut.shape) == ("rescale", "float32", (None, 4))


def test_variables_inside_nested_functions_are_followed():
    plan = _plan(
        *_dense_model(CondOnSeed(name="cond_read"), CondAssign(name="assign"))
    )
    assert plan.staged_layers == ["stage", "cond_read"]
    assert plan.reasons["assign"] == "updates count during training"


def test_layers_adding_losses_stay_in_the_trunk():
    plan = _plan(
        *_dense_model(
            AddsLoss(name="adds"),
            keras.layers.ActivityRegularization(l1=0.1, name="reg"),
        )
    )
    assert plan.staged_layers == ["stage"]
    assert plan.reasons["adds"] == "adds a loss during training"


def test_nothing_stageable_gives_an_empty_stage():
    plan = _plan(*_dense_model())
    assert plan.staged_layers == ["stage"]
    assert plan.trunk_layers == ["head"]
    [cut] = plan.boundary
    assert cut.name == "stage"


def test_shared_layer_on_both_sides_of_the_cut():
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(name="stage")(inputs)
    shared = keras.layers.Activation("tanh", name="shared")
    a = shared(x)  # staged
    h = keras.layers.Dense(4, name="hidden")(a)
    b = shared(h)  # after a trainable layer: trunk
    outputs = keras.layers.Dense(1, name="head")(b)
    plan = _plan(inputs, outputs)
    assert plan.staged_layers == ["stage", "shared"]
    assert plan.trunk_layers == ["hidden", "shared", "head"]
    assert plan.reasons["shared"] == "depends on trunk layer 'hidden'"
    assert [t.name for t in plan.boundary] == ["shared@0"]


def test_shared_trainable_layer_is_trunk_on_every_call():
    inputs = [keras.Input(shape=(4,), name="a"), keras.Input((4,), name="b")]
    staged = StagedInput(name="stage")(inputs)
    dense = keras.layers.Dense(2, name="shared_dense")
    merged = keras.layers.Concatenate(name="concat")(
        [dense(staged[0]), dense(staged[1])]
    )
    plan = _plan(inputs, merged)
    assert plan.staged_layers == ["stage"]
    assert plan.trunk_layers == ["shared_dense", "concat"]
    assert [t.name for t in plan.boundary] == ["stage[0]", "stage[1]"]


def test_trace_dtypes_not_symbolic_ones():
    # A Lambda returning int64 ids is labelled float32 symbolically.
    inputs = keras.Input(shape=(), dtype="string", name="s")
    x = StagedInput(name="stage")(inputs)
    ids = keras.layers.Lambda(
        lambda s: tf.strings.to_hash_bucket_fast(s, 1 << 40),
        output_shape=(),
        name="ids",
    )(x)
    outputs = keras.layers.Embedding(16, 2, name="emb")(
        keras.layers.Lambda(lambda i: i % 16, output_shape=(), name="mod")(ids)
    )
    plan = _plan(inputs, outputs)
    assert plan.staged_layers == ["stage", "ids", "mod"]
    [cut] = plan.boundary
    assert (cut.dtype, cut.shape, cut.bytes_per_example) == (
        "int64",
        (None,),
        8,
    )


def test_without_staged_input_the_stage_starts_at_the_inputs():
    plan = _plan(
        *_dense_model(keras.layers.Rescaling(2.0, name="rescale"), staged=False)
    )
    assert plan.automatic
    assert plan.staged_layers == ["rescale"]
    assert plan.trunk_layers == ["head"]


def test_summary_prints_every_layer_reason_and_cut():
    inputs, outputs = _dense_model(
        keras.layers.Rescaling(0.5, name="rescale"),
        keras.layers.Dense(3, name="hidden"),
    )
    model = keras_stage.Model(inputs, outputs, name="m")
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    lines = []
    model.stage_summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert 'Stage plan: "m"' in text
    assert "rescale (Rescaling)" in text
    assert "hidden (Dense)" in text and "has trainable weights" in text
    assert "float32" in text and "(None, 4)" in text
    assert "Staged layers: 2  Trunk layers: 2" in text


def test_plan_needs_compile():
    model = keras_stage.Model(*_dense_model())
    with pytest.raises(ValueError, match="call `compile"):
        model.get_stage_plan()


class OneDense(keras_stage.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1, name="dense")

    def call(self, x):
        return self.dense(x)


def test_plan_of_a_subclassed_model_is_the_plan_of_its_call():
    model = OneDense()
    model(np.zeros((1, 4), "float32"))  # tells its input specs
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    plan = model.get_stage_plan()
    assert plan.staged_layers == []
    assert plan.note == ""
    assert plan.reasons == {"dense": "has trainable weights"}
    # The cut is at its input, named by the call's argument.
    assert [b.name for b in plan.boundary] == ["x"]


def test_plan_of_an_unplannable_subclassed_model_explains_itself():
    class Branching(OneDense):
        def call(self, x):
            if keras.ops.sum(x) > 0:  # Python control flow on a value
                return self.dense(x)
            return self.dense(-x)

    model = Branching()
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    # Before its inputs are known it waits for them, and says so.
    assert "has not seen data yet" in model.get_stage_plan().note
    model(np.ones((1, 4), "float32"))
    plan = model.get_stage_plan()
    assert plan.staged_layers == []
    assert "cannot run on symbolic inputs" in plan.note
    assert plan.boundary == []


def _preprocessor():
    inputs = keras.Input(shape=(4,), name="raw")
    x = keras.layers.Rescaling(0.5, name="inner_rescale")(inputs)
    return keras.Model(inputs, x, name="preprocess")


def _tower():
    inputs = keras.Input(shape=(4,), name="features")
    x = keras.layers.Dense(3, name="inner_dense")(inputs)
    return keras.Model(inputs, x, name="tower")


def test_nested_functional_models_are_planned_as_layers():
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(name="stage")(inputs)
    x = _preprocessor()(x)
    x = _tower()(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    plan = _plan(inputs, outputs)
    assert plan.staged_layers == ["stage", "preprocess"]
    assert plan.trunk_layers == ["tower", "head"]
    assert plan.reasons["tower"] == "has trainable weights"


def test_a_model_that_cannot_be_traced_stages_its_data_only():
    class EagerOnly(keras.layers.Layer):
        def call(self, x):
            return x + float(np.asarray(x).sum())  # needs eager tensors

        def compute_output_spec(self, x):
            return keras.KerasTensor(x.shape, x.dtype)

    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(name="stage")(inputs)
    outputs = keras.layers.Dense(1, name="head")(EagerOnly(name="eager")(x))
    model = keras_stage.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    plan = model.get_stage_plan()
    assert plan.staged_layers == []
    assert "could not trace" in plan.note
    assert "eager" in plan.note


def _layers(names):
    # Keras 3 builds masks from ops (not_equal, any) with numbered names.
    return [n for n in names if not n.startswith(("not_equal", "any"))]


def test_masks_cross_the_cut_as_tensors():
    inputs = keras.Input(shape=(5, 2), name="seq")
    x = StagedInput(name="stage")(inputs)
    x = keras.layers.Masking(0.0, name="mask")(x)
    x = keras.layers.Dense(3, name="dense")(x)
    outputs = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    plan = _plan(inputs, outputs)
    assert _layers(plan.staged_layers) == ["stage", "mask"]
    assert plan.trunk_layers == ["dense", "pool"]
    # The mask is an explicit tensor of the graph, handed to the trunk.
    assert [t.dtype for t in plan.boundary] == ["float32", "bool"]


def test_an_output_without_batch_dimension_is_not_put_on_the_cut():
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(name="stage")(inputs)
    total = keras.layers.Lambda(
        lambda t: keras.ops.sum(t), output_shape=(), name="total"
    )(x)
    scaled = keras.layers.Lambda(lambda a: a[0] * a[1], name="scaled")(
        [x, total]
    )
    outputs = keras.layers.Dense(1, name="head")(scaled)
    plan = _plan(inputs, outputs)
    # Both stay in the stage: the scalar never reaches the cut.
    assert plan.staged_layers == ["stage", "total", "scaled"]
    dense = keras.layers.Dense(1, name="head2")
    outputs = keras.layers.Lambda(
        lambda a: a[0] * a[1], output_shape=(1,), name="mul"
    )([dense(x), total])
    plan = _plan(inputs, outputs)
    assert plan.reasons["total"] == (
        "returns a tensor without a batch dimension"
    )


# -- the transfer-aware cut -------------------------------------------------

ONE_HOT_BINS = 100_000
VOCABULARY = list(range(50))
_rng = np.random.default_rng(0)
IDS = _rng.integers(len(VOCABULARY), size=(40, 1)).astype("int64")
TARGETS = _rng.normal(size=(40, 1)).astype("float32")
# Why the trunk gets the one-hot: 8 bytes of ids against 100k float32s.
INFLATES = (
    "staging it would inflate the cut 8 -> 400,000 bytes/example "
    "(transfer-aware cut; smart_stage='longest' stages it)"
)


def _one_hot_model(model_class=keras_stage.Model, staged=True):
    keras.utils.set_random_seed(5)
    inputs = keras.Input(shape=(1,), dtype="int64", name="ids")
    x = inputs
    if staged:
        x = StagedInput(capacity=2, num_threads=2, name="stage")(inputs)
    x = keras.layers.IntegerLookup(vocabulary=VOCABULARY, name="lookup")(x)
    x = keras.layers.CategoryEncoding(
        ONE_HOT_BINS, output_mode="one_hot", name="onehot"
    )(x)
    x = keras.layers.Dense(4, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    return model_class(inputs, outputs)


def _compiled(model, smart_stage):
    model.compile(optimizer="adam", loss="mse", smart_stage=smart_stage)
    return model


def _summary(model, line_length=None):
    """The summary's text with its wrapped lines joined back."""
    lines = []
    model.stage_summary(print_fn=lines.append, line_length=line_length)
    for line in lines:
        assert len(line) <= (line_length or 98) or "━" in line, line
    return " ".join(" ".join(lines).split())


def test_an_inflating_layer_stays_in_the_trunk():
    model = _compiled(_one_hot_model(), smart_stage=True)
    plan = model.get_stage_plan()
    # Two 8-byte cuts tie: the longer prefix wins.
    assert plan.candidate_cuts == [
        ("stage", 8),
        ("lookup", 8),
        ("onehot", 4 * ONE_HOT_BINS),
    ]
    assert plan.staged_layers == ["stage", "lookup"]
    assert plan.trunk_layers == ["onehot", "hidden", "head"]
    assert plan.reasons["onehot"] == INFLATES
    assert plan.reasons["hidden"] == "has trainable weights"
    [cut] = plan.boundary
    assert (cut.name, cut.dtype, cut.shape) == ("lookup", "int64", (None, 1))
    assert plan.cut_reason == (
        "after 'lookup' (transfer-aware): staging the rest would inflate "
        "the cut 8 -> 400,000 bytes/example, more than 4x; "
        "smart_stage='longest' stages it"
    )
    text = _summary(model)
    assert f"Why this cut: {plan.cut_reason}" in text
    assert "8 bytes/example (bytes/batch: 8 x batch size)" in text
    assert "stage 8, lookup 8, onehot 400,000" in text
    # The split runs the one-hot in the train step, on the lookup's ids.
    _, split = plan_model(model, model.get_layer("stage"))
    assert [t.dtype for t in split.prefix.outputs] == ["int64"]
    trunk = [layer.name for layer in split.trunk.layers]
    assert trunk == ["lookup_cut", "onehot", "hidden", "head"]


def test_summary_shows_bytes_per_batch_when_the_batch_is_static():
    inputs = keras.Input(shape=(4,), batch_size=8, name="x")
    x = StagedInput(name="stage")(inputs)
    x = keras.layers.Rescaling(0.5, name="rescale")(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1, name="head")(x))
    model = _compiled(model, smart_stage=True)
    plan = model.get_stage_plan()
    assert (plan.bytes_per_example, plan.bytes_per_batch) == (16, 128)
    text = _summary(model)
    assert "Cut: 1 tensors, 16 bytes/example, 128 bytes/batch" in text
    assert (
        "Why this cut: after 'rescale', the longest prefix: no shorter "
        "prefix's cut is more than 4x smaller, or the cut is at most 1,024 "
        "bytes/example (transfer-aware)"
    ) in text


def test_longest_stages_the_inflating_layer_and_says_what_it_costs():
    model = _compiled(_one_hot_model(), smart_stage="longest")
    plan = model.get_stage_plan()
    assert plan.staged_layers == ["stage", "lookup", "onehot"]
    assert plan.trunk_layers == ["hidden", "head"]
    assert plan.bytes_per_example == 4 * ONE_HOT_BINS
    assert plan.cut_reason == (
        "after 'onehot', the longest prefix (smart_stage='longest'); the "
        "transfer-aware cut after 'lookup' would carry 8 instead of "
        "400,000 bytes/example"
    )
    assert (
        plan.candidate_cuts
        == _compiled(_one_hot_model(), smart_stage=True)
        .get_stage_plan()
        .candidate_cuts
    )
    # smart_stage=False shows what True would stage.
    unstaged = _compiled(_one_hot_model(), smart_stage=False)
    assert unstaged.get_stage_plan().trunk_layers[0] == "onehot"


def test_without_staged_input_the_cut_can_be_the_model_inputs():
    inputs = keras.Input(shape=(1,), dtype="int64", name="ids")
    x = keras.layers.CategoryEncoding(
        ONE_HOT_BINS, output_mode="one_hot", name="onehot"
    )(inputs)
    outputs = keras.layers.Dense(1, name="head")(x)
    plan = _plan(inputs, outputs)
    assert plan.candidate_cuts == [(None, 8), ("onehot", 4 * ONE_HOT_BINS)]
    assert plan.staged_layers == []
    assert plan.reasons["onehot"] == INFLATES
    assert plan.cut_reason.startswith("at the model inputs (transfer-aware)")
    assert [t.name for t in plan.boundary] == ["ids"]


def _repeat_model(copies, width=128):
    inputs = keras.Input(shape=(width,), name="x")
    x = StagedInput(name="stage")(inputs)
    x = keras.layers.Rescaling(0.5, name="rescale")(x)
    x = keras.layers.Concatenate(name="repeat")([x] * copies)
    return inputs, keras.layers.Dense(1, name="head")(x)


def test_growth_up_to_the_limit_keeps_the_longest_prefix():
    # 128 float32 = 512 bytes/example; repeated 4x is 2,048.
    plan = _plan(*_repeat_model(CUT_INFLATION_LIMIT))
    assert plan.staged_layers == ["stage", "rescale", "repeat"]
    assert plan.candidate_cuts[-1] == ("repeat", 512 * CUT_INFLATION_LIMIT)
    assert plan.cut_reason == (
        "after 'repeat', the longest prefix: no shorter prefix's cut is "
        "more than 4x smaller, or the cut is at most 1,024 bytes/example "
        "(transfer-aware)"
    )
    plan = _plan(*_repeat_model(CUT_INFLATION_LIMIT + 1))
    assert plan.staged_layers == ["stage", "rescale"]
    assert plan.reasons["repeat"].startswith(
        "staging it would inflate the cut 512 -> 2,560 bytes/example"
    )


def test_small_cuts_stay_whole_however_much_they_grow():
    # 16 -> 80 bytes/example is 5x, but copying 80 bytes per example costs
    # less than running the layer in the step.
    assert CUT_INFLATION_MIN_BYTES == 1024
    plan = _plan(*_repeat_model(CUT_INFLATION_LIMIT + 1, width=4))
    assert plan.candidate_cuts[-1] == ("repeat", 80)
    assert plan.staged_layers == ["stage", "rescale", "repeat"]


def test_shrinking_layers_keep_the_longest_prefix():
    inputs = keras.Input(shape=(8,), name="x")
    x = StagedInput(name="stage")(inputs)
    x = keras.layers.Rescaling(0.5, name="rescale")(x)  # same size
    x = keras.layers.Lambda(lambda t: t[:, :2], name="first_two")(x)
    x = keras.layers.Activation("tanh", name="act")(x)
    plan = _plan(inputs, keras.layers.Dense(1, name="head")(x))
    assert plan.candidate_cuts == [
        ("stage", 32),
        ("rescale", 32),
        ("first_two", 8),
        ("act", 8),
    ]
    assert plan.staged_layers == ["stage", "rescale", "first_two", "act"]


class PadToMaxId(keras.layers.Layer):
    """Zeros as wide as the largest id: a width known only from the data."""

    def call(self, ids):
        width = tf.cast(tf.reduce_max(ids), tf.int32) + 1
        return tf.zeros(tf.stack([tf.shape(ids)[0], width]))

    def compute_output_spec(self, ids):
        return keras.KerasTensor((ids.shape[0], None), "float32")


class SumTimesWeight(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return keras.ops.sum(x, axis=-1, keepdims=True) * self.w

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 1)


def test_unknown_sizes_never_move_the_cut():
    # Variable-length ids: no earlier cut has a size to compare with.
    inputs = keras.Input(shape=(None,), dtype="int64", name="ids")
    x = StagedInput(name="stage")(inputs)
    x = keras.layers.IntegerLookup(vocabulary=VOCABULARY, name="lookup")(x)
    x = keras.layers.CategoryEncoding(
        ONE_HOT_BINS, output_mode="multi_hot", name="multihot"
    )(x)
    plan = _plan(inputs, keras.layers.Dense(1, name="head")(x))
    assert plan.candidate_cuts == [
        ("stage", None),
        ("lookup", None),
        ("multihot", 4 * ONE_HOT_BINS),
    ]
    assert plan.staged_layers == ["stage", "lookup", "multihot"]
    # A longest cut without static size: never compared.
    inputs = keras.Input(shape=(1,), dtype="int64", name="ids")
    x = StagedInput(name="stage")(inputs)
    x = PadToMaxId(name="pad")(x)
    plan = _plan(inputs, SumTimesWeight(name="head")(x))
    assert plan.candidate_cuts == [("stage", 8), ("pad", None)]
    assert plan.staged_layers == ["stage", "pad"]
    assert plan.cut_reason == (
        "after 'pad', the longest prefix: its size is not static, so the "
        "transfer-aware rule does not apply"
    )


def test_cuts_the_stage_cannot_hand_over_are_not_candidates():
    inputs = keras.Input(shape=(4,), name="x")
    x = StagedInput(name="stage")(inputs)
    total = keras.layers.Lambda(
        lambda t: keras.ops.sum(t), output_shape=(), name="total"
    )(x)
    scaled = keras.layers.Lambda(lambda a: a[0] * a[1], name="scaled")(
        [x, total]
    )
    plan = _plan(inputs, keras.layers.Dense(1, name="head")(scaled))
    # The cut after 'total' would hand the trunk a scalar.
    assert plan.candidate_cuts == [("stage", 16), ("scaled", 16)]


def test_plan_config_round_trips_through_json():
    plan = _compiled(_one_hot_model(), smart_stage=True).get_stage_plan()
    config = json.loads(json.dumps(plan.get_config()))
    assert config["cut_reason"] == plan.cut_reason
    assert config["candidate_cuts"] == [
        ["stage", 8],
        ["lookup", 8],
        ["onehot", 400_000],
    ]
    restored = keras_stage.StagePlan.from_config(config)
    assert restored == plan
    assert restored.candidate_cuts == plan.candidate_cuts
    assert restored.layer_types["onehot"] == "CategoryEncoding"
    assert restored.boundary == plan.boundary
    # Both fields take part in equality.
    assert keras_stage.StagePlan.from_config({**config, "cut_reason": ""}) != (
        plan
    )
    changed = {**config, "candidate_cuts": config["candidate_cuts"][1:]}
    assert keras_stage.StagePlan.from_config(changed) != plan


@pytest.mark.parametrize("value", ["shortest", "Longest", 1, None])
def test_smart_stage_accepts_true_false_and_longest(value):
    model = _one_hot_model()
    with pytest.raises(
        ValueError,
        match=(
            r"Invalid value for argument `smart_stage`. Expected True, False "
            rf'or "longest". Received: smart_stage={value!r}'
        ),
    ):
        model.compile(optimizer="sgd", loss="mse", smart_stage=value)
    with pytest.raises(ValueError, match=r'Expected True or "longest"'):
        plan_model(model, smart_stage=False)


@pytest.mark.timeout(120)
def test_transfer_aware_fit_trains_like_plain_keras():
    staged = _compiled(_one_hot_model(), smart_stage=True)
    plain = _one_hot_model(keras.Model, staged=False)
    plain.set_weights(staged.get_weights())
    plain.compile(optimizer="adam", loss="mse")
    assert staged.get_stage_plan().staged_layers == ["stage", "lookup"]
    histories = []
    for model in (staged, plain):
        # Keras's shuffling draws from the global seed.
        keras.utils.set_random_seed(11)
        histories.append(
            model.fit(
                IDS,
                TARGETS,
                batch_size=8,
                epochs=3,
                shuffle=True,
                validation_data=(IDS[:16], TARGETS[:16]),
                verbose=0,
            ).history
        )
    h_staged, h_plain = histories
    assert "stage_wait_ratio" in h_staged  # the stage really ran
    for key, values in h_plain.items():
        np.testing.assert_allclose(
            h_staged[key], values, rtol=1e-6, atol=1e-6, err_msg=key
        )
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        staged.predict(IDS, verbose=0), plain.predict(IDS, verbose=0)
    )


@pytest.mark.timeout(120)
def test_save_and_load_keep_smart_stage_longest(tmp_path):
    model = _compiled(_one_hot_model(), smart_stage="longest")
    # Trained first: a never-built optimizer does not load back silently.
    model.fit(IDS, TARGETS, batch_size=8, epochs=1, verbose=0)
    assert model.get_compile_config()["smart_stage"] == "longest"
    path = tmp_path / "longest.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.smart_stage == "longest"
    assert loaded.get_stage_plan() == model.get_stage_plan()
    assert "onehot" in loaded.get_stage_plan().staged_layers
    loaded.fit(IDS, TARGETS, batch_size=8, epochs=1, verbose=0)


def test_the_random_layers_numbering_is_saved_with_the_iterator(tmp_path):
    # Staged random layers draw per element number: the number goes on
    # across iterators, and a restored iterator numbers on from its save.
    from keras_stage.models.model_state import state

    model = keras_stage.Model(
        *_dense_model(keras.layers.GaussianNoise(0.1, seed=1, name="noise"))
    )
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    model.get_stage_plan()  # plans the split
    split = state(model).split
    data = split.number(tf.data.Dataset.range(10).map(lambda i: (i, i)))
    assert int(data.cardinality()) == 10  # Keras counts its steps
    # As the stage does: the count's variable is state outside the
    # pipeline, skipped by the iterator's checkpoint.
    options = tf.data.Options()
    options.experimental_external_state_policy = (
        tf.data.experimental.ExternalStatePolicy.IGNORE
    )
    data = data.with_options(options)

    def numbers(iterator, count):
        return [int(next(iterator)[0]) for _ in range(count)]

    assert numbers(iter(data), 10) == list(range(1, 11))
    iterator = iter(data)
    assert numbers(iterator, 3) == [11, 12, 13]  # on across iterators
    path = tf.train.Checkpoint(iterator=iterator).write(str(tmp_path / "ck"))
    numbers(iterator, 4)
    split.ordinal.assign(0)  # a new process's count
    split.unnumbered.assign(True)
    restored = iter(data)
    tf.train.Checkpoint(iterator=restored).read(path).expect_partial()
    assert numbers(restored, 7) == list(range(14, 21))
    assert int(split.ordinal.numpy()) == 20  # carried to the next iterator
    assert not bool(split.unnumbered.numpy())  # cleared by the numbering


def test_planning_a_plain_keras_model_asks_for_its_backend():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    with pytest.raises(ValueError, match="backend=keras_stage.models"):
        plan_model(model)
    from keras_stage.models import backends

    plan, _ = plan_model(model, backend=backends.get())
    assert plan.staged_layers == []
