"""The `none` workload: nothing to stage, so only the overhead shows.

Dense float features already in memory feed an MLP directly: there is no
preprocessing, so a stage has nothing to hide and every mode should train
at the same speed. The differences are the cost of the machinery (the
stage's counters, threads and policies; the expert mode's prefetch).
"""

import keras
import numpy as np

from benchmarks.workloads.base import Workload, scaled

NUM_FEATURES = 64


class NoneWorkload(Workload):
    """In-memory dense features -> MLP; no preprocessing at all."""

    name = "none"
    description = (
        f"nothing to stage: {NUM_FEATURES} dense float32 features in memory "
        "-> Dense(256) x 2 -> Dense(1); Adam, MSE"
    )
    default_batch_size = 256
    default_steps = 400
    quick_steps = 150
    # Its target (3% of a short step) is smaller than the spread of single
    # repetitions of one mode: more repetitions settle it.
    reps_factor = 3
    widths = (256, 256)

    def make_raw_data(self):
        rng = np.random.default_rng(self.seed)
        count = self.steps * self.batch_size
        x = rng.normal(size=(count, NUM_FEATURES)).astype("float32")
        y = (x[:, :8].sum(axis=1, keepdims=True) > 0).astype("float32")
        return x, y

    def raw_inputs(self):
        return keras.Input(shape=(NUM_FEATURES,), name="features")

    def preprocessing(self):
        return []

    def trunk(self, features):
        x = features
        for width in self.widths:
            x = keras.layers.Dense(
                scaled(width, self.trunk_scale), activation="relu"
            )(x)
        return keras.layers.Dense(1)(x)

    def params(self):
        return {
            "num_features": NUM_FEATURES,
            "widths": [scaled(w, self.trunk_scale) for w in self.widths],
        }
