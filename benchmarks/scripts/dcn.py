"""keras.io's "Ranking with Deep and Cross Networks", lookups in the model.

The example's stacked DCN (keras-rs's `FeatureCross`), the `dcn` workload's
lookups and data: `fit` 8 epochs of 10 batches of 4096, `evaluate` on 5.
"""

import keras
import keras_rs

import keras_stage
from benchmarks.scripts import datasets
from benchmarks.workloads import workload


def run(staged, timer, tiny=False):
    """The script (see `benchmarks.scripts`)."""
    keras.utils.set_random_seed(0)
    work = workload("dcn", batch_size=4096)
    adapt, (train, test) = datasets(work, (1, 1) if tiny else (10, 5), (1, 2))

    timer.start()
    inputs = work.inputs()
    x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
    embeddings = [
        keras.layers.Embedding(input_dim=work.sizes[name], output_dim=8)(ids)
        for name, ids in zip(inputs, work.preprocessing(adapt)(x), strict=True)
    ]
    x = keras.layers.Concatenate(axis=1)(embeddings)
    x = keras_rs.layers.FeatureCross()(x)
    for units in (192, 192):
        x = keras.layers.Dense(units, activation="relu")(x)
    outputs = keras.layers.Dense(1)(x)
    model = (keras_stage.Model if staged else keras.Model)(inputs, outputs)  # 2
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=1e-2),
        loss=keras.losses.MeanSquaredError(),
        metrics=[keras.metrics.RootMeanSquaredError()],
        **({"smart_stage": True} if staged else {}),  # 3
    )
    with timer.measure("fit"):
        model.fit(train, epochs=1 if tiny else 8, verbose=0)
    with timer.measure("evaluate"):
        results = model.evaluate(test, return_dict=True, verbose=0)
    print(f"RMSE = {results['root_mean_squared_error']}")
