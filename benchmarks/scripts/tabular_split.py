"""keras.io's structured-data model, where plain Keras cannot fit it whole.

On JAX and torch plain Keras cannot fit string inputs, so a user splits
the model by hand: in mode "plain" the preprocessing layers run in
`dataset.map`, a numeric `keras.Model` of the trunk trains
(`benchmarks.jax_backend`'s expert); "staged" is the whole model with
keras_stage's three lines. `fit` 3 epochs of 100 batches with 20
validation batches every epoch, `evaluate` on 20, `predict` on 8, from
`tf.data` datasets of `benchmarks.jax_backend`'s `tabular` workload
(`criteo_split`: its `criteo`, 50, 10, 10 and 4 batches). Runs on every
backend.
"""

import keras
import tensorflow as tf

import keras_stage
from benchmarks import jax_backend
from benchmarks.scripts import is_staged

# (train, validation, evaluate, predict) batches, then tiny's; the epochs.
SIZES = {
    "tabular": (100, 20, 20, 8),
    "criteo": (50, 10, 10, 4),
    "tiny": (2, 1, 1, 1),
}
EPOCHS = {False: 3, True: 1}


def run(mode, timer, tiny=False):
    """The script in `mode` (see `benchmarks.scripts`)."""
    script("tabular", mode, timer, tiny)


def script(name, mode, timer, tiny=False):
    """`run` of `benchmarks.jax_backend`'s workload `name`."""
    staged = is_staged(mode)
    workload = jax_backend.WORKLOADS[name]
    keras.utils.set_random_seed(jax_backend.SEED)
    size = workload.batch_size
    # `benchmarks.regimes`' seeds of its val_train, val, eval and predict
    # parts.
    batches = SIZES["tiny" if tiny else name]
    (train_x, train_y), val, test, (predict_x, _) = [
        workload.make_data(count * size, seed)
        for count, seed in zip(batches, (4, 1, 2, 3), strict=True)
    ]
    train_ds = (
        tf.data.Dataset.from_tensor_slices((train_x, train_y))
        .shuffle(len(train_y))
        .batch(size)
    )
    val_ds = tf.data.Dataset.from_tensor_slices(val).batch(size)
    test_ds = tf.data.Dataset.from_tensor_slices(test).batch(size)
    predict_ds = tf.data.Dataset.from_tensor_slices(predict_x).batch(size)

    timer.start()
    if staged:
        inputs = workload.inputs()
        x = keras_stage.layers.StagedInput()(inputs)  # 1
        outputs = workload.trunk(workload.columns(x, train_x))
        model = keras_stage.Model(inputs, outputs)  # 2
        model.compile(**workload.compile_kwargs(), smart_stage=True)  # 3
    else:
        preprocess = jax_backend.hand_preprocess(workload, (train_x, train_y))

        def split(dataset, labels=True):
            return dataset.map(
                # A tuple of columns alone would read as (x, y, ...).
                (lambda x, y: (preprocess(x), y))
                if labels
                else (lambda x: (preprocess(x),)),
                num_parallel_calls=tf.data.AUTOTUNE,
            ).prefetch(tf.data.AUTOTUNE)

        train_ds, val_ds, test_ds = map(split, (train_ds, val_ds, test_ds))
        predict_ds = split(predict_ds, labels=False)
        model = jax_backend.hand_trunk(workload, train_ds)
    with timer.measure("fit"):
        model.fit(
            train_ds, epochs=EPOCHS[tiny], validation_data=val_ds, verbose=0
        )
    with timer.measure("evaluate"):
        model.evaluate(test_ds, verbose=0)
    with timer.measure("predict"):
        model.predict(predict_ds, verbose=0)
