"""The `featurespace` script with `keras.utils.set_random_seed(0)` first.

A seeded script draws the same shuffles, dropout masks and initial
weights in every process, so its modes differ by keras_stage alone.
"""

import keras

from benchmarks.scripts import featurespace


def run(mode, timer, tiny=False):
    """`featurespace.run` after seeding Python, NumPy and the backend."""
    keras.utils.set_random_seed(0)
    featurespace.run(mode, timer, tiny=tiny)
