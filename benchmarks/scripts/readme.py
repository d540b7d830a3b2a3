"""README.md's Example: a hashed string column into an embedding, on arrays.

Copied from the README's Example section; plain drops the three numbered
lines' keras_stage parts (`StagedInput`, `keras_stage.Model`,
`smart_stage=True`, the `PrefetchCallback`) and the two prints about the
stage.
"""

import keras
import numpy as np

import keras_stage
from benchmarks.scripts import is_staged


def run(mode, timer, tiny=False):
    """The README's example in `mode` (see `benchmarks.scripts`)."""
    staged = is_staged(mode)
    rows = 64 if tiny else 256
    epochs = 1 if tiny else 2
    words = np.array([f"word{i % 50}" for i in range(rows)], dtype=object)
    labels = np.random.rand(rows, 1).astype("float32")

    timer.start()
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
    x = keras.layers.Hashing(num_bins=64, name="hash")(x)
    x = keras.layers.Embedding(64, 8, name="emb")(x)
    model_class = keras_stage.Model if staged else keras.Model  # 2
    model = model_class(inputs, keras.layers.Dense(1)(x))
    model.compile(
        optimizer="adam",
        loss="mse",
        **({"smart_stage": True} if staged else {}),
    )
    with timer.measure("fit"):
        history = model.fit(
            words,
            labels,
            batch_size=32,
            epochs=epochs,
            callbacks=(
                [keras_stage.callbacks.PrefetchCallback(verbose=1)]  # 3
                if staged
                else []
            ),
            verbose=2,
        )
    if staged:
        print(model.get_stage_plan().staged_layers)  # [..., 'hash']
        print(history.history["stage_wait_ratio"])
