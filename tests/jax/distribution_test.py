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
import pathlib
import socket
import subprocess
import sys
import textwrap

import keras
import pytest

pytestmark = pytest.mark.timeout(300)

# What both children define: the data, the staged model, the hand split.
COMMON = textwrap.dedent(
    """
    import json
    import sys
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

    def staged_model(service=None):
        keras.utils.set_random_seed(1)
        inputs = keras.Input(shape=(), dtype="string")
        x = keras_stage.layers.StagedInput(name="stage", service=service)(
            inputs
        )
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
        # Mapped before batching: Keras finds the global batch size of a
        # dataset it shards across processes from its `batch`.
        data = data.map(lambda a, b: (lookup(a), b)).batch(64)
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
    """
)

# One process over two host devices: prints "RESULT {...}".
DEVICES = COMMON + textwrap.dedent(
    """
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


# ModelParallel across the two processes: a (1, 2) mesh, its 'model' axis
# over both processes' devices, the embedding's columns laid out on it
# (each process holds half). Keras's data layout then replicates each
# global batch on every process (one model replica: `distribute_dataset`
# neither rebatches nor shards), so each stages every batch. The weights
# span both processes' devices: `get_weights` cannot fetch them (Keras,
# plain or staged), `process_allgather` can.
MODEL_PARALLEL = textwrap.dedent(
    """
    def model_parallel(raw):
        from jax.experimental import multihost_utils

        mesh = keras.distribution.DeviceMesh(
            (1, 2), ["batch", "model"], devices=jax.devices()
        )
        layout = keras.distribution.LayoutMap(mesh)
        layout["emb/embeddings"] = (None, "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout, batch_dim_name="batch"
            )
        )

        def weights(model):
            return [
                np.asarray(
                    multihost_utils.process_allgather(v.value, tiled=True)
                )
                for v in model.weights
            ]

        out = {}
        for name, model, data in (
            ("staged", staged_model(), raw.batch(64)),
            ("hand", *hand_split()),
        ):
            SEEN.clear()
            fit = model.fit(data, epochs=2, validation_data=data, verbose=0)
            out[f"{name}_loss"] = fit.history["loss"]
            out[f"{name}_val_loss"] = fit.history["val_loss"]
            out[f"{name}_eval"] = model.evaluate(data, verbose=0)
            out[f"{name}_specs"] = sorted(set(SEEN))
            emb = model.get_layer("emb").embeddings.value
            out[f"{name}_emb_sharding"] = str(emb.sharding.spec)
            out[f"{name}_emb_local"] = [
                list(shard.data.shape) for shard in emb.addressable_shards
            ]
            out[f"{name}_weights"] = weights(model)
            try:
                model.get_weights()
                out[f"{name}_get_weights"] = "ran"
            except Exception as error:
                out[f"{name}_get_weights"] = type(error).__name__
            if name == "staged":
                out["staged_layers"] = model.get_stage_plan().staged_layers
        out["weight_diffs"] = [
            float(np.abs(a - b).max())
            for a, b in zip(out["staged_weights"], out["hand_weights"])
        ]
        out["weights_changed"] = bool(
            np.abs(out["staged_weights"][0]).sum() > 0
        )
        out["weights"] = [
            w.ravel().tolist() for w in out.pop("staged_weights")
        ]
        del out["hand_weights"]
        keras.distribution.set_distribution(None)
        return out
    """
)

# Counts the stage iterators a child makes (`len(MADE)`).
ITERATORS_MADE = textwrap.dedent(
    """
    from keras_stage.data import staging

    MADE = []  # the names of the stage iterators made

    class _Counted(staging.StageIterator):
        def __init__(self, staged):
            MADE.append(staged.name)
            super().__init__(staged)

    staging.StageIterator = _Counted
    """
)

# One of two processes joined by `jax.distributed` on loopback, one CPU
# device each: `python -c PROCESSES <process_id> <port>` prints
# "RESULT {...}". Across processes Keras takes only datasets, and shards
# each per process; predict fails in Keras itself (it cannot fetch an
# array spanning another process's device), plain and staged alike. Then
# the same two processes train under ModelParallel (`MODEL_PARALLEL`).
PROCESSES = (
    textwrap.dedent(
        """
        import sys
        import jax
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        process_id, port = int(sys.argv[1]), sys.argv[2]
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=2,
            process_id=process_id,
        )
        """
    )
    + COMMON
    + ITERATORS_MADE
    + MODEL_PARALLEL
    + textwrap.dedent(
        """
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices())
        )
        raw = tf.data.Dataset.from_tensor_slices((words.astype(str), y))
        staged = staged_model()
        out = {"processes": jax.process_count()}
        before = len(MADE)
        fit = staged.fit(
            raw.batch(64), epochs=2, validation_data=raw.batch(64), verbose=0
        )
        out["staged_iterators"] = len(MADE) - before
        out["staged_loss"] = fit.history["loss"]
        out["staged_val_loss"] = fit.history["val_loss"]
        out["staged_eval"] = staged.evaluate(raw.batch(64), verbose=0)
        hand, data = hand_split()
        fit = hand.fit(data, epochs=2, validation_data=data, verbose=0)
        out["hand_loss"] = fit.history["loss"]
        out["hand_val_loss"] = fit.history["val_loss"]
        out["hand_eval"] = hand.evaluate(data, verbose=0)
        out["weight_diffs"] = [
            float(np.abs(a - b).max())
            for a, b in zip(staged.get_weights(), hand.get_weights())
        ]
        out["weights"] = [
            np.asarray(w).ravel().tolist() for w in staged.get_weights()
        ]
        for name, model, x in (
            ("hand", hand, data), ("staged", staged, raw.batch(64))
        ):
            try:
                model.predict(x, verbose=0)
                out[f"{name}_predict"] = "ran"
            except Exception as error:
                out[f"{name}_predict"] = type(error).__name__
        # The tf.data service (one worker, which keeps each shard's order):
        # each process reads its own shard from the service's worker.
        served = staged_model(service=sys.argv[3])
        fit = served.fit(raw.batch(64), epochs=2, shuffle=False, verbose=0)
        out["served_loss"] = fit.history["loss"]
        out["served_delivered"] = fit.history["stage_service_delivered"]
        out["model_parallel"] = model_parallel(raw)
        print("RESULT " + json.dumps(out), flush=True)
        """
    )
)


def jax_env(**extra):
    return {**os.environ, "KERAS_BACKEND": "jax", **extra}


@pytest.fixture(scope="module")
def result():
    if keras.backend.backend() != "jax":
        pytest.skip("the child runs on JAX: `make test-jax`")
    done = subprocess.run(
        [sys.executable, "-c", DEVICES],
        capture_output=True,
        text=True,
        env=jax_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return parse_result(done.stdout)


def parse_result(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-2000:]
    return json.loads(lines[-1][len("RESULT ") :])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def processes():
    """The two processes' results (started together, ended in any case)."""
    if keras.backend.backend() != "jax":
        pytest.skip("the children run on JAX: `make test-jax`")
    from keras_stage.data.service import LocalService

    port = str(free_port())
    service = LocalService(num_workers=1)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESSES, str(index), port, service.target],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=jax_env(),
        )
        for index in range(2)
    ]
    try:
        outputs = [child.communicate(timeout=240) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
        service.close()
    for child, (_, stderr) in zip(children, outputs, strict=True):
        assert child.returncode == 0, stderr[-4000:]
    return [parse_result(stdout) for stdout, _ in outputs]


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


def test_arrays_across_processes_get_keras_error_as_plain(monkeypatch):
    """Across processes Keras takes only datasets; staged, the same error."""
    if keras.backend.backend() != "jax":
        pytest.skip("runs on JAX: `make test-jax`")
    import jax
    import numpy as np

    import keras_stage

    def model(staged):
        inputs = keras.Input(shape=(), dtype="int32")
        x = keras_stage.layers.StagedInput()(inputs) if staged else inputs
        x = keras.layers.IntegerLookup(vocabulary=[1, 2])(x)
        out = keras.layers.Dense(1)(keras.layers.Embedding(3, 2)(x))
        built = (keras_stage.Model if staged else keras.Model)(inputs, out)
        built.compile("sgd", "mse", **({"smart_stage": True} if staged else {}))
        return built

    # What `jax.distributed.initialize` with two processes would report.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices()[:1])
    )
    try:
        for staged in (False, True):
            with pytest.raises(ValueError, match="tf.data.Dataset"):
                model(staged).fit(
                    np.array([1, 2] * 4, dtype="int32"),
                    np.zeros((8, 1), "float32"),
                    batch_size=4,
                    verbose=0,
                )
    finally:
        keras.distribution.set_distribution(None)


def test_two_processes_each_stage_a_shard_and_train_as_the_hand_split(
    processes, result
):
    for run in processes:
        assert run["processes"] == 2
        assert max(run["weight_diffs"]) < 1e-6
        assert run["staged_loss"] == pytest.approx(run["hand_loss"], rel=1e-6)
        assert run["staged_val_loss"] == pytest.approx(
            run["hand_val_loss"], rel=1e-6
        )
        assert run["staged_eval"] == pytest.approx(run["hand_eval"], rel=1e-6)
        # Each process's stage knows its shard's batch count (Keras's
        # shard of the dataset does not say it): the fit's two epochs
        # run on one stage iterator, its two validations on another.
        assert run["staged_iterators"] == 2
    # Both processes end with the same weights.
    first, second = (run["weights"] for run in processes)
    for a, b in zip(first, second, strict=True):
        assert a == pytest.approx(b, abs=1e-7)
    # Each epoch trained every example once across the processes: the
    # losses of one process over two devices, reading every global batch.
    for run in processes:
        assert run["staged_loss"] == pytest.approx(
            result["data_parallel"]["staged_loss"], rel=1e-6
        )


def test_two_processes_read_their_shards_from_the_service_once_an_epoch(
    processes,
):
    for run in processes:
        # Each process's half of the 512 examples, every epoch.
        assert run["served_delivered"] == [256, 256]
        assert run["served_loss"] == pytest.approx(run["hand_loss"], rel=1e-6)


def test_two_processes_train_as_the_hand_split_under_model_parallel(
    processes, result
):
    for run in (process["model_parallel"] for process in processes):
        assert run["staged_layers"] == ["stage", "ids"]
        # The embedding's columns over the 'model' axis, which spans both
        # processes: each holds 2 of its 4 columns, staged as by hand.
        for name in ("staged", "hand"):
            assert run[f"{name}_emb_sharding"] == "P(None, 'model')"
            assert run[f"{name}_emb_local"] == [[40, 2]]
        assert run["staged_specs"] == run["hand_specs"]
        assert run["weights_changed"]
        assert max(run["weight_diffs"]) < 1e-6
        assert run["staged_loss"] == pytest.approx(run["hand_loss"], rel=1e-6)
        assert run["staged_val_loss"] == pytest.approx(
            run["hand_val_loss"], rel=1e-6
        )
        assert run["staged_eval"] == pytest.approx(run["hand_eval"], rel=1e-6)
        # Keras cannot fetch a weight spanning another process's device,
        # plain or staged.
        assert run["staged_get_weights"] == run["hand_get_weights"]
        # The losses of one process over two devices under the same
        # ModelParallel: every example once per epoch.
        assert run["staged_loss"] == pytest.approx(
            result["model_parallel"]["staged_loss"], rel=1e-6
        )
    # Both processes end with the same (gathered) weights.
    first, second = (run["model_parallel"]["weights"] for run in processes)
    for a, b in zip(first, second, strict=True):
        assert a == pytest.approx(b, abs=1e-7)


def test_predict_across_processes_does_as_plain_keras(processes):
    for run in processes:
        assert run["staged_predict"] == run["hand_predict"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tiny"], ["devices: 2, processes: 1"]),
        (
            ["--tiny", "--processes", "2", "--service"],
            [
                "devices: 2, processes: 2",
                "examples this process read from the service: [128, 128]",
                "both processes end with the same weights: True",
            ],
        ),
    ],
)
def test_the_example_runs(args, expected):
    if keras.backend.backend() != "jax":
        pytest.skip("runs on JAX: `make test-jax`")
    done = subprocess.run(
        [sys.executable, "-m", "examples.jax_distributed", *args],
        capture_output=True,
        text=True,
        env=jax_env(),
        timeout=240,
        cwd=pathlib.Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    for line in expected:
        assert line in lines, done.stdout
    assert "staged: ['staged_input', 'hashing', 'string_lookup']" in lines


# The second of two processes, as Keras's adapter shards for it: two host
# devices, and JAX made to report two processes with this one second
# (Keras's DataParallel then rebatches each global batch of 16 into two of
# 8 and keeps every other). `python -c SECOND_SHARD <rows>` prints
# "RESULT {...}": the steps of each epoch and the stage iterators made, or
# the error.
SECOND_SHARD = (
    textwrap.dedent(
        """
        import json
        import sys
        import jax
        jax.process_count = lambda: 2
        jax.process_index = lambda: 1
        import keras
        import numpy as np
        import tensorflow as tf
        import keras_stage
        """
    )
    + ITERATORS_MADE
    + textwrap.dedent(
        """
        rows = int(sys.argv[1])
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices())
        )
        inputs = keras.Input(shape=(), dtype="int32")
        x = keras_stage.layers.StagedInput(name="stage")(inputs)
        x = keras.layers.IntegerLookup(vocabulary=[1, 2])(x)
        out = keras.layers.Dense(1)(keras.layers.Embedding(3, 2)(x))
        model = keras_stage.Model(inputs, out)
        model.compile("sgd", "mse", smart_stage=True)
        data = tf.data.Dataset.from_tensor_slices(
            (np.array([1, 2] * (rows // 2), "int32"), np.zeros((rows, 1)))
        ).batch(16)
        steps = []
        counter = keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: steps.append(0),
            on_train_batch_end=lambda batch, logs: steps.__setitem__(
                -1, steps[-1] + 1
            ),
        )
        result = {}
        try:
            model.fit(data, epochs=2, verbose=0, callbacks=[counter])
        except Exception as error:
            result["error"] = str(error)
        result.update(steps=steps, iterators=len(MADE))
        print("RESULT " + json.dumps(result), flush=True)
        """
    )
)


@pytest.mark.parametrize("rows", [124, 120])
def test_a_process_stages_its_shards_batches_on_one_iterator(rows):
    """The count of a shard: the dataset's global batches, or a clear error.

    124 rows in batches of 16: the last global batch (12 rows) gives both
    processes a share, so this process's shard has the dataset's 8
    batches, and the fit's epochs run on one stage iterator. 120 rows: the
    last (8 rows) reaches only the first process, which plain Keras's
    processes cannot train on (they wait on each other at the epoch's
    end); the stage says so.
    """
    if keras.backend.backend() != "jax":
        pytest.skip("the child runs on JAX: `make test-jax`")
    done = subprocess.run(
        [sys.executable, "-c", SECOND_SHARD, str(rows)],
        capture_output=True,
        text=True,
        env=jax_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    run = parse_result(done.stdout)
    if rows == 124:
        assert "error" not in run, run
        assert run["steps"] == [8, 8]
        assert run["iterators"] == 1
    else:
        assert "drop_remainder=True" in run["error"]
        assert "expected to contain 8 elements" in run["error"]
