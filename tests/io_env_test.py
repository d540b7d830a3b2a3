"""The `io` environment: tensorflow-io sources and decode ops in a stage.

Runs where tensorflow-io's native ops load (tensorflow-cpu 2.16.2 +
tensorflow-io 0.37.1, `make test-io`); skipped elsewhere, and required
when `KERAS_STAGE_ENV=io` says this is the io environment. Every input
file (HDF5, Parquet, WAV, TIFF) is written by the test itself.

The fit tests build the same model twice with the same initial weights:
a `keras_stage.Model` (StagedInput first, smart_stage=True, a
PrefetchCallback) and a plain `keras.Model` without the StagedInput; both
are seeded alike right before `fit` on the same unshuffled data.
"""

import io
import os
import wave

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.data.tfio_support import (
    explain_tfio_error,
    read_hdf5,
    read_parquet,
    require_tensorflow_io,
)
from keras_stage.layers import StagedInput

if os.environ.get("KERAS_STAGE_ENV") == "io":
    # Required here: a tfio that does not load is an error, not a skip.
    tfio = require_tensorflow_io()
    import h5py
    import pyarrow
    import pyarrow.parquet
    from PIL import Image
else:
    try:
        tfio = require_tensorflow_io()
    except ImportError as e:
        pytest.skip(
            f"needs the io environment (make test-io): {e}",
            allow_module_level=True,
        )
    h5py = pytest.importorskip("h5py")
    pyarrow = pytest.importorskip("pyarrow")
    pytest.importorskip("pyarrow.parquet")
    Image = pytest.importorskip("PIL.Image")

FIT_SEED = 11
_rng = np.random.default_rng(0)
N = 20  # not a multiple of the batch size: a partial last batch
FEATURES = _rng.normal(size=(N, 3)).astype("float32")
TARGETS = _rng.normal(size=(N,)).astype("float32")
BATCH = 8
# tfio datasets do not know their length, and Keras warns "Your input ran
# out of data" at each epoch's end of such a dataset (plain Keras too):
# the fits tell it.
KNOWN_BATCHES = tf.data.experimental.assert_cardinality(-(-N // BATCH))


def _write_parquet(path, columns):
    table = pyarrow.table(columns)
    pyarrow.parquet.write_table(table, path)


def _write_hdf5(path, datasets):
    with h5py.File(path, "w") as f:
        for name, values in datasets.items():
            f.create_dataset(name, data=values)


def _fit_twins(build, dataset, epochs=3):
    """Fits a staged and a plain twin on `dataset`; returns both, fitted."""
    staged, plain = build(staged=True), build(staged=False)
    initial = staged.get_weights()
    plain.set_weights(initial)
    staged.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", smart_stage=True
    )
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    callback = keras_stage.callbacks.PrefetchCallback()
    keras.utils.set_random_seed(FIT_SEED)
    h_staged = staged.fit(
        dataset, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback]
    ).history
    keras.utils.set_random_seed(FIT_SEED)
    h_plain = plain.fit(dataset, epochs=epochs, shuffle=False, verbose=0)
    np.testing.assert_allclose(
        h_staged["loss"], h_plain.history["loss"], rtol=1e-6, atol=1e-7
    )
    for a, b in zip(staged.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    trained = staged.get_weights()
    changed = zip(trained, initial, strict=True)
    assert any(not np.array_equal(a, b) for a, b in changed)
    # The data went through the stage, which reported on every epoch.
    assert len(h_staged["stage_wait_ratio"]) == epochs
    assert h_staged["stage_skipped"] == [0] * epochs
    return staged, plain


def _staged_input(inputs):
    return StagedInput(capacity=2, num_threads=2, name="stage")(inputs)


def _tabular_model(staged):
    """Normalization and Rescaling (stageable) before two Dense layers."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(3,), name="x")
    x = _staged_input(inputs) if staged else inputs
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(FEATURES)
    x = keras.layers.Rescaling(0.5, name="rescale")(norm(x))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    if staged:
        return keras_stage.Model(inputs, outputs)
    return keras.Model(inputs, outputs)


@pytest.mark.io
@pytest.mark.timeout(120)
def test_hdf5_iodataset_is_staged(tmp_path):
    path = str(tmp_path / "x.h5")
    values = np.arange(20, dtype=np.float32).reshape(10, 2)
    _write_hdf5(path, {"x": values})
    source = tfio.IODataset.from_hdf5(path, dataset="/x").batch(4)
    staged = keras_stage.data.stage(
        source, lambda b: b * 2, capacity=2, num_threads=2
    )
    got = np.concatenate([b.numpy() for b in staged])
    np.testing.assert_array_equal(got, values * 2)
    assert staged.stats.snapshot()["consumed"] == 3


@pytest.mark.io
@pytest.mark.timeout(120)
def test_parquet_iodataset_is_staged(tmp_path):
    path = str(tmp_path / "rows.parquet")
    ids = np.arange(10, dtype=np.int64) * 7
    scores = np.linspace(-1, 1, 10).astype(np.float32)
    weights = np.arange(10, dtype=np.float64) / 3
    _write_parquet(path, {"id": ids, "score": scores, "weight": weights})
    source = tfio.IODataset.from_parquet(path).batch(4)
    # tfio keys the columns it lists itself by bytes.
    staged = keras_stage.data.stage(
        source,
        lambda b: (b[b"id"] + 1, b[b"score"] * 2, b[b"weight"]),
        capacity=2,
        num_threads=2,
    )
    batches = [[t.numpy() for t in b] for b in staged]
    got = [np.concatenate(column) for column in zip(*batches, strict=True)]
    np.testing.assert_array_equal(got[0], ids + 1)
    assert got[1].dtype == np.float32
    np.testing.assert_array_equal(got[1], scores * 2)
    np.testing.assert_array_equal(got[2], weights)
    assert staged.stats.snapshot()["consumed"] == 3


@pytest.mark.io
@pytest.mark.timeout(120)
def test_read_parquet_keys_columns_by_name(tmp_path):
    path = str(tmp_path / "rows.parquet")
    ids = np.arange(6, dtype=np.int64)
    scores = (np.arange(6) / 4).astype(np.float32)
    _write_parquet(path, {"id": ids, "score": scores})
    rows = read_parquet(path)
    assert list(rows.element_spec) == ["id", "score"]
    staged = keras_stage.data.stage(rows.batch(4), capacity=2, num_threads=2)
    got = list(staged)
    np.testing.assert_array_equal(
        np.concatenate([b["id"].numpy() for b in got]), ids
    )
    np.testing.assert_array_equal(
        np.concatenate([b["score"].numpy() for b in got]), scores
    )
    only = read_parquet(path, columns=["score"])
    assert list(only.element_spec) == ["score"]
    np.testing.assert_array_equal([r["score"].numpy() for r in only], scores)


@pytest.mark.io
@pytest.mark.timeout(120)
def test_read_hdf5_zips_datasets_by_name(tmp_path):
    path = str(tmp_path / "data.h5")
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    y = np.arange(8, dtype=np.int64) * 10
    _write_hdf5(path, {"x": x, "y": y})
    rows = read_hdf5(path, ["/x", "/y"])
    staged = keras_stage.data.stage(
        rows.batch(3),
        lambda b: {"x": b["x"] - 1, "y": b["y"]},
        capacity=2,
        num_threads=2,
    )
    got = list(staged)
    np.testing.assert_array_equal(
        np.concatenate([b["x"].numpy() for b in got]), x - 1
    )
    np.testing.assert_array_equal(
        np.concatenate([b["y"].numpy() for b in got]), y
    )
    with pytest.raises(ValueError, match="argument `datasets`"):
        read_hdf5(path, "/x")


@pytest.mark.io
@pytest.mark.timeout(300)
def test_staged_fit_on_parquet_equals_plain_keras(tmp_path):
    path = str(tmp_path / "train.parquet")
    columns = {f"f{i}": FEATURES[:, i] for i in range(3)}
    _write_parquet(path, {**columns, "y": TARGETS})
    source = tfio.IODataset.from_parquet(path, columns=["f0", "f1", "f2", "y"])
    dataset = (
        source.batch(BATCH)
        .map(
            lambda b: (
                tf.stack([b["f0"], b["f1"], b["f2"]], axis=-1),
                b["y"][:, None],
            )
        )
        .apply(KNOWN_BATCHES)
    )
    staged, _ = _fit_twins(_tabular_model, dataset)
    assert staged.get_stage_plan().staged_layers == ["stage", "norm", "rescale"]


@pytest.mark.io
@pytest.mark.timeout(300)
def test_staged_fit_on_hdf5_equals_plain_keras(tmp_path):
    path = str(tmp_path / "train.h5")
    _write_hdf5(path, {"x": FEATURES, "y": TARGETS[:, None]})
    dataset = tf.data.Dataset.zip(
        (
            tfio.IODataset.from_hdf5(path, dataset="/x"),
            tfio.IODataset.from_hdf5(path, dataset="/y"),
        )
    ).batch(BATCH)
    dataset = dataset.apply(KNOWN_BATCHES)
    staged, _ = _fit_twins(_tabular_model, dataset)
    assert staged.get_stage_plan().staged_layers == ["stage", "norm", "rescale"]


SAMPLES = 16
AUDIO = _rng.integers(-3000, 3000, size=(N, SAMPLES)).astype("<i2")


def _wav_bytes(samples):
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(8000)
        f.writeframes(samples.tobytes())
    return buffer.getvalue()


def _decode_wavs(batch):
    """A batch of WAV file contents -> float32 samples in [-1, 1)."""

    def one(contents):
        audio = tfio.audio.decode_wav(contents, dtype=tf.int16)[:, 0]
        return tf.ensure_shape(audio, [SAMPLES])

    audio = tf.map_fn(
        one, batch, fn_output_signature=tf.TensorSpec([SAMPLES], tf.int16)
    )
    return tf.cast(audio, tf.float32) / 32768.0


def _audio_model(staged):
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(), dtype="string", name="wav")
    x = _staged_input(inputs) if staged else inputs
    x = keras.layers.Lambda(
        _decode_wavs, output_shape=(SAMPLES,), name="decode"
    )(x)
    x = keras.layers.Dense(4, activation="tanh", name="hidden")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    if staged:
        return keras_stage.Model(inputs, outputs)
    return keras.Model(inputs, outputs)


def _plan_text(model):
    lines = []
    model.stage_summary(print_fn=lines.append)
    return "\n".join(lines)


@pytest.mark.io
@pytest.mark.timeout(300)
def test_decode_wav_is_staged_and_trains_like_plain_keras(tmp_path):
    paths = []
    for i, samples in enumerate(AUDIO):
        path = tmp_path / f"clip{i}.wav"
        path.write_bytes(_wav_bytes(samples))
        paths.append(str(path))
    files = tf.data.Dataset.from_tensor_slices(paths).map(tf.io.read_file)
    targets = tf.data.Dataset.from_tensor_slices(TARGETS[:, None])
    dataset = tf.data.Dataset.zip((files, targets)).batch(BATCH)

    decoded = _decode_wavs(next(iter(files.batch(N))))
    np.testing.assert_array_equal(decoded, AUDIO / np.float32(32768.0))

    staged, plain = _fit_twins(_audio_model, dataset)
    plan = staged.get_stage_plan()
    assert plan.staged_layers == ["stage", "decode"]
    assert plan.trunk_layers == ["hidden", "head"]
    assert [(b.name, b.dtype, b.shape) for b in plan.boundary] == [
        ("decode", "float32", (None, SAMPLES))
    ]
    assert "decode (Lambda)" in _plan_text(staged)
    np.testing.assert_allclose(
        staged.predict(files.batch(BATCH), verbose=0),
        plain.predict(files.batch(BATCH), verbose=0),
        rtol=1e-6,
        atol=1e-7,
    )


HEIGHT, WIDTH = 5, 6
IMAGES = _rng.integers(0, 256, size=(N, HEIGHT, WIDTH, 3), dtype=np.uint8)


def _decode_tiffs(batch):
    """A batch of TIFF file contents -> uint8 RGB images."""

    def one(contents):
        rgba = tfio.experimental.image.decode_tiff(contents)
        return tf.ensure_shape(rgba[..., :3], [HEIGHT, WIDTH, 3])

    return tf.map_fn(
        one,
        batch,
        fn_output_signature=tf.TensorSpec([HEIGHT, WIDTH, 3], tf.uint8),
    )


def _image_model(staged):
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(), dtype="string", name="tiff")
    x = _staged_input(inputs) if staged else inputs
    x = keras.layers.Lambda(
        _decode_tiffs, output_shape=(HEIGHT, WIDTH, 3), name="decode"
    )(x)
    x = keras.layers.Rescaling(1 / 255, name="rescale")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    if staged:
        return keras_stage.Model(inputs, outputs)
    return keras.Model(inputs, outputs)


@pytest.mark.io
@pytest.mark.timeout(300)
def test_decode_tiff_is_staged_and_trains_like_plain_keras(tmp_path):
    paths = []
    for i, image in enumerate(IMAGES):
        path = tmp_path / f"image{i}.tiff"
        Image.fromarray(image).save(path, format="TIFF")
        paths.append(str(path))
    files = tf.data.Dataset.from_tensor_slices(paths).map(tf.io.read_file)
    targets = tf.data.Dataset.from_tensor_slices(TARGETS[:, None])
    dataset = tf.data.Dataset.zip((files, targets)).batch(BATCH)

    decoded = _decode_tiffs(next(iter(files.batch(N))))
    np.testing.assert_array_equal(decoded, IMAGES)

    staged, _ = _fit_twins(_image_model, dataset)
    plan = staged.get_stage_plan()
    assert plan.staged_layers == ["stage", "decode", "rescale", "flatten"]
    assert plan.trunk_layers == ["head"]
    assert "decode (Lambda)" in _plan_text(staged)


@pytest.mark.io
@pytest.mark.timeout(120)
def test_require_tensorflow_io_returns_the_loaded_module():
    import tensorflow_io

    assert require_tensorflow_io() is tensorflow_io
    # A tfio op that loaded and then failed on its input is not a load
    # failure.
    with pytest.raises(tf.errors.OpError) as info:
        tfio.audio.decode_wav(b"not a wav file", dtype=tf.int16)
    assert explain_tfio_error(info.value) is None
