"""Device-side staging on logical devices: buffers, packing, strategies.

There is no GPU here, so every test splits the CPU into logical devices
(`tf.config.set_logical_device_configuration`) in a process of its own
(forked from one that imported TensorFlow and ran no op), where the
configuration cannot leak into the rest of the session, and uses `/CPU:1`
as the "device": the same code paths as a GPU (a buffer on a device other
than the host's, copies into it, per-replica buffers under a strategy).
"""

import json
import os
import textwrap
import warnings

import numpy as np
import pytest

from tests.helpers import run_forked

PRELUDE = """
import json, os, sys
sys.path.insert(0, {root!r})
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * {devices}
)
import keras
import keras_stage
from keras_stage.layers import StagedInput
"""


def _run(*code, devices=2, timeout=240):
    """Runs the `code` parts with `devices` logical CPUs; returns its JSON."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    script = PRELUDE.format(root=root, devices=devices) + "\n".join(
        textwrap.dedent(part) for part in code
    )
    # Forked from a process that imported TensorFlow and ran no op: the
    # devices are not initialised yet when the script splits the CPU.
    done = run_forked(["-c"], code=script, cwd=root, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [s for s in done.stdout.splitlines() if s.startswith("{")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[-1])


@pytest.mark.timeout(300)
def test_buffer_lives_on_the_chosen_device_and_staged_ops_on_the_host():
    out = _run(
        """
        from keras_stage.data import stage
        from keras_stage.data.staging import on_host

        def fn(x):
            return tf.strings.to_number(x) * 2.0

        lines = tf.data.Dataset.from_tensor_slices(["1", "2", "3"]).batch(1)
        staged = stage(lines, fn, device="/CPU:1", capacity=2, num_threads=2)
        devices = [x.device for x in staged]
        values = [float(x.numpy()[0]) for x in staged]
        host = stage(lines, fn, device="cpu")
        graph = tf.function(on_host(fn)).get_concrete_function(
            tf.TensorSpec([None], tf.string)
        ).graph
        skip = ("Placeholder", "NoOp", "Identity")
        op_devices = sorted({op.device for op in graph.get_operations()
                             if op.type not in skip})
        print(json.dumps({
            "devices": devices, "values": values,
            "stage_device": staged.device, "host_device": host.device,
            "host_elements": [x.device for x in host],
            "op_devices": op_devices,
        }))
        """
    )
    assert out["values"] == [2.0, 4.0, 6.0]
    assert all(d.endswith("device:CPU:1") for d in out["devices"]), out
    assert out["stage_device"].endswith("device:CPU:1")
    assert out["host_device"] is None
    assert all(d.endswith("device:CPU:0") for d in out["host_elements"])
    # Every op of the staged computation is pinned to the host CPU (the
    # function's own inputs and outputs are not ops of the computation).
    assert out["op_devices"] and all(
        d.endswith("device:CPU:0") for d in out["op_devices"]
    ), out["op_devices"]


# The Criteo-like columns (26 categorical, 13 dense), as the packed buffer's
# test counts them; the other tests need a dict of both kinds only, and a
# model of a few inputs traces faster (the strategy tests took 10-45% less).
CRITEO_COLUMNS = dict(cats=26, dense=13)
FEW_COLUMNS = dict(cats=4, dense=2)

FIT_TWINS = """
def data(n=64):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=(n, {cats})).astype("int64")
    dense = rng.normal(size=(n, {dense})).astype("float32")
    y = dense[:, :1] + (ids[:, :1] % 7).astype("float32")
    x = {{f"c{{i}}": ids[:, i] for i in range({cats})}}
    x.update({{f"d{{i}}": dense[:, i] for i in range({dense})}})
    return x, y

def build(cls, staged_kwargs=None):
    keras.utils.set_random_seed(1)
    inputs = {{f"c{{i}}": keras.Input((), dtype="int64", name=f"c{{i}}")
              for i in range({cats})}}
    inputs.update({{f"d{{i}}": keras.Input((), name=f"d{{i}}")
                   for i in range({dense})}})
    x = inputs
    if staged_kwargs is not None:
        x = StagedInput(**staged_kwargs)(inputs)
    cats = keras.ops.stack([x[f"c{{i}}"] for i in range({cats})], axis=1)
    dense = keras.ops.stack([x[f"d{{i}}"] for i in range({dense})], axis=1)
    hashed = keras.layers.Hashing(64)(cats)
    emb = keras.layers.Flatten()(keras.layers.Embedding(64, 4)(hashed))
    h = keras.layers.Concatenate()([emb, dense])
    out = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(h))
    model = cls(inputs, out)
    return model

def train(model, smart_stage=None):
    kwargs = {{}} if smart_stage is None else {{"smart_stage": smart_stage}}
    model.compile(optimizer="sgd", loss="mse", **kwargs)
    x, y = data()
    h = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [w.tolist() for w in model.get_weights()], h.history["loss"]
"""

MIRRORED_TWINS = """
strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])

def mirrored_twins():
    # `(name, model)`: a plain model, then its SmartStage twin (every call
    # staged), each built and compiled under `strategy`.
    for name, cls, kwargs in (
        ("plain", keras.Model, None),
        ("staged", keras_stage.Model,
         dict(capacity=2, num_threads=2, adaptive=False)),
    ):
        with strategy.scope():
            model = build(cls, kwargs)
            extra = {} if kwargs is None else {"smart_stage": True}
            model.compile(optimizer="sgd", loss="mse", **extra)
        yield name, model
"""


@pytest.mark.timeout(300)
# Without SmartStage (the whole input staged) in `make test-long`: the
# same buffer and copies.
@pytest.mark.parametrize(
    "smart_stage", [pytest.param(False, marks=pytest.mark.long), True]
)
def test_packed_device_buffer_trains_like_plain_keras(smart_stage):
    out = _run(
        FIT_TWINS.format(**CRITEO_COLUMNS),
        f"""
        plain_w, plain_loss = train(build(keras.Model))
        model = build(keras_stage.Model, dict(
            device="/CPU:1", pack_transfer=True, capacity=2, num_threads=2))
        staged_w, staged_loss = train(model, smart_stage={smart_stage})
        layer = model.layers[next(i for i, l in enumerate(model.layers)
                                  if isinstance(l, StagedInput))]
        x, y = data(16)
        staged = layer.stage(tf.data.Dataset.from_tensors((x, y)), unpacks=True)
        leaves = len(tf.nest.flatten(staged.lean_pipeline.element_spec,
                                     expand_composites=True))
        unpacked = len(tf.nest.flatten(tf.data.Dataset.from_tensors((x, y))
                                       .element_spec))
        print(json.dumps({{
            "close": all(np.allclose(a, b, atol=1e-5)
                         for a, b in zip(plain_w, staged_w)),
            "loss": [plain_loss, staged_loss],
            "packed": staged.packed, "leaves": leaves, "unpacked": unpacked,
        }}))
        """,
    )
    assert out["close"], out["loss"]
    assert out["packed"]
    # 39 feature columns and the label: a few copies instead of 40.
    assert out["unpacked"] == 40
    assert out["leaves"] <= 4, out


@pytest.mark.timeout(300)
def test_unpacked_device_buffer_trains_like_plain_keras():
    out = _run(
        FIT_TWINS.format(**FEW_COLUMNS),
        """
        plain_w, _ = train(build(keras.Model))
        model = build(keras_stage.Model, dict(
            device="/CPU:1", pack_transfer=False))
        staged_w, _ = train(model, smart_stage=True)
        print(json.dumps({"close": all(np.allclose(a, b, atol=1e-5)
                                       for a, b in zip(plain_w, staged_w))}))
        """,
    )
    assert out["close"]


@pytest.mark.timeout(400)
# Without SmartStage in `make test-long`.
@pytest.mark.parametrize(
    "smart_stage", [pytest.param(False, marks=pytest.mark.long), True]
)
def test_mirrored_strategy_over_two_devices_matches_unstaged(smart_stage):
    # The same model trained under MirroredStrategy over two logical CPUs,
    # staged (each replica's buffer on its device, TF's per-replica
    # prefetch) and unstaged, ends with the same weights.
    out = _run(
        FIT_TWINS.format(**FEW_COLUMNS),
        f"""
        strategy = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])
        with strategy.scope():
            plain = build(keras.Model)
        plain_w, plain_loss = train(plain)
        with strategy.scope():
            staged = build(keras_stage.Model, dict(capacity=2, num_threads=2))
        staged_w, staged_loss = train(staged, smart_stage={smart_stage})
        # Each replica's batch arrives on its own device.
        from keras_stage.data import StageOptions
        from keras_stage.models.data_adapters.staged_data import (
            distribute_inputs,
        )
        dist = distribute_inputs(
            strategy,
            tf.data.Dataset.range(8).batch(4),
            StageOptions(capacity=2),
        )
        first = next(iter(dist))
        replica_devices = [v.device for v in first.values]
        print(json.dumps({{
            "replica_devices": replica_devices,
            "replicas": strategy.num_replicas_in_sync,
            "close": all(np.allclose(a, b, atol=1e-5)
                         for a, b in zip(plain_w, staged_w)),
            "loss": [plain_loss, staged_loss],
        }}))
        """,
    )
    assert out["replicas"] == 2
    assert out["close"], out["loss"]
    assert [d[-5:] for d in out["replica_devices"]] == ["CPU:0", "CPU:1"]


# The two policies below, one stage per dataset across calls and one
# iterator per role across a fit's epochs, are tested without a strategy
# in `make test` (tests/models/data_adapters/); under MirroredStrategy they
# run in `make test-long`. `make test` keeps each strategy's fit equal to
# plain Keras's (above, and MultiWorkerMirroredStrategy below).
@pytest.mark.long
@pytest.mark.timeout(400)
def test_calls_on_one_dataset_under_a_strategy_reuse_one_stage():
    # A loop of fit(epochs=1) with an evaluate after each, on one dataset
    # object each, under MirroredStrategy over two logical CPUs: the stage
    # of each role and its distributed dataset are built once, Keras's
    # iterators of each are views of one distributed iterator, and the
    # calls train and evaluate as plain Keras's do.
    out = _run(
        FIT_TWINS.format(**FEW_COLUMNS),
        MIRRORED_TWINS,
        """
        from keras_stage.models.data_adapters import staged_data

        built, distributed, iterated = [], [], []
        stage = StagedInput.stage
        def counted_stage(self, dataset, *args, **kwargs):
            built.append(kwargs.get("name"))
            return stage(self, dataset, *args, **kwargs)
        StagedInput.stage = counted_stage
        distribute = staged_data.distribute_inputs
        def counted_distribute(*args):
            # Counts the iterators made of each stage's distributed dataset.
            result = distribute(*args)
            distributed.append(id(result))
            cls = type(result)
            if not hasattr(cls, "counted_iter"):
                cls.counted_iter = cls.__iter__
                def counted_iter(self):
                    if id(self) in distributed:
                        iterated.append(1)
                    return cls.counted_iter(self)
                cls.__iter__ = counted_iter
            return result
        staged_data.distribute_inputs = counted_distribute

        x, y = data()
        def dataset():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        losses = {}
        for name, model in mirrored_twins():
            train, test = dataset(), dataset().take(2)
            losses[name] = []
            for _ in range(3):
                model.fit(train, epochs=1, verbose=0)
                losses[name].append(model.evaluate(test, verbose=0))
            weights = [w.tolist() for w in model.get_weights()]
            losses[name + "_weights"] = weights
        print(json.dumps({
            "built": built,
            "distributed": len(distributed),
            "iterated": len(iterated),
            "losses": [losses["plain"], losses["staged"]],
            "close": all(np.allclose(a, b, atol=1e-5) for a, b in zip(
                losses["plain_weights"], losses["staged_weights"])),
        }))
        """,
    )
    assert out["close"], out["losses"]
    np.testing.assert_allclose(*out["losses"], rtol=1e-5)
    assert sorted(out["built"]) == [
        "staged_input_test",
        "staged_input_train",
    ], out["built"]
    assert out["distributed"] == 2, out
    # One iterator of each for the 3 calls (one per call before: 6).
    assert out["iterated"] == 2, out


@pytest.mark.long
@pytest.mark.timeout(400)
def test_a_fit_under_a_strategy_runs_its_epochs_on_one_iterator():
    # Under MirroredStrategy a fit's epochs and validation runs read one
    # distributed iterator per role, as without a strategy; a dataset that
    # reshuffles from a seed keeps an iterator per epoch (Keras's peek at
    # each call's start takes one of its draws). Both train as plain Keras.
    out = _run(
        FIT_TWINS.format(**FEW_COLUMNS),
        MIRRORED_TWINS,
        """
        from keras_stage.data.epochs import LongLivedIterator

        made = []
        make = LongLivedIterator._make
        def counted_make(self):
            made.append(self._name)
            return make(self)
        LongLivedIterator._make = counted_make

        x, y = data(96)
        def dataset():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        results = {}
        for name, model in mirrored_twins():
            shuffled = dataset().unbatch().shuffle(96, seed=3).batch(16)
            val = dataset().take(2)
            first = model.fit(shuffled, epochs=2, validation_data=val,
                              verbose=0)
            second = model.fit(dataset(), epochs=3, validation_data=val,
                               verbose=0)
            results[name] = (
                [first.history, second.history],
                [w.tolist() for w in model.get_weights()],
            )
        print(json.dumps({
            "made": made,
            "histories": [results["plain"][0], results["staged"][0]],
            "close": all(np.allclose(a, b, atol=1e-5) for a, b in zip(
                results["plain"][1], results["staged"][1])),
        }))
        """,
    )
    assert out["close"], out["histories"]
    for plain, staged in zip(*out["histories"], strict=True):
        for key in plain:
            np.testing.assert_allclose(plain[key], staged[key], rtol=1e-5)
    # The shuffled fit's training: none; the validation of both fits
    # (one dataset object): one; the second fit's training: one.
    assert sorted(out["made"]) == [
        "staged_input_train",
        "staged_input_val",
    ], out["made"]


@pytest.mark.timeout(400)
def test_multi_worker_strategy_with_one_worker_matches_unstaged():
    # The same code under MultiWorkerMirroredStrategy (one worker here: a
    # cluster needs several machines).
    out = _run(
        FIT_TWINS.format(**FEW_COLUMNS),
        """
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            plain = build(keras.Model)
        plain_w, plain_loss = train(plain)
        with strategy.scope():
            staged = build(keras_stage.Model, dict(capacity=2, num_threads=2))
        staged_w, staged_loss = train(staged, smart_stage=True)
        print(json.dumps({
            "close": all(np.allclose(a, b, atol=1e-5)
                         for a, b in zip(plain_w, staged_w)),
            "loss": [plain_loss, staged_loss],
        }))
        """,
    )
    assert out["close"], out["loss"]


@pytest.mark.timeout(120)
def test_defaults_keep_the_buffer_on_the_host_without_a_gpu():
    import tensorflow as tf

    from keras_stage.data import stage

    assert not tf.config.list_physical_devices("GPU")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        staged = stage(tf.data.Dataset.range(3), lambda x: x + 1)
        assert staged.device is None and not staged.packed
        assert [int(x) for x in staged] == [1, 2, 3]
    # "auto" falls back to the host without a word.
    assert [str(w.message) for w in caught] == []


@pytest.mark.timeout(120)
def test_a_stream_without_a_gpu_warns_once_and_trains(monkeypatch):
    import keras
    import numpy as np

    import keras_stage
    from keras_stage.data import devices
    from keras_stage.layers import StagedInput

    monkeypatch.setattr(devices, "_warned", set())
    inputs = keras.Input(shape=(2,))
    x = StagedInput(stream=1, capacity=2, num_threads=1)(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 2), "float32"), np.ones((8, 1), "float32")
    with pytest.warns(UserWarning, match="stream=1") as caught:
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert len([w for w in caught if "stream" in str(w.message)]) == 1
    assert len(history.history["loss"]) == 2
