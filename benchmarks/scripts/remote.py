"""The `remote` workload as a script: one `fit(epochs=1)` over 100 batches
of 256 lines, each batch read remotely (20 ms), parsed and hashed."""

import keras

import keras_stage
from benchmarks.workloads import workload


def run(staged, timer, tiny=False):
    """The script (see `benchmarks.scripts`)."""
    work = workload("remote")
    dataset = work.dataset(*work.data((2 if tiny else 100) * work.batch_size))

    timer.start()
    inputs = work.inputs()
    x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
    outputs = work.trunk(work.preprocessing(None)(x))
    model = (keras_stage.Model if staged else keras.Model)(inputs, outputs)  # 2
    smart_stage = {"smart_stage": True} if staged else {}  # 3
    model.compile(**work.compile_kwargs(), **smart_stage)
    with timer.measure("fit"):
        model.fit(dataset, epochs=1, verbose=0)
