"""keras.io's structured-data model, where plain Keras cannot fit it whole.

Plain is the hand split (every backend): the preprocessing in `dataset.map`,
a `keras.Model` of the trunk; on workload `name`.
"""

import keras

import keras_stage
from benchmarks.scripts import datasets, hand_split
from benchmarks.workloads import workload

BATCHES = {"tabular": (100, 20, 20, 8), "criteo_columns": (50, 10, 10, 4)}


def run(staged, timer, tiny=False, name="tabular"):
    """The script (see `benchmarks.scripts`)."""
    work = workload(name)
    keras.utils.set_random_seed(0)
    sizes = (2, 1, 1, 1) if tiny else BATCHES[name]
    adapt, (train, val, test, predict) = datasets(work, sizes)

    timer.start()
    if staged:  # split
        inputs = work.inputs()
        x = keras_stage.layers.StagedInput()(inputs)  # 1
        outputs = work.trunk(work.preprocessing(adapt)(x))
        model = keras_stage.Model(inputs, outputs)  # 2
        model.compile(**work.compile_kwargs(), smart_stage=True)  # 3
    else:  # the preprocessing in `dataset.map`
        parts = (train, val, test, predict)
        model, (train, val, test, predict) = hand_split(work, adapt, parts)
    epochs = 1 if tiny else 3
    with timer.measure("fit"):
        model.fit(train, epochs=epochs, validation_data=val, verbose=0)
    with timer.measure("evaluate"):
        model.evaluate(test, verbose=0)
    with timer.measure("predict"):
        model.predict(predict, verbose=0)
