"""README.md's Example: a hashed string column into an embedding, on arrays.

Plain drops the keras_stage parts of its numbered lines.
"""

import keras
import numpy as np

import keras_stage


def run(staged, timer, tiny=False):
    """The script (see `benchmarks.scripts`)."""
    rows = 64 if tiny else 2048
    words = np.array([f"word{i % 50}" for i in range(rows)], dtype=object)
    labels = np.random.rand(rows, 1).astype("float32")

    timer.start()
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
    x = keras.layers.Hashing(num_bins=64, name="hash")(x)
    x = keras.layers.Embedding(64, 8, name="emb")(x)
    model_class = keras_stage.Model if staged else keras.Model  # 2
    model = model_class(inputs, keras.layers.Dense(1)(x))
    smart_stage = {"smart_stage": True} if staged else {}  # 2
    model.compile(optimizer="adam", loss="mse", **smart_stage)
    callbacks = [keras_stage.callbacks.PrefetchCallback(verbose=1)]  # 3
    with timer.measure("fit"):
        history = model.fit(
            words,
            labels,
            batch_size=32,
            epochs=1 if tiny else 2,
            callbacks=callbacks if staged else [],  # 3
            verbose=2,
        )
    if staged:  # 3
        print(model.get_stage_plan().staged_layers)  # 3
        print(history.history["stage_wait_ratio"])  # 3
