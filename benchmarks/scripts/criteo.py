"""Criteo-like scripts: TSV lines parsed and hashed in the model.

The `criteo` workload at batch 128; `calls` is the script: "criteo": `fit`
3 epochs of 100 batches validating on 20, `evaluate` on 20, `predict` on
8; "holdout": a second `evaluate`, on a holdout set, before `predict`;
"first_calls": `fit` 3 epochs of 40 batches validating on 10, `evaluate`
on 20 three times, `fit` one epoch more.
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
    sizes = BATCHES.get(calls, BATCHES["criteo"])
    _, (train, val, test, predict, holdout) = datasets(
        work, (2, 1, 1, 1, 1) if tiny else sizes, seeds=(4, 1, 2, 3, 5)
    )

    timer.start()
    inputs = work.inputs()
    x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
    outputs = work.trunk(work.preprocessing(None)(x))
    model_class = keras_stage.Model if staged else keras.Model  # 2
    model = model_class(inputs, outputs)
    model.compile(
        **work.compile_kwargs(),
        **({"smart_stage": True} if staged else {}),  # 3
    )
    with timer.measure("fit"):
        model.fit(
            train, epochs=1 if tiny else 3, validation_data=val, verbose=0
        )
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
