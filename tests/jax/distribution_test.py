"""SmartStage under keras.distribution on JAX, over one process's devices.

Keras's JAX trainer lays each batch it reads out over the distribution's
devices; a staged call feeds it as any dataset does. These tests run a
child process with two host devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=2`, which must be set
before JAX starts) and hold a string-input SmartStage model to the same
model split by hand (the lookup in `dataset.map`, a numeric trunk) under
the same distribution: equal weights after fit, equal evaluate and
predict, and each batch sharded over the devices in the trunk's step.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest

pytestmark = pytest.mark.timeout(300)

# The child: prints one JSON line, "RESULT {...}".
CHILD = textwrap.dedent(
    """
    import json
    import jax
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_stage

    VOCAB = [f"w{i}" for i in range(37)]
    words = np.array([f"w{i % 41}" for i in range(512)], dtype=object)
    y = (np.arange(512) % 3 == 0).astype("float32").reshape(-1, 1)
    SEEN = []

    class ShardingProbe(keras.layers.Layer):
        # Records how the trunk's step lays out its batch (at compile).
        def call(self, x):
            jax.debug.inspect_array_sharding(
                x, callback=lambda s: SEEN.append(str(s.spec))
            )
            return x

    def trunk(x):
        x = keras.layers.Embedding(40, 4, name="emb")(x)
        x = ShardingProbe(name="probe")(x)
        return keras.layers.Dense(1, name="out")(x)

    def staged_model():
        keras.utils.set_random_seed(1)
        inputs = keras.Input(shape=(), dtype="string")
        x = keras_stage.layers.StagedInput(name="stage")(inputs)
        x = keras.layers.StringLookup(vocabulary=VOCAB, name="ids")(x)
        model = keras_stage.Model(inputs, trunk(x))
        model.compile("sgd", "mse", smart_stage=True)
        return model

    def hand_split():
        keras.utils.set_random_seed(1)
        lookup = keras.layers.StringLookup(vocabulary=VOCAB)
        inputs = keras.Input(shape=(), dtype="int64")
        model = keras.Model(inputs, trunk(inputs))
        model.compile("sgd", "mse")
        data = tf.data.Dataset.from_tensor_slices((words.astype(str), y))
        data = data.batch(64).map(lambda a, b: (lookup(a), b))
        return model, data

    def run(distribution):
        keras.distribution.set_distribution(distribution)
        out = {}
        staged = staged_model()
        SEEN.clear()
        fit = staged.fit(
            words, y, batch_size=64, epochs=2, shuffle=False, verbose=0
        )
        out["staged_layers"] = staged.get_stage_plan().staged_layers
        out["staged_specs"] = sorted(set(SEEN))
        out["staged_loss"] = fit.history["loss"]
        out["staged_eval"] = staged.evaluate(
            words, y, batch_size=64, verbose=0
        )
        staged_pred = staged.predict(words, batch_size=64, verbose=0)
        hand, data = hand_split()
        SEEN.clear()
        out["hand_loss"] = hand.fit(data, epochs=2, verbose=0).history["loss"]
        out["hand_specs"] = sorted(set(SEEN))
        out["hand_eval"] = hand.evaluate(data, verbose=0)
        out["predict_diff"] = float(
            np.abs(staged_pred - hand.predict(data, verbose=0)).max()
        )
        out["weight_diffs"] = [
            float(np.abs(a - b).max())
            for a, b in zip(staged.get_weights(), hand.get_weights())
        ]
        out["weights_changed"] = bool(
            np.abs(staged.get_layer("emb").get_weights()[0]).sum() > 0
        )
        out["emb_sharding"] = str(
            staged.get_layer("emb").embeddings.value.sharding.spec
        )
        keras.distribution.set_distribution(None)
        return out

    devices = jax.devices()
    mesh = keras.distribution.DeviceMesh(
        (1, 2), ["batch", "model"], devices=devices
    )
    layout = keras.distribution.LayoutMap(mesh)
    layout["emb/embeddings"] = (None, "model")
    result = {
        "devices": len(devices),
        "data_parallel": run(keras.distribution.DataParallel(devices=devices)),
        "model_parallel": run(
            keras.distribution.ModelParallel(
                layout_map=layout, batch_dim_name="batch"
            )
        ),
    }
    print("RESULT " + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def result():
    if keras.backend.backend() != "jax":
        pytest.skip("the child runs on JAX: `make test-jax`")
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = [
        line for line in done.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert line, done.stdout[-2000:]
    return json.loads(line[-1][len("RESULT ") :])


def test_the_child_has_two_devices(result):
    assert result["devices"] == 2


@pytest.mark.parametrize("kind", ["data_parallel", "model_parallel"])
def test_a_staged_fit_trains_as_the_hand_split_under_the_distribution(
    result, kind
):
    run = result[kind]
    assert run["staged_layers"] == ["stage", "ids"]
    assert run["weights_changed"]
    assert max(run["weight_diffs"]) < 1e-6
    assert run["staged_loss"] == pytest.approx(run["hand_loss"], rel=1e-6)


@pytest.mark.parametrize("kind", ["data_parallel", "model_parallel"])
def test_evaluate_and_predict_equal_the_hand_split(result, kind):
    run = result[kind]
    assert run["staged_eval"] == pytest.approx(run["hand_eval"], rel=1e-6)
    assert run["predict_diff"] < 1e-6


def test_data_parallel_shards_each_batch_over_the_devices(result):
    run = result["data_parallel"]
    # The trunk's activations are laid out on the batch axis, as the
    # hand split's (Keras's own layout of a plain model's batch).
    assert run["staged_specs"] == run["hand_specs"]
    assert run["staged_specs"] == ["P('batch',)"]
    assert run["emb_sharding"] == "P(None, None)"


def test_model_parallel_lays_out_the_trunk_by_its_layout_map(result):
    run = result["model_parallel"]
    assert run["emb_sharding"] == "P(None, 'model')"
    assert run["staged_specs"] == run["hand_specs"]


def test_a_staged_call_across_processes_says_what_works(monkeypatch):
    if keras.backend.backend() != "jax":
        pytest.skip("runs on JAX: `make test-jax`")
    import jax
    import numpy as np

    import keras_stage

    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput()(inputs)
    x = keras.layers.StringLookup(vocabulary=["a", "b"])(x)
    model = keras_stage.Model(
        inputs, keras.layers.Dense(1)(keras.layers.Embedding(3, 2)(x))
    )
    model.compile("sgd", "mse", smart_stage=True)
    # What `jax.distributed.initialize` with two processes would report.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:1])
    )
    try:
        with pytest.raises(NotImplementedError, match="across 2 processes"):
            model.fit(
                np.array(["a", "b"] * 4, dtype=object),
                np.zeros((8, 1), "float32"),
                batch_size=4,
                verbose=0,
            )
    finally:
        keras.distribution.set_distribution(None)
