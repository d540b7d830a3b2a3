"""The `io` environment: tensorflow-io sources go through a stage.

Runs where tensorflow-io's native ops load (tensorflow-cpu 2.16.2 +
tensorflow-io 0.37.1, `make test-io`); skipped elsewhere, and required
when `KERAS_STAGE_ENV=io` says this is the io environment.
"""

import os

import numpy as np
import pytest

import keras_stage

if os.environ.get("KERAS_STAGE_ENV") == "io":
    import tensorflow_io as tfio
else:
    tfio = pytest.importorskip("tensorflow_io")
h5py = pytest.importorskip("h5py")


@pytest.mark.io
@pytest.mark.timeout(120)
def test_hdf5_iodataset_is_staged(tmp_path):
    path = str(tmp_path / "x.h5")
    values = np.arange(20, dtype=np.float32).reshape(10, 2)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=values)
    source = tfio.IODataset.from_hdf5(path, dataset="/x").batch(4)
    staged = keras_stage.data.stage(
        source, lambda b: b * 2, capacity=2, num_threads=2
    )
    got = np.concatenate([b.numpy() for b in staged])
    np.testing.assert_array_equal(got, values * 2)
    assert staged.stats.snapshot()["consumed"] == 3
