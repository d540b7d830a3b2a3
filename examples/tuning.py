"""Tuning: read the PrefetchCallback's verdict, apply it, train again.

The source is deliberately slow: every batch of raw lines waits in an
emulated remote read (a `tf.py_function` that sleeps, releasing the GIL
like real IO) before it is parsed. The read and the parse are a layer of
the model, so `compile(smart_stage=True)` runs them in the stage.

1. It trains with DeepRec's `tf.staged` defaults, `num_threads=1` and
   `capacity=1`: one batch is read at a time, and the training step waits.
2. It reads what the `PrefetchCallback` found after the last epoch:
   `stage_wait_ratio` from the history and the verdict from
   `callback.verdict` (the input-bound flag, the per-batch times, and the
   suggested `num_threads` and `capacity`, by DeepRec's rules of thumb).
3. It builds the same model with the suggested settings, copies the
   weights, trains again and prints both runs side by side.

Run with `python -m examples.tuning` (`--tiny` for a smoke run).
See docs/callback.md.
"""

import argparse
import os
import textwrap
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402

SEED = 0
BATCH_SIZE = 64
READ_SECONDS = 0.02
HASH_BINS = 1000


def remote_read(batch):
    # Stands for a read from a remote store; sleeping releases the GIL, as
    # a socket read does, so several reads can wait at once.
    time.sleep(READ_SECONDS)
    return batch


@keras.saving.register_keras_serializable(package="keras_stage_examples")
class ReadAndParse(keras.layers.Layer):
    """Raw "user,item" lines -> a slow read -> hashed user and item ids."""

    def call(self, lines):
        lines = tf.py_function(remote_read, [lines], tf.string)
        lines.set_shape([None])
        user, item = tf.io.decode_csv(lines, [[""], [""]])
        return tf.stack(
            [
                tf.strings.to_hash_bucket_fast(user, HASH_BINS),
                tf.strings.to_hash_bucket_fast(item, HASH_BINS),
            ],
            axis=1,
        )

    def compute_output_spec(self, lines):
        return keras.KerasTensor((lines.shape[0], 2), "int64")


def build_model(num_threads, capacity):
    lines = keras.Input(shape=(), dtype="string", name="line")
    x = keras_stage.layers.StagedInput(
        num_threads=num_threads, capacity=capacity, name="reader"
    )(lines)
    ids = ReadAndParse(name="read_and_parse")(x)
    h = keras.layers.Embedding(HASH_BINS, 16, name="emb")(ids)
    h = keras.layers.Flatten(name="flatten")(h)
    h = keras.layers.Dense(32, activation="relu", name="hidden")(h)
    model = keras_stage.Model(lines, keras.layers.Dense(1, name="score")(h))
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    return model


class EpochTimer(keras.callbacks.Callback):
    """Wall-clock seconds of each epoch."""

    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def train(model, data, epochs):
    """Fits; returns the history, the last verdict and the epoch times."""
    callback = keras_stage.callbacks.PrefetchCallback()
    timer = EpochTimer()
    history = model.fit(
        data,
        epochs=epochs,
        shuffle=False,  # a tf.data source shuffles itself
        callbacks=[callback, timer],
        verbose=0,
    )
    return history.history, callback.verdict, timer.seconds


def describe(label, history, verdict, seconds, num_batches):
    ratios = ", ".join(f"{r:.2f}" for r in history["stage_wait_ratio"])
    print(f"{label}")
    print(f"  stage_wait_ratio per epoch: {ratios}")
    print(
        f"  last epoch: {seconds[-1]:.2f} s, "
        f"{seconds[-1] / num_batches * 1e3:.1f} ms per step"
    )
    print(f"  input_bound: {verdict['input_bound']}")
    print(
        textwrap.fill(
            f"verdict: {verdict['message']}",
            width=79,
            initial_indent="  ",
            subsequent_indent="    ",
        )
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    num_batches, epochs = (24, 2) if args.tiny else (100, 3)
    keras.utils.set_random_seed(SEED)

    rng = np.random.default_rng(SEED)
    count = num_batches * BATCH_SIZE
    users, items = rng.integers(0, 500, count), rng.integers(0, 200, count)
    lines = [f"user_{u},item_{i}" for u, i in zip(users, items, strict=True)]
    scores = ((users % 7 + items % 5) / 10).astype("float32")[:, None]
    data = tf.data.Dataset.from_tensor_slices((lines, scores)).batch(BATCH_SIZE)
    print(
        f"{num_batches} batches of {BATCH_SIZE} lines like {lines[0]!r}; "
        f"each batch waits {READ_SECONDS * 1e3:.0f} ms in a remote read.\n"
    )

    first = build_model(num_threads=1, capacity=1)
    history, verdict, seconds = train(first, data, epochs)
    describe(
        "Run 1: StagedInput(num_threads=1, capacity=1), DeepRec's defaults",
        history,
        verdict,
        seconds,
        num_batches,
    )
    num_threads = verdict["suggested_num_threads"]
    capacity = verdict["suggested_capacity"]
    print(
        f"\nApplying the suggestion: num_threads={num_threads}, "
        f"capacity={capacity} (the same model rebuilt, weights copied)\n"
    )
    second = build_model(num_threads=num_threads, capacity=capacity)
    second.set_weights(first.get_weights())
    history2, verdict2, seconds2 = train(second, data, epochs)
    describe(
        f"Run 2: StagedInput(num_threads={num_threads}, capacity={capacity})",
        history2,
        verdict2,
        seconds2,
        num_batches,
    )
    before = history["stage_wait_ratio"][-1]
    after = history2["stage_wait_ratio"][-1]
    print(
        f"\nLast epoch, run 1 -> run 2: stage_wait_ratio {before:.2f} -> "
        f"{after:.2f}, {seconds[-1]:.2f} s -> {seconds2[-1]:.2f} s "
        f"({seconds[-1] / seconds2[-1]:.1f}x faster)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
