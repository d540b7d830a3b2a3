"""keras.io's "Structured data classification with FeatureSpace".

The example's script on the `featurespace` workload's rows, as one model fed
the raw dicts. `seeded`: `keras.utils.set_random_seed(0)` first. `split`
(seeded; any backend): plain is the example as written, the `FeatureSpace`
in `dataset.map`.
"""

import keras
import tensorflow as tf

import keras_stage
from benchmarks.modes import Built
from benchmarks.workloads import workload


def run(staged, timer, tiny=False, seeded=False, split=False):
    """The script (see `benchmarks.scripts`)."""
    if seeded or split:
        keras.utils.set_random_seed(0)
    work = workload("featurespace")
    train_x, train_y = work.data(40 if tiny else work.train_rows, seed=7)
    val_x, val_y = work.data(10 if tiny else work.val_rows, seed=8)
    train = tf.data.Dataset.from_tensor_slices((train_x, train_y))
    train = train.shuffle(buffer_size=len(train_y)).batch(32)
    val = tf.data.Dataset.from_tensor_slices((val_x, val_y)).batch(32)
    # The patient as tensors: torch has no string tensors.
    sample = {name: tf.constant(column[:1]) for name, column in val_x.items()}

    timer.start()
    if split and not staged:  # split
        encode, model = work.split(train_x)
        model.compile(**work.compile_kwargs())
        train, val = map(Built(model, "expert", encode).feed, (train, val))
        sample = encode(sample)
    else:
        inputs = work.inputs()
        x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
        predictions = work.trunk(work.preprocessing(train_x)(x))
        model_class = keras_stage.Model if staged else keras.Model  # 2
        model = model_class(inputs=inputs, outputs=predictions)
        smart_stage = {"smart_stage": True} if staged else {}  # 3
        model.compile(**work.compile_kwargs(), **smart_stage)
    epochs = 1 if tiny else 20
    with timer.measure("fit"):
        model.fit(train, epochs=epochs, validation_data=val, verbose=2)
    with timer.measure("predict"):
        predictions = model.predict(sample)
    print(f"This patient: {100 * predictions[0][0]:.1f}% probability.")
