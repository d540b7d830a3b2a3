"""`images`: JPEG files read, decoded, resized and flipped in the model.

The JPEGs (10 classes of noisy stripes) are written once to a temporary
folder, read back from the page cache as from a warm local disk.
"""

import atexit
import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from benchmarks.workloads.base import Workload

SOURCE, TARGET, CLASSES, MAX_FILES = 128, 64, 10, 2048


class ReadDecodeJpeg(keras.layers.Layer):
    """File paths -> float32 images `(B, 128, 128, 3)` in 0..255."""

    def call(self, paths):
        def read(path):
            image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
            return tf.ensure_shape(image, (SOURCE, SOURCE, 3))

        spec = tf.TensorSpec((SOURCE, SOURCE, 3), tf.uint8)
        images = tf.map_fn(read, paths, fn_output_signature=spec)
        return tf.cast(images, tf.float32)

    def compute_output_spec(self, paths):
        return keras.KerasTensor((paths.shape[0], SOURCE, SOURCE, 3), "float32")


def _write_jpegs(count, seed):
    folder = tempfile.mkdtemp(prefix="keras_stage_images_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, count).astype("int32")
    grid = np.arange(SOURCE, dtype=np.float32)
    paths = []
    for index, label in enumerate(labels):
        angle = np.pi * label / CLASSES
        wave = (
            np.cos(angle) * grid[:, None] + np.sin(angle) * grid[None, :]
        ) * (0.1 + 0.02 * label)
        image = (np.sin(wave)[..., None] + 1) * 100
        image = image + rng.normal(0, 20, (SOURCE, SOURCE, 3))
        image[..., label % 3] += 40
        path = os.path.join(folder, f"{index:05d}.jpg")
        encoded = tf.io.encode_jpeg(np.clip(image, 0, 255).astype(np.uint8))
        tf.io.write_file(path, encoded)
        paths.append(path)
    return paths, labels


class Images(Workload):
    name = "images"
    description = (
        "JPEG files (128x128): path -> read_file + decode_jpeg -> Resizing(64) "
        "-> RandomFlip -> Rescaling(1/255) in the model; CNN Conv(16, 32, 64; "
        "stride 2) -> global average pool -> Dense(10); Adam, sparse "
        "categorical cross-entropy"
    )
    batch_size, steps, quick_steps = 64, 60, 20

    def data(self, rows, seed=0):
        paths, labels = _write_jpegs(min(rows, MAX_FILES), seed)
        cycles = -(-rows // len(paths))  # longer runs cycle through them
        paths = np.array((paths * cycles)[:rows], dtype=object)
        return paths, np.tile(labels, cycles)[:rows]

    def inputs(self):
        return keras.Input(shape=(), dtype="string", name="path")

    def preprocessing(self, adapt):
        read = ReadDecodeJpeg(name="read_decode_jpeg")
        resize = keras.layers.Resizing(TARGET, TARGET)
        flip = keras.layers.RandomFlip("horizontal", seed=0)
        rescale = keras.layers.Rescaling(1 / 255)
        return lambda x: rescale(flip(resize(read(x))))

    def trunk(self, images):
        x = images
        for filters in (16, 32, 64):
            x = keras.layers.Conv2D(filters, 3, 2, "same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.layers.Dense(CLASSES)(x)

    def compile_kwargs(self, learning_rate=1e-3):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return {**super().compile_kwargs(learning_rate), "loss": loss}
