"""A criteo-like script: TSV lines parsed and hashed in the model.

`benchmarks.regimes`' criteo model (`CriteoModel`: the `criteo`
workload's parsing, hashing and DLRM-like trunk, batch 128) and data:
`fit` 3 epochs of 100 batches with 20 validation batches every epoch,
`evaluate` on 20 batches, `predict` on 8, all from `tf.data` datasets,
seeded as the regimes seed theirs (`criteo_holdout`: with a second
`evaluate`, on a holdout set).
"""

import keras
import tensorflow as tf

import keras_stage
from benchmarks import regimes
from benchmarks.scripts import is_staged

SPEC = regimes.CriteoModel()
# Full size, then `tiny`: (train, validation, evaluate, predict) batches
# and epochs.
SIZES = {False: ((100, 20, 20, 8), 3), True: ((2, 1, 1, 1), 1)}


def run(mode, timer, tiny=False):
    """The script in `mode` (see `benchmarks.scripts`)."""
    script(mode, timer, tiny)


def script(mode, timer, tiny=False, holdout=False):
    """`run`; with `holdout`, a second `evaluate` after the first (as many
    batches, of other rows)."""
    staged = is_staged(mode)
    keras.utils.set_random_seed(regimes.SEED)
    batches, epochs = SIZES[tiny]
    batch_size = SPEC.batch_size
    # `benchmarks.regimes`' seeds of its val_train, val, eval and predict
    # parts.
    parts = [
        SPEC.make_data(count * batch_size, seed)
        for count, seed in zip(batches, (4, 1, 2, 3), strict=True)
    ]
    (train_x, train_y), val, test, (predict_x, _) = parts
    train_ds = (
        tf.data.Dataset.from_tensor_slices((train_x, train_y))
        .shuffle(len(train_y))
        .batch(batch_size)
    )
    val_ds = tf.data.Dataset.from_tensor_slices(val).batch(batch_size)
    test_ds = tf.data.Dataset.from_tensor_slices(test).batch(batch_size)
    predict_ds = tf.data.Dataset.from_tensor_slices(predict_x).batch(batch_size)
    if holdout:
        # Rows no other part has (the regimes' seeds are 1 to 4).
        holdout_ds = tf.data.Dataset.from_tensor_slices(
            SPEC.make_data(batches[2] * batch_size, 5)
        ).batch(batch_size)

    timer.start()
    inputs = SPEC.inputs()
    x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
    outputs = SPEC.trunk(SPEC.features(x, None))
    model_class = keras_stage.Model if staged else keras.Model  # 2
    model = model_class(inputs, outputs)
    model.compile(
        **SPEC.compile_kwargs(),
        **({"smart_stage": True} if staged else {}),  # 3
    )
    with timer.measure("fit"):
        model.fit(train_ds, epochs=epochs, validation_data=val_ds, verbose=0)
    with timer.measure("evaluate"):
        model.evaluate(test_ds, verbose=0)
    if holdout:
        with timer.measure("evaluate_holdout"):
            model.evaluate(holdout_ds, verbose=0)
    with timer.measure("predict"):
        model.predict(predict_ds, verbose=0)
