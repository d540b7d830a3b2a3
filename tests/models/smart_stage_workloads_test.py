"""SmartStage on four realistic workloads (see `workloads.py`).

For each workload the same model is built twice with the same initial
weights, once compiled with `smart_stage=True` and once with
`smart_stage=False` (both keras_stage models with a `StagedInput`), and:

- fitting both the same way gives the same losses, metrics and weights:
  running the preprocessing prefix inside the stage changes where it runs,
  never what the trunk trains on;
- the stage plan stages exactly the preprocessing layers (parsing, hashing,
  lookups, adapted normalization, image decoding/resizing/rescaling) and
  leaves every layer with trainable weights, and all that follows one, in
  the trunk, with the documented reasons;
- predict and evaluate on raw inputs after the staged fit agree with the
  plain model, and so does calling the model itself (it stays whole);
- a `.keras` round trip keeps `smart_stage` and the plan.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from tests.helpers import sweep, twin_optimizer
from tests.models import workloads

BUILD_SEED = 11
FIT_SEED = 7
EPOCHS = 3
RTOL = 1e-5
ATOL = 1e-6
# Epoch logs of the PrefetchCallback: timings, not results.
STAGE_KEYS = ("stage_wait_ratio", "stage_buffer_fill", "stage_skipped")

HAS_WEIGHTS = "has trainable weights"


def _depends_on(name):
    return f"depends on trunk layer '{name}'"


class Workload:
    """A workload's data, model, training setup and expected stage plan.

    `staged` and `trunk` list the expected layers in one topological order;
    the plan may list independent branches in another (the tests check
    the plan's order against the model's graph). `boundary` lists the
    expected `(dtype, shape, bytes_per_example)` of the cut tensors, in any
    order.
    """

    def __init__(
        self,
        make_data,
        build,
        loss,
        metrics,
        batch_size,
        staged,
        trunk,
        reasons,
        boundary,
    ):
        self.make_data = make_data
        self.build = build
        self.loss = loss
        self.metrics = metrics
        self.batch_size = batch_size
        self.staged = staged
        self.trunk = trunk
        self.reasons = reasons
        self.boundary = boundary

    def train_data(self):
        return self.make_data(seed=0)

    def test_data(self):
        # Unseen rows, a partial last batch too.
        x, y = self.make_data(seed=1)
        rows = self.batch_size * 2 + self.batch_size // 3
        return _take(x, rows), y[:rows]


WORKLOADS = {
    "deeprec_csv": Workload(
        make_data=workloads.make_csv_data,
        build=lambda x: workloads.build_csv_model(),
        loss="binary_crossentropy",
        metrics=["binary_accuracy"],
        batch_size=32,  # 200 rows: 6 full batches and one of 8
        staged=["stage", "decode_csv", "hash"],
        trunk=["emb", "emb_flat", "concat", "hidden", "out"],
        reasons={
            "emb": HAS_WEIGHTS,
            "emb_flat": _depends_on("emb"),
            "concat": _depends_on("emb_flat"),
            "hidden": HAS_WEIGHTS,
            "out": HAS_WEIGHTS,
        },
        boundary=[
            ("float32", (None, 2), 8),  # decode_csv's numeric columns
            ("int64", (None, 1), 8),  # hash
        ],
    ),
    "structured_dict": Workload(
        make_data=workloads.make_structured_data,
        build=workloads.build_structured_model,
        loss="binary_crossentropy",
        metrics=["binary_accuracy"],
        batch_size=32,
        staged=[
            "stage",
            "age_norm",
            "income_norm",
            "numeric",
            "city_lookup",
            "zip_lookup",
            "zip_onehot",
        ],
        trunk=["city_emb", "concat", "hidden", "out"],
        reasons={
            "city_emb": HAS_WEIGHTS,
            "concat": _depends_on("city_emb"),
            "hidden": HAS_WEIGHTS,
            "out": HAS_WEIGHTS,
        },
        boundary=[
            ("float32", (None, 2), 8),  # numeric
            ("int64", (None,), 8),  # city_lookup
            ("float32", (None, len(workloads.ZIPS) + 1), 28),  # zip_onehot
        ],
    ),
    "criteo_dlrm": Workload(
        make_data=workloads.make_criteo_data,
        build=lambda x: workloads.build_criteo_model(),
        loss="binary_crossentropy",
        metrics=["binary_accuracy"],
        batch_size=32,
        staged=[
            "stage",
            "criteo_parse",
            "dense_log1p",
            "cat_hash",
            "cat_offset",
        ],
        trunk=[
            "bottom_1",
            "bottom_2",
            "cat_emb",
            "cat_flat",
            "concat",
            "top_1",
            "top_out",
        ],
        reasons={
            "bottom_1": HAS_WEIGHTS,
            "bottom_2": HAS_WEIGHTS,
            "cat_emb": HAS_WEIGHTS,
            "cat_flat": _depends_on("cat_emb"),
            # Both inputs are trunk layers: the reason names the first.
            "concat": _depends_on("bottom_2"),
            "top_1": HAS_WEIGHTS,
            "top_out": HAS_WEIGHTS,
        },
        boundary=[
            ("float32", (None, workloads.CRITEO_DENSE), 4 * 13),  # log1p
            ("int64", (None, workloads.CRITEO_CATS), 8 * 26),  # cat_offset
        ],
    ),
    "png_images": Workload(
        make_data=workloads.make_image_data,
        build=lambda x: workloads.build_image_model(),
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
        batch_size=20,  # 48 images: 2 full batches and one of 8
        staged=["stage", "decode_png", "resize", "rescale"],
        trunk=["conv", "gap", "out"],
        reasons={
            "conv": HAS_WEIGHTS,
            "gap": _depends_on("conv"),
            "out": HAS_WEIGHTS,
        },
        boundary=[
            (
                "float32",
                (None, workloads.IMAGE_SIZE, workloads.IMAGE_SIZE, 3),
                4 * workloads.IMAGE_SIZE * workloads.IMAGE_SIZE * 3,
            ),
        ],
    ),
}
NAMES = sorted(WORKLOADS)
# The workloads trained beside plain Keras in `make test` (each plan is
# checked there); the others' fits in `make test-long`. Dict inputs are in
# `make test` in smart_stage_test too.
TRAINED = sweep(NAMES, kept=("criteo_dlrm", "deeprec_csv"))


def _take(x, rows):
    return keras.tree.map_structure(lambda a: a[:rows], x)


def _as_tensors(x):
    return keras.tree.map_structure(tf.convert_to_tensor, x)


def _build_and_compile(workload, x, smart_stage):
    keras.utils.set_random_seed(BUILD_SEED)
    model = workload.build(x)
    model.compile(
        optimizer=twin_optimizer(),
        loss=workload.loss,
        metrics=workload.metrics,
        smart_stage=smart_stage,
    )
    return model


class Trained:
    """A plain and a SmartStage twin of one workload, both fitted."""

    def __init__(self, name):
        self.workload = WORKLOADS[name]
        self.x, self.y = self.workload.train_data()
        self.plain = _build_and_compile(self.workload, self.x, False)
        self.staged = _build_and_compile(self.workload, self.x, True)
        self.initial_weights = self.plain.get_weights()
        self.staged.set_weights(self.initial_weights)
        self.plain_history = self._fit(self.plain)
        self.staged_history = self._fit(self.staged)

    def _fit(self, model):
        # Keras shuffles with the global seed: the same seed right before
        # each fit gives both models the same batches in the same order.
        keras.utils.set_random_seed(FIT_SEED)
        return model.fit(
            self.x,
            self.y,
            batch_size=self.workload.batch_size,
            epochs=EPOCHS,
            shuffle=True,
            verbose=0,
        ).history


# One fitted pair per workload, shared by the tests of this module: the
# tests after the fit comparison only read the models (predict, evaluate,
# save).
@pytest.fixture(scope="module")
def trained(request):
    return Trained(request.param)


def _results(logs):
    # Every key the stage logs (`stage_unstaged` too, where epochs may run
    # without it).
    return {k: v for k, v in logs.items() if not k.startswith("stage_")}


def _producers(model):
    """Layer name -> names of the layers whose outputs it is called on."""

    def histories(value):
        if isinstance(value, dict):
            if "keras_history" in value:
                yield value["keras_history"][0]
            for item in value.values():
                yield from histories(item)
        elif isinstance(value, list | tuple):
            for item in value:
                yield from histories(item)

    return {
        layer["name"]: set(histories(layer["inbound_nodes"]))
        for layer in model.get_config()["layers"]
    }


def _assert_layers(actual, expected, model, what):
    """`actual` lists exactly `expected`, producers before consumers."""
    assert len(actual) == len(set(actual)), f"{what}: duplicates in {actual}"
    assert sorted(actual) == sorted(expected), f"{what}: {actual}"
    producers = _producers(model)
    position = {name: i for i, name in enumerate(actual)}
    for name in actual:
        for producer in producers[name]:
            if producer in position:
                assert position[producer] < position[name], (
                    f"{what}: {producer!r} feeds {name!r} but is listed "
                    f"after it: {actual}"
                )


def _assert_same_plan(plan, expected_plan):
    assert plan.staged_layers == expected_plan.staged_layers
    assert plan.trunk_layers == expected_plan.trunk_layers
    assert plan.reasons == expected_plan.reasons


# -- (a) training ------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trained", TRAINED, indirect=True)
def test_smart_stage_fit_matches_plain_fit(trained):
    plain, staged = trained.plain, trained.staged
    assert staged.smart_stage is True
    assert plain.smart_stage is False
    # The staged run really staged its data (the PrefetchCallback logged).
    for key in STAGE_KEYS:
        assert key in trained.staged_history, key

    plain_results = _results(trained.plain_history)
    staged_results = _results(trained.staged_history)
    assert staged_results.keys() == plain_results.keys()
    assert len(plain_results["loss"]) == EPOCHS
    for key, values in plain_results.items():
        np.testing.assert_allclose(
            staged_results[key], values, rtol=RTOL, atol=ATOL, err_msg=key
        )

    plain_weights = plain.get_weights()
    staged_weights = staged.get_weights()
    assert len(staged_weights) == len(plain_weights)
    for i, (staged_w, plain_w) in enumerate(
        zip(staged_weights, plain_weights, strict=True)
    ):
        np.testing.assert_allclose(
            staged_w, plain_w, rtol=RTOL, atol=ATOL, err_msg=f"weight {i}"
        )
    # Training moved the weights, so equal weights mean equal training.
    assert any(
        not np.allclose(w, w0)
        for w, w0 in zip(staged_weights, trained.initial_weights, strict=True)
    )


# -- (b) the stage plan ------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
def test_stage_plan(name):
    workload = WORKLOADS[name]
    x, _ = workload.train_data()
    model = _build_and_compile(workload, x, smart_stage=True)

    plan = model.get_stage_plan()

    assert isinstance(plan, keras_stage.StagePlan)
    _assert_layers(plan.staged_layers, workload.staged, model, "staged")
    _assert_layers(plan.trunk_layers, workload.trunk, model, "trunk")
    assert plan.staged_layers[0] == "stage"
    # Every layer but the inputs is on exactly one side.
    non_input = [
        layer.name
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    assert sorted(plan.staged_layers + plan.trunk_layers) == sorted(non_input)
    assert plan.reasons == workload.reasons

    boundary = sorted(
        (t.dtype, tuple(t.shape), t.bytes_per_example) for t in plan.boundary
    )
    assert boundary == sorted(workload.boundary)
    for tensor in plan.boundary:
        assert isinstance(tensor.name, str) and tensor.name

    lines = []
    model.stage_summary(
        print_fn=lambda line, *args, **kwargs: lines.append(line)
    )
    text = "\n".join(lines)
    for layer_name in workload.staged + workload.trunk:
        assert layer_name in text, layer_name


# -- (c) inference after a staged fit ----------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trained", TRAINED, indirect=True)
def test_predict_and_evaluate_after_smart_stage_fit_match_plain_model(
    trained,
):
    plain, staged = trained.plain, trained.staged
    workload = trained.workload
    x, y = workload.test_data()
    batch_size = workload.batch_size

    plain_pred = plain.predict(x, batch_size=batch_size, verbose=0)
    staged_pred = staged.predict(x, batch_size=batch_size, verbose=0)
    assert staged_pred.shape == plain_pred.shape
    assert staged_pred.shape[0] == len(y)
    np.testing.assert_allclose(staged_pred, plain_pred, rtol=RTOL, atol=ATOL)

    plain_logs = plain.evaluate(
        x, y, batch_size=batch_size, verbose=0, return_dict=True
    )
    staged_logs = staged.evaluate(
        x, y, batch_size=batch_size, verbose=0, return_dict=True
    )
    plain_logs, staged_logs = _results(plain_logs), _results(staged_logs)
    assert staged_logs.keys() == plain_logs.keys()
    assert "loss" in plain_logs
    for key, value in plain_logs.items():
        np.testing.assert_allclose(
            staged_logs[key], value, rtol=RTOL, atol=ATOL, err_msg=key
        )

    # The model stays whole: called directly on raw inputs, it runs the
    # preprocessing itself.
    rows = batch_size + 3
    direct = staged(_as_tensors(_take(x, rows)), training=False)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(direct),
        plain_pred[:rows],
        rtol=RTOL,
        atol=ATOL,
    )


# -- save and load -----------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trained", TRAINED, indirect=True)
def test_keras_save_load_keeps_smart_stage_and_plan(trained, tmp_path):
    staged = trained.staged
    path = tmp_path / "m.keras"
    staged.save(path)

    loaded = keras.saving.load_model(path)

    assert isinstance(loaded, keras_stage.Model)
    assert loaded.smart_stage is True
    _assert_same_plan(loaded.get_stage_plan(), staged.get_stage_plan())
    x, _ = trained.workload.test_data()
    batch_size = trained.workload.batch_size
    np.testing.assert_allclose(
        loaded.predict(x, batch_size=batch_size, verbose=0),
        staged.predict(x, batch_size=batch_size, verbose=0),
        rtol=RTOL,
        atol=ATOL,
    )
