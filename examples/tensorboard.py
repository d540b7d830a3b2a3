"""TensorBoard: the stage's figures as scalars, two ways.

- `keras.callbacks.TensorBoard(log_dir)` writes every epoch log, and the
  `PrefetchCallback` runs first, so the stage's logs are among them:
  `epoch_stage_wait_ratio`, `epoch_stage_buffer_fill`,
  `epoch_stage_skipped` under `log_dir/train`.
- `keras_stage.callbacks.PrefetchCallback(log_dir=log_dir)` writes them
  itself under `log_dir/stage`, with the verdict's figures: `stage/...`
  tags for the per-batch times and the suggested `num_threads` and
  `capacity`.

The script trains a small staged model with both callbacks, then reads the
event files back (with TensorFlow only, no TensorBoard server) and prints
every stage scalar tag it finds, with its value per epoch. Look at them with
`tensorboard --logdir <the folder printed>` (`--keep-logs` keeps it).

Run with `python -m examples.tensorboard` (`--tiny` for a smoke run).
See docs/callback.md#in-tensorboard.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if not __package__:
    # Run as a file (`python examples/tensorboard.py`), its folder comes
    # first on sys.path, and this file's name hides the tensorboard package
    # that tf.summary needs.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402

SEED = 0
READ_SECONDS = 0.005


def slow_parse(lines):
    """A source that takes some time per batch, so the figures move."""

    def read(batch):
        time.sleep(READ_SECONDS)
        return batch

    lines = tf.py_function(read, [lines], tf.string)
    lines.set_shape([None])
    x1, x2, y = tf.io.decode_csv(lines, [[0.0], [0.0], [0.0]])
    return tf.stack([x1, x2], axis=1), y[:, None]


def scalars(folder):
    """{tag: [(step, value), ...]} from the event files in `folder`."""
    found = {}
    for path in sorted(tf.io.gfile.glob(f"{folder}/events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.HasField("tensor"):
                    array = tf.make_ndarray(value.tensor)
                    if array.dtype.kind not in "fiu":
                        continue  # Keras also writes text (the model graph)
                    number = float(array)
                else:
                    number = value.simple_value
                found.setdefault(value.tag, []).append((event.step, number))
    return found


def print_stage_scalars(found, prefix):
    for tag in sorted(found):
        if "stage" not in tag:
            continue
        values = ", ".join(f"{v:.3g}" for _, v in sorted(found[tag]))
        print(f"  {prefix}{tag}: {values}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the log folder"
    )
    args = parser.parse_args(argv)
    num_batches, epochs = (8, 2) if args.tiny else (100, 5)
    keras.utils.set_random_seed(SEED)

    rng = np.random.default_rng(SEED)
    x = rng.random((num_batches * 32, 2))
    lines = [f"{a:.3f},{b:.3f},{a + b:.3f}" for a, b in x]
    data = keras_stage.data.stage(
        tf.data.Dataset.from_tensor_slices(lines).batch(32),
        slow_parse,
        capacity=2,
        num_threads=2,
        name="parse",
    )
    inputs = keras.Input(shape=(2,))
    h = keras_stage.layers.StagedInput()(inputs)  # marks the boundary
    h = keras.layers.Dense(16, activation="relu")(h)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss="mse")

    log_dir = tempfile.mkdtemp(prefix="keras_stage_tensorboard_")
    model.fit(
        data,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras_stage.callbacks.PrefetchCallback(log_dir=log_dir),
            keras.callbacks.TensorBoard(log_dir=log_dir),
        ],
    )
    print(
        f"Trained {epochs} epochs of {num_batches} batches; logs in {log_dir}"
    )
    print("\nkeras.callbacks.TensorBoard, in train/ (one value per epoch):")
    print_stage_scalars(scalars(os.path.join(log_dir, "train")), "train/")
    print("\nPrefetchCallback(log_dir=...), in stage/ (one value per epoch):")
    print_stage_scalars(scalars(os.path.join(log_dir, "stage")), "")
    if args.keep_logs:
        print(f"\ntensorboard --logdir {log_dir}")
    else:
        shutil.rmtree(log_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
