"""Staged preprocessing on the tf.data service: `StagedInput(service=...)`.

Starts a tf.data service in this process (`LocalService`: a dispatcher and
2 workers on loopback), then trains a SmartStage model whose preprocessing
(`StringLookup` + `Hashing` over raw strings) runs on the service's
workers: the trainer receives finished batches into its local buffer. The
trunk counts the examples it trains on, so the output shows that every
example was trained exactly once per epoch (`"distributed_epoch"`), or
once per worker (`"parallel_epochs"`). Evaluation and prediction follow.

In production the dispatcher and the workers run on other machines
(TensorFlow's `DispatchServer` and `WorkerServer`) and `service` is the
dispatcher's `"grpc://host:port"`; a `LocalService` shares this machine's
CPUs, so it shows the wiring, not a speed-up. The tf.data service has no
authentication: keep dispatchers and workers on a private network.

Run with `python -m examples.distributed_service` (`--tiny` for a smoke
run). See docs/distributed.md.
"""

import argparse
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402
from keras_stage.data.service import LocalService  # noqa: E402

CITIES = ["paris", "tokyo", "lima", "oslo"]
BATCH_SIZE = 32
# How many times the trunk saw each example id (filled by CountExamples).
SEEN = collections.Counter()


class CountExamples(keras.layers.Layer):
    """In the trunk: counts the ids of the examples each step trains on."""

    def call(self, inputs):
        h, ids = inputs

        def note(ids):
            SEEN.update(int(i) for i in ids.numpy())
            return np.int64(0)

        done = tf.py_function(note, [ids], tf.int64)
        with tf.control_dependencies([done]):
            return tf.identity(h)


def make_data(num_examples):
    rng = np.random.default_rng(0)
    city = rng.choice(CITIES + ["rome"], num_examples).astype(object)
    user = np.array([f"user_{u}" for u in rng.integers(0, 500, num_examples)])
    x = {
        "id": np.arange(num_examples, dtype="int64"),
        "city": city,
        "user": user.astype(object),
    }
    y = (np.char.str_len(city.astype(str)) % 2).astype("float32")
    return x, y


def build(service, processing_mode):
    keras.utils.set_random_seed(0)
    inputs = {
        "id": keras.Input((), dtype="int64", name="id"),
        "city": keras.Input((), dtype="string", name="city"),
        "user": keras.Input((), dtype="string", name="user"),
    }
    # The one new argument: where the stage runs.
    staged = keras_stage.layers.StagedInput(
        service=service,
        processing_mode=processing_mode,
        num_threads=2,
        capacity=8,
        timeout=60,
        name="staged",
    )(inputs)
    city = keras.layers.StringLookup(vocabulary=CITIES, name="city_lookup")(
        staged["city"]
    )
    user = keras.layers.Hashing(num_bins=64, name="user_hash")(staged["user"])
    h = keras.layers.Concatenate()(
        [
            keras.layers.Embedding(len(CITIES) + 1, 4)(city),
            keras.layers.Embedding(64, 4)(user),
        ]
    )
    h = keras.layers.Dense(8, activation="relu")(h)
    h = CountExamples(name="count_examples")([h, staged["id"]])
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="smoke run")
    args = parser.parse_args(argv)
    num_examples, epochs = (96, 2) if args.tiny else (4096, 3)
    x, y = make_data(num_examples)

    with LocalService(num_workers=2) as service:
        print(
            f"tf.data service: {service.target}, {service.num_workers} workers"
        )
        for mode in ("distributed_epoch", "parallel_epochs"):
            SEEN.clear()
            model = build(service.target, mode)
            if mode == "distributed_epoch":
                model.stage_summary()
            history = model.fit(
                x,
                y,
                batch_size=BATCH_SIZE,
                epochs=epochs,
                verbose=0,
                callbacks=[keras_stage.callbacks.PrefetchCallback()],
            )
            per_example = collections.Counter(SEEN.values())
            times = ", ".join(
                f"{n} examples {k} times"
                for k, n in sorted(per_example.items())
            )
            print(f"\nprocessing_mode={mode!r}, {epochs} epochs:")
            print(f"  trained: {times}")
            print(f"  loss per epoch: {np.round(history.history['loss'], 4)}")
            waits = np.round(history.history["stage_wait_ratio"], 3)
            print(f"  wait ratio: {waits}")
        SEEN.clear()
        loss = model.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0)
        print(
            f"\nevaluate (on the service, each example once): loss {loss:.4f}"
        )
        print(f"  examples evaluated: {len(SEEN)} of {num_examples}")
        predicted = model.predict(x, batch_size=BATCH_SIZE, verbose=0)
        direct = model(
            {k: tf.constant(v[:BATCH_SIZE]) for k, v in x.items()}
        ).numpy()
        same = np.allclose(predicted[:BATCH_SIZE], direct, atol=1e-5)
        print(f"predict (in this process, in order): same as model(x): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
