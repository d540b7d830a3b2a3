"""Devices: where a stage's finished batches wait (`device=`, `pack_transfer=`).

On a GPU machine a stage keeps its finished batches on the first GPU by
default (`device="auto"`), copied there ahead of the training step, while
the staged computation always runs on host threads; `pack_transfer` packs a
batch's many small tensors into a few, so the copy is a few large copies.

This script runs anywhere, GPU or not, and prints where the batches are:

1. With the machine's own devices: `device="auto"` keeps the buffer on the
   host when TensorFlow sees no GPU, and an explicit `device="/GPU:0"`
   warns once and keeps it on the host too (a script written for a GPU
   still runs). `pack_transfer=True` then packs nothing: there is no copy
   to save. A Keras model with those options trains exactly like plain
   Keras.
2. Rehearsed on a second logical CPU (`/CPU:1`, made with
   `tf.config.set_logical_device_configuration` before TensorFlow starts),
   the code paths of a GPU: the buffer lives on `/CPU:1`, a Criteo-like
   batch of 39 tensors crosses as 2 packed tensors, `staged.unpack`
   restores it on the device, and a Keras model trains like plain Keras.

Run with `python -m examples.devices` (`--tiny` for a smoke run).
See docs/devices.md.
"""

import argparse
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# Before TensorFlow initialises its devices: a second logical CPU stands in
# for an accelerator in part 2. Part 1 is not affected (still no GPU).
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2,
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stage  # noqa: E402
from keras_stage.data import Packer, resolve_device, stage  # noqa: E402

SEED = 0
NUM_DENSE = 13
NUM_CATEGORICAL = 26
VOCABULARY = 100


def criteo_like(count):
    """A dict of 13 float32 and 26 int64 columns, and a label."""
    rng = np.random.default_rng(SEED)
    dense = rng.normal(size=(count, NUM_DENSE)).astype("float32")
    ids = rng.integers(0, VOCABULARY, (count, NUM_CATEGORICAL))
    x = {f"d{i}": dense[:, i] for i in range(NUM_DENSE)}
    x.update({f"c{i}": ids[:, i] for i in range(NUM_CATEGORICAL)})
    y = dense[:, :1] + (ids[:, :1] % 7).astype("float32") / 7
    return x, y


def build_model(staged_options=None):
    """Embedding + Dense on the 39 columns; staged when options are given."""
    inputs = {f"d{i}": keras.Input((), name=f"d{i}") for i in range(NUM_DENSE)}
    inputs.update(
        {
            f"c{i}": keras.Input((), dtype="int64", name=f"c{i}")
            for i in range(NUM_CATEGORICAL)
        }
    )
    x = inputs
    if staged_options is not None:
        x = keras_stage.layers.StagedInput(**staged_options)(inputs)
    dense = keras.ops.stack([x[f"d{i}"] for i in range(NUM_DENSE)], axis=1)
    ids = keras.ops.stack([x[f"c{i}"] for i in range(NUM_CATEGORICAL)], axis=1)
    emb = keras.layers.Flatten()(keras.layers.Embedding(VOCABULARY, 4)(ids))
    h = keras.layers.Dense(16, activation="relu")(
        keras.layers.Concatenate()([emb, dense])
    )
    outputs = keras.layers.Dense(1)(h)
    model_class = keras.Model if staged_options is None else keras_stage.Model
    model = model_class(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def trains_like_plain_keras(staged_options, x, y, epochs):
    """Fits plain and staged twins from the same weights; compares them."""
    keras.utils.set_random_seed(SEED)
    plain = build_model()
    staged = build_model(staged_options)
    staged.set_weights(plain.get_weights())
    for model in (plain, staged):
        model.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0)
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(plain.get_weights(), staged.get_weights(), strict=True)
    )


def where(element):
    """The devices holding an element's tensors, as "/CPU:0"."""
    specs = {
        tf.DeviceSpec.from_string(t.device) for t in tf.nest.flatten(element)
    }
    return sorted(f"/{s.device_type}:{s.device_index}" for s in specs)


def on_this_machine(x, y, epochs):
    print("1. This machine's own devices")
    gpus = tf.config.list_physical_devices("GPU")
    print(f"  GPUs TensorFlow sees: {len(gpus)}")
    print(f"  resolve_device('auto') -> {resolve_device('auto')!r} (the host)")
    lines = tf.data.Dataset.from_tensor_slices(["1", "2", "3", "4"]).batch(2)

    def parse(batch):
        return tf.strings.to_number(batch)

    staged = stage(lines, parse, capacity=2, num_threads=2, name="auto")
    print(
        f"  stage(..., device='auto'): staged.device={staged.device!r}; "
        f"batches on {where(list(staged))}"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        staged = stage(
            lines, parse, device="/GPU:0", pack_transfer=True, name="gpu"
        )
    for warning in caught:
        print(f"  warning: {warning.message}")
    print(
        f"  stage(..., device='/GPU:0', pack_transfer=True): "
        f"staged.device={staged.device!r}, staged.packed={staged.packed}; "
        f"batches on {where(list(staged))}"
    )
    options = {"device": "/GPU:0", "pack_transfer": True, "capacity": 2}
    diff = trains_like_plain_keras(options, x, y, epochs)
    print(
        f"  StagedInput(device='/GPU:0', pack_transfer=True) vs plain Keras, "
        f"same start: max |weight difference| {diff:.2g}"
    )
    return diff


def on_a_logical_device(x, y, epochs):
    print("\n2. A device buffer, rehearsed on a second logical CPU")
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    print(f"  logical CPUs: {names}")
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    staged = stage(batches, capacity=2, num_threads=2, device="/CPU:1")
    features, _ = next(iter(staged))
    print(
        f"  stage(..., device='/CPU:1'): staged.device={staged.device!r}; "
        f"a batch's 39 columns are on {where(features)}"
    )

    packer = Packer(batches.element_spec)
    print(
        f"  Packer: a batch (39 columns and the label) is "
        f"{packer.num_tensors} tensors; packed, {packer.num_packed_tensors} "
        "(the numeric leaves bit-cast into one, plus the dynamic shapes)"
    )
    staged = stage(
        batches, capacity=2, num_threads=2, device="/CPU:1", pack_transfer=True
    )
    packed = next(iter(staged))
    print(
        f"  stage(..., device='/CPU:1', pack_transfer=True): "
        f"staged.packed={staged.packed}; it yields "
        f"{len(tf.nest.flatten(packed))} tensors on {where(packed)}"
    )
    features, label = staged.unpack(packed)
    expected, expected_label = next(iter(batches))
    same = all(
        np.array_equal(features[k].numpy(), expected[k].numpy())
        for k in expected
    ) and np.array_equal(label.numpy(), expected_label.numpy())
    print(
        f"  staged.unpack(element): {len(features)} columns and the label "
        f"on {where((features, label))}; equal to the unstaged batch: {same}"
    )
    options = {"device": "/CPU:1", "capacity": 2, "num_threads": 2}
    diff = trains_like_plain_keras(options, x, y, epochs)
    print(
        "  StagedInput(device='/CPU:1') (pack_transfer='auto' packs for "
        f"Keras) vs plain Keras: max |weight difference| {diff:.2g}"
    )
    return same, diff


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    count, epochs = (256, 1) if args.tiny else (8192, 3)
    keras.utils.set_random_seed(SEED)
    x, y = criteo_like(count)
    host_diff = on_this_machine(x, y, epochs)
    same, device_diff = on_a_logical_device(x, y, epochs)
    return 0 if same and max(host_diff, device_diff) < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
