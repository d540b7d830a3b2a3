"""The `images` workload: JPEG files read, decoded and augmented in-model.

The model's input is a file path. `ReadDecodeJpeg` reads each file
(`tf.io.read_file`) and decodes it (`tf.io.decode_jpeg`), then Keras's
`Resizing`, `RandomFlip` and `Rescaling` layers resize and augment the
batch, and a small CNN classifies it. The JPEGs are generated
deterministically (10 classes of striped patterns with noise) and written
to a temporary folder when the data is first made; they are read back from
the OS page cache, as a warm local disk would serve them.
"""

import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from benchmarks.workloads.base import Workload, scaled

SOURCE_SIZE = 128
TARGET_SIZE = 64
NUM_CLASSES = 10
# Distinct files written at most; longer runs cycle through them.
MAX_FILES = 2048


def make_image(label, rng):
    """One `SOURCE_SIZE`-square RGB uint8 image of class `label`."""
    grid = np.arange(SOURCE_SIZE, dtype=np.float32)
    angle = np.pi * label / NUM_CLASSES
    stripes = np.sin(
        (np.cos(angle) * grid[:, None] + np.sin(angle) * grid[None, :])
        * (0.1 + 0.02 * label)
    )
    base = (stripes[..., None] + 1) * 100 + rng.normal(
        0, 20, (SOURCE_SIZE, SOURCE_SIZE, 3)
    )
    base[..., label % 3] += 40
    return np.clip(base, 0, 255).astype(np.uint8)


def write_jpegs(folder, count, seed):
    """Writes `count` deterministic JPEGs into `folder`.

    Returns:
        `(paths, labels)`: a list of str and an int32 array `(count,)`.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, count).astype("int32")
    paths = []
    for index, label in enumerate(labels):
        path = os.path.join(folder, f"{index:05d}_{label}.jpg")
        encoded = tf.io.encode_jpeg(make_image(int(label), rng), quality=90)
        with open(path, "wb") as f:
            f.write(encoded.numpy())
        paths.append(path)
    return paths, labels


class ReadDecodeJpeg(keras.layers.Layer):
    """File paths -> decoded images, float32 `(B, size, size, 3)` in 0..255.

    Args:
        size: Height and width of the stored images (all the same size).
        **kwargs: Passed to `keras.layers.Layer`.
    """

    def __init__(self, size=SOURCE_SIZE, **kwargs):
        super().__init__(**kwargs)
        self.size = size

    def _read_one(self, path):
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        image.set_shape((self.size, self.size, 3))
        return image

    def call(self, paths):
        images = tf.map_fn(
            self._read_one,
            paths,
            fn_output_signature=tf.TensorSpec(
                (self.size, self.size, 3), tf.uint8
            ),
        )
        return tf.cast(images, tf.float32)

    def compute_output_spec(self, paths):
        # Keras cannot infer an image output from a string input by itself.
        return keras.KerasTensor(
            (paths.shape[0], self.size, self.size, 3), "float32"
        )

    def get_config(self):
        return {**super().get_config(), "size": self.size}


class ImagesWorkload(Workload):
    """JPEG paths -> read, decode, resize, flip, rescale -> small CNN."""

    name = "images"
    description = (
        f"JPEG files ({SOURCE_SIZE}x{SOURCE_SIZE}) in a temp folder: path -> "
        "tf.io.read_file + decode_jpeg (ReadDecodeJpeg) -> "
        f"Resizing({TARGET_SIZE}, {TARGET_SIZE}) -> RandomFlip -> "
        "Rescaling(1/255) in the model; CNN Conv(16, 32, 64; stride 2) -> "
        "global average pool -> Dense(10); Adam, sparse categorical "
        "cross-entropy"
    )
    default_batch_size = 64
    default_steps = 60
    quick_steps = 20
    # Its 5% target ("no slower than expert") is smaller than the spread
    # of single repetitions of a mode: more repetitions settle it.
    reps_factor = 3
    filters = (16, 32, 64)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._temporary = None

    def make_raw_data(self):
        count = self.steps * self.batch_size
        folder = self.data_dir
        if folder is None:
            self._temporary = tempfile.mkdtemp(prefix="keras_stage_images_")
            folder = self._temporary
        else:
            os.makedirs(folder, exist_ok=True)
        paths, labels = write_jpegs(folder, min(count, MAX_FILES), self.seed)
        cycles = -(-count // len(paths))
        paths = (paths * cycles)[:count]
        labels = np.tile(labels, cycles)[:count]
        return np.array(paths, dtype=object), labels

    def raw_inputs(self):
        return keras.Input(shape=(), dtype="string", name="path")

    def preprocessing(self):
        return [
            ReadDecodeJpeg(SOURCE_SIZE, name="read_decode_jpeg"),
            keras.layers.Resizing(TARGET_SIZE, TARGET_SIZE, name="resize"),
            keras.layers.RandomFlip(
                "horizontal", seed=self.seed, name="random_flip"
            ),
            keras.layers.Rescaling(1 / 255, name="rescale"),
        ]

    def trunk(self, images):
        x = images
        for filters in self.filters:
            x = keras.layers.Conv2D(
                scaled(filters, self.trunk_scale),
                3,
                strides=2,
                padding="same",
                activation="relu",
            )(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.layers.Dense(NUM_CLASSES)(x)

    def compile_kwargs(self):
        return {
            "optimizer": keras.optimizers.Adam(1e-3),
            "loss": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True
            ),
        }

    def params(self):
        return {
            "source_size": SOURCE_SIZE,
            "target_size": TARGET_SIZE,
            "distinct_files": min(self.steps * self.batch_size, MAX_FILES),
            "filters": [scaled(f, self.trunk_scale) for f in self.filters],
        }

    def close(self):
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
        self._raw = None
