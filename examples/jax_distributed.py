"""A string-input SmartStage model trained under keras.distribution on JAX.

Keras on JAX scales training with `keras.distribution`: `DataParallel`
lays each global batch out over the devices, `ModelParallel` lays out
weights by a layout map, and `jax.distributed` joins processes (hosts).
A `keras_stage.Model` trains under them as a plain model would, with its
preprocessing (`StringLookup`, `Hashing`) staged in tf.data:

- `--devices 2` (the default): one process over two devices. On a
  CPU-only machine the devices are host devices
  (`XLA_FLAGS=--xla_force_host_platform_device_count=2`, set here before
  JAX starts); on a GPU or TPU host they are the accelerators.
- `--processes 2`: two processes joined by `jax.distributed` on loopback
  (this script starts the second itself), each staging its own shard of
  the dataset; both end with the same weights.
- `--service`: the preprocessing runs on a tf.data service's workers
  (`LocalService` here), each process reading its own shard from them.

Run with `KERAS_BACKEND=jax python -m examples.jax_distributed` (in the
`.venv-jax` environment, `make venv-jax`); `--tiny` for a smoke run. See
docs/distributed.md ("On JAX").
"""

import argparse
import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "jax")

CITIES = ["paris", "tokyo", "lima", "oslo"]
GLOBAL_BATCH = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2))
    parser.add_argument("--service", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    # Set by the first process for the second (and for itself).
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--service-target", default=None)
    return parser.parse_args(argv)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, argv):
    """Starts both processes, waits for them, prints the first's output."""
    from keras_stage.data.service import LocalService

    service = LocalService(num_workers=1) if args.service else None
    port = str(free_port())
    extra = ["--port", port]
    if service is not None:
        extra += ["--service-target", service.target]
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "examples.jax_distributed", *argv]
            + extra
            + ["--process-id", str(index)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    try:
        outputs = [child.communicate(timeout=300)[0] for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        if service is not None:
            service.close()
    failed = [child.returncode for child in children if child.returncode]
    if failed:
        raise SystemExit(f"a process failed (exit codes {failed})")
    print(outputs[0], end="")
    weights = [
        line
        for out in outputs
        for line in out.splitlines()
        if "weights" in line
    ]
    same = len(set(line.split("weights ")[-1] for line in weights)) == 1
    print(f"both processes end with the same weights: {same}")


def train(args):
    import jax

    if args.process_id is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=2,
            process_id=args.process_id,
        )
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_stage

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    count = 4 * GLOBAL_BATCH if args.tiny else 64 * GLOBAL_BATCH
    rng = np.random.default_rng(0)
    city = rng.choice(CITIES + ["rome"], count)
    user = np.array([f"user_{u}" for u in rng.integers(0, 500, count)])
    label = (city == "tokyo").astype("float32")[:, None]
    # Across processes Keras takes a dataset and shards it per process.
    data = tf.data.Dataset.from_tensor_slices(
        ({"city": city, "user": user}, label)
    ).batch(GLOBAL_BATCH)

    keras.utils.set_random_seed(0)
    inputs = {
        name: keras.Input(shape=(), dtype="string", name=name)
        for name in ("city", "user")
    }
    x = keras_stage.layers.StagedInput(service=args.service_target)(inputs)
    city_ids = keras.layers.StringLookup(vocabulary=CITIES)(x["city"])
    user_ids = keras.layers.Hashing(num_bins=256)(x["user"])
    h = keras.layers.Concatenate()(
        [
            keras.layers.Embedding(len(CITIES) + 1, 8)(city_ids),
            keras.layers.Embedding(256, 8)(user_ids),
        ]
    )
    h = keras.layers.Dense(16, activation="relu")(h)
    model = keras_stage.Model(
        inputs, keras.layers.Dense(1, activation="sigmoid")(h)
    )
    model.compile("adam", "binary_crossentropy", smart_stage=True)
    history = model.fit(data, epochs=2, shuffle=False, verbose=0)
    loss = model.evaluate(data, verbose=0)
    print(f"devices: {len(jax.devices())}, processes: {jax.process_count()}")
    print(f"staged: {model.get_stage_plan().staged_layers}")
    print(
        f"fit loss per epoch: {[round(v, 4) for v in history.history['loss']]}"
    )
    if "stage_service_delivered" in history.history:
        delivered = history.history["stage_service_delivered"]
        print(f"examples this process read from the service: {delivered}")
    print(f"evaluate loss: {loss:.4f}")
    total = sum(float(np.abs(w).sum()) for w in model.get_weights())
    print(f"weights {json.dumps(round(total, 5))}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.processes == 2 and args.process_id is None:
        launch(args, argv)
        return
    if args.process_id is None and args.devices > 1:
        # Before JAX starts (it reads the flag once).
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}"
    if args.service and args.service_target is None:
        from keras_stage.data.service import LocalService

        with LocalService(num_workers=2) as service:
            args.service_target = service.target
            train(args)
        return
    train(args)


if __name__ == "__main__":
    main()
