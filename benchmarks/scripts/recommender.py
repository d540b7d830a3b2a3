"""keras-rs's deep retrieval model as a subclass, its lookups in its call.

`benchmarks.workloads.recommenders`' `DeepRetrieval`: a query and a
candidate tower, each with its own lookups. "plain" is the script without
keras_stage: on TensorFlow the same subclass on `keras.Model`, its lookups
in the step; on JAX and torch, where Keras cannot take the strings, the
hand split keras-rs's examples use (the lookups in `dataset.map`, the
subclass on the ids). "staged" is the subclass on `keras_stage.Model`
with `smart_stage=True`. `fit` 3 epochs of 40 batches of 256 with 8
validation batches, `evaluate` on 8, `predict` on 4.
"""

import keras

import keras_stage
from benchmarks.scripts import is_staged
from benchmarks.workloads import recommenders

BATCH = 256
# (train, validation, evaluate, predict) batches, then tiny's; the epochs.
SIZES = {False: (40, 8, 8, 4), True: (2, 1, 1, 1)}
EPOCHS = {False: 3, True: 1}


def run(mode, timer, tiny=False):
    """The script in `mode` (see `benchmarks.scripts`)."""
    staged = is_staged(mode)
    parts = [
        recommenders.movielens(count * BATCH, seed)
        for count, seed in zip(SIZES[tiny], (4, 1, 2, 3), strict=True)
    ]
    timer.start()
    hand = not staged and keras.backend.backend() != "tensorflow"
    base = keras_stage.Model if staged else keras.Model
    model = recommenders.build("deep_retrieval", base, preprocessed=hand)
    preprocess = (
        recommenders.preprocessor("deep_retrieval").preprocess if hand else None
    )

    def data(part, seed=None):
        return recommenders.dataset(part, BATCH, seed, preprocess)

    train, val, test, predict = parts
    with timer.measure("fit"):
        model.fit(
            data(train, seed=7),
            epochs=EPOCHS[tiny],
            validation_data=data(val),
            shuffle=False,
            verbose=0,
        )
    with timer.measure("evaluate"):
        model.evaluate(data(test), verbose=0)
    with timer.measure("predict"):
        model.predict(data(predict), verbose=0)
