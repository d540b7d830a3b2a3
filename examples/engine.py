"""The engine without Keras: `keras_stage.data.stage` in a GradientTape loop.

A text file of "user_12,item_7,0.6" lines is read with
`tf.data.TextLineDataset` and batched. The staged computation, `parse`,
emulates a slow read (a `tf.py_function` that sleeps, like remote IO),
decodes the CSV and hashes the ids: `keras_stage.data.stage` runs it on
`num_threads` batches at once and keeps up to `capacity` finished batches
ahead of the training loop. The model is two embedding tables and a bias,
plain `tf.Variable`s, trained by a custom TF2 loop with `tf.GradientTape`
and sparse SGD updates; no Keras `fit` anywhere.

Iterating the staged dataset eagerly (`for ids, score in staged:`) applies
the stage's exception policies and timeout; each epoch prints the loss and
what the stage's counters say (`staged.stats.snapshot()`): batches produced
and consumed, how long the loop waited, how long a batch took to prepare.

Run with `python -m examples.engine` (`--tiny` for a smoke run).
See docs/engine.md.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_stage.data import stage  # noqa: E402

SEED = 0
BATCH_SIZE = 128
BUCKETS = 4096
DIM = 8
READ_SECONDS = 0.005
LEARNING_RATE = 0.5


def write_lines(path, count):
    rng = np.random.default_rng(SEED)
    users = rng.integers(0, 300, count)
    items = rng.integers(0, 100, count)
    with open(path, "w") as f:
        for u, i in zip(users, items, strict=True):
            f.write(f"user_{u},item_{i},{(u % 4 + i % 3) / 5:.1f}\n")


def remote_read(batch):
    time.sleep(READ_SECONDS)  # releases the GIL, as a socket read does
    return batch


def parse(lines):
    """The staged computation: a slow read, decode_csv, hash buckets."""
    lines = tf.py_function(remote_read, [lines], tf.string)
    lines.set_shape([None])
    user, item, score = tf.io.decode_csv(lines, [[""], [""], [0.0]])
    user = tf.strings.to_hash_bucket_fast(user, BUCKETS)
    item = tf.strings.to_hash_bucket_fast(item, BUCKETS)
    return (user, item), score


class Recommender(tf.Module):
    """score = <user embedding, item embedding> + bias."""

    def __init__(self):
        super().__init__()
        init = tf.random.stateless_normal([BUCKETS, DIM], seed=[SEED, 1])
        self.users = tf.Variable(0.1 * init, name="users")
        init = tf.random.stateless_normal([BUCKETS, DIM], seed=[SEED, 2])
        self.items = tf.Variable(0.1 * init, name="items")
        self.bias = tf.Variable(0.0, name="bias")

    def __call__(self, user, item):
        u = tf.gather(self.users, user)
        i = tf.gather(self.items, item)
        return tf.reduce_sum(u * i, axis=1) + self.bias


model = Recommender()


@tf.function
def train_step(ids, score):
    user, item = ids
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(user, item) - score) ** 2)
    grad_users, grad_items, grad_bias = tape.gradient(
        loss, [model.users, model.items, model.bias]
    )
    # The embedding gradients are IndexedSlices: update only those rows.
    for table, grad in ((model.users, grad_users), (model.items, grad_items)):
        table.scatter_sub(
            tf.IndexedSlices(LEARNING_RATE * grad.values, grad.indices)
        )
    model.bias.assign_sub(LEARNING_RATE * grad_bias)
    return loss


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    count, epochs = (BATCH_SIZE * 12, 2) if args.tiny else (BATCH_SIZE * 200, 4)
    tf.random.set_seed(SEED)

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ratings.csv")
        write_lines(path, count)
        return train(path, count, epochs)


def train(path, count, epochs):
    lines = tf.data.TextLineDataset(path).batch(BATCH_SIZE)
    staged = stage(
        lines,
        parse,  # runs on up to num_threads batches at once
        capacity=4,
        num_threads=4,
        name="parse",
    )
    print(
        f"{count} lines in {os.path.basename(path)}, batches of "
        f"{BATCH_SIZE}; the stage "
        f"'{staged.name}' parses {staged.stage_options.num_threads} at once "
        f"and buffers up to {staged.stage_options.capacity}."
    )
    print(f"Each batch's read waits {READ_SECONDS * 1e3:.0f} ms.\n")

    before = staged.stats.snapshot()
    for epoch in range(epochs):
        start = time.perf_counter()
        losses = []
        for ids, score in staged:  # policies and timeout apply here
            losses.append(float(train_step(ids, score)))
        seconds = time.perf_counter() - start
        now = staged.stats.snapshot()
        produced = now["produced"] - before["produced"]
        consumed = now["consumed"] - before["consumed"]
        waited = now["wait_seconds"] - before["wait_seconds"]
        busy = now["busy_seconds"] - before["busy_seconds"]
        print(
            f"epoch {epoch}: mean loss {np.mean(losses):.4f}, {consumed} "
            f"batches in {seconds:.2f} s\n  the loop waited {waited:.3f} s "
            f"({waited / seconds:.0%} of the epoch); a batch took "
            f"{busy / produced * 1e3:.1f} ms to prepare on one thread"
        )
        before = now

    snapshot = staged.stats.snapshot()
    print("\nstaged.stats.snapshot() after the last epoch (cumulative):")
    for key in (
        "produced",
        "consumed",
        "skipped",
        "wait_seconds",
        "busy_seconds",
        "buffered_sum",
    ):
        value = snapshot[key]
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"  {key}: {shown}")
    options = staged.stage_options
    print(
        "  finished batches waiting when the loop asked for one, on average: "
        f"{snapshot['buffered_sum'] / max(snapshot['consumed'], 1):.2f}\n"
        f"    (never more than capacity + num_threads = "
        f"{options.capacity + options.num_threads}: the buffer, plus those "
        "finished in the map)"
    )
    closed = staged.close()
    print(f"\nstaged.close() -> {closed} (no helper thread left behind)")
    return 0 if closed else 1


if __name__ == "__main__":
    raise SystemExit(main())
