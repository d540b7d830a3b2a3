"""Criteo-like scripts: TSV lines parsed and hashed in the model.

`calls`: "criteo" fits 3 epochs, evaluates, predicts; "holdout" evaluates a
holdout set too; "first_calls" evaluates 3 times and fits one epoch more.
"""

import keras

import keras_stage
from benchmarks.scripts import datasets
from benchmarks.workloads import workload

# (train, validation, evaluate, predict, holdout) batches.
BATCHES = {"criteo": (100, 20, 20, 8, 20), "first_calls": (40, 10, 20, 1, 1)}


def run(staged, timer, tiny=False, calls="criteo"):
    """The script (see `benchmarks.scripts`)."""
    work = workload("criteo", batch_size=128)
    keras.utils.set_random_seed(0)
    sizes = (2, 1, 1, 1, 1) if tiny else BATCHES.get(calls, BATCHES["criteo"])
    _, parts = datasets(work, sizes, seeds=(4, 1, 2, 3, 5))
    train, val, test, predict, holdout = parts

    timer.start()
    inputs = work.inputs()
    x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
    outputs = work.trunk(work.preprocessing(None)(x))
    model = (keras_stage.Model if staged else keras.Model)(inputs, outputs)  # 2
    smart_stage = {"smart_stage": True} if staged else {}  # 3
    model.compile(**work.compile_kwargs(), **smart_stage)
    epochs = 1 if tiny else 3
    with timer.measure("fit"):
        model.fit(train, epochs=epochs, validation_data=val, verbose=0)
    if calls == "first_calls":
        for name in ("evaluate", "evaluate_2", "evaluate_3"):
            with timer.measure(name):
                model.evaluate(test, verbose=0)
        with timer.measure("fit_again"):
            model.fit(train, epochs=1, validation_data=val, verbose=0)
        return
    with timer.measure("evaluate"):
        model.evaluate(test, verbose=0)
    if calls == "holdout":
        with timer.measure("evaluate_holdout"):
            model.evaluate(holdout, verbose=0)
    with timer.measure("predict"):
        model.predict(predict, verbose=0)
