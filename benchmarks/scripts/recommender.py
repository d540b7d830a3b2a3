"""keras-rs's deep retrieval model as a subclass, its lookups in its call.

The `deep_retrieval` workload (its own `StagedInput`); off TensorFlow plain
is keras-rs's examples' hand split, the lookups in `dataset.map`.
"""

import keras

import keras_stage
from benchmarks.scripts import datasets, hand_split
from benchmarks.workloads import workload


def run(staged, timer, tiny=False):
    """The script (see `benchmarks.scripts`)."""
    work = workload("deep_retrieval", batch_size=256)
    sizes = (2, 1, 1, 1) if tiny else (40, 8, 8, 4)
    _, (train, val, test, predict) = datasets(work, sizes)

    timer.start()
    base = keras_stage.Model if staged else keras.Model  # 2
    if staged or keras.backend.backend() == "tensorflow":  # split
        model = work.whole(base, None)
        smart_stage = {"smart_stage": True} if staged else {}  # 3
        model.compile(**work.compile_kwargs(), **smart_stage)
    else:  # the lookups in `dataset.map`
        parts = (train, val, test, predict)
        model, (train, val, test, predict) = hand_split(work, None, parts)
    epochs = 1 if tiny else 3
    with timer.measure("fit"):
        model.fit(train, epochs=epochs, validation_data=val, verbose=0)
    with timer.measure("evaluate"):
        model.evaluate(test, verbose=0)
    with timer.measure("predict"):
        model.predict(predict, verbose=0)
