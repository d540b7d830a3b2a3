"""keras.io's FeatureSpace example as written: the hand split.

In mode "plain" the example itself, seeded: the `FeatureSpace` in
`dataset.map`, a training model of its encoded features (what runs on
JAX and torch too, where a model cannot take the string column); in
"staged" the `featurespace` script's one model with keras_stage's three
lines. The sample is predicted from `tf` tensors in both
(`keras.ops.convert_to_tensor` makes no string tensor on torch), encoded
by the `FeatureSpace` inside the timed `predict` for the split. Runs on
every backend.
"""

import keras
import tensorflow as tf

import keras_stage
from benchmarks.scripts import featurespace, is_staged
from benchmarks.workloads import heart


def run(mode, timer, tiny=False):
    """The example's script in `mode` (see `benchmarks.scripts`)."""
    staged = is_staged(mode)
    keras.utils.set_random_seed(0)
    train_rows = 40 if tiny else heart.TRAIN_ROWS
    val_rows = 10 if tiny else heart.VAL_ROWS
    train_ds = featurespace.dataframe_to_dataset(
        *heart.make_heart_data(train_rows, featurespace.TRAIN_SEED)
    ).batch(32)
    val_ds = featurespace.dataframe_to_dataset(
        *heart.make_heart_data(val_rows, featurespace.VAL_SEED)
    ).batch(32)

    timer.start()
    feature_space = heart.feature_space()
    feature_space.adapt(train_ds.map(lambda x, _: x))
    spec = featurespace._Adapted(feature_space)
    if staged:
        staged_input = keras_stage.layers.StagedInput()  # 1
        inputs, encoded_features = spec.inputs_and_features(None, staged_input)
        model = keras_stage.Model(inputs, spec.trunk(encoded_features))  # 2
    else:

        def encode(dataset):
            return dataset.map(
                lambda x, y: (feature_space(x), y),
                num_parallel_calls=tf.data.AUTOTUNE,
            ).prefetch(tf.data.AUTOTUNE)

        train_ds, val_ds = encode(train_ds), encode(val_ds)
        encoded_features = feature_space.get_encoded_features()
        model = keras.Model(encoded_features, spec.trunk(encoded_features))
    model.compile(
        optimizer="adam",
        loss="binary_crossentropy",
        metrics=["accuracy"],
        **({"smart_stage": True} if staged else {}),  # 3
    )
    with timer.measure("fit"):
        model.fit(
            train_ds,
            epochs=1 if tiny else 20,
            validation_data=val_ds,
            verbose=2,
        )

    sample = {
        name: tf.constant([value])
        for name, value in featurespace.SAMPLE.items()
    }
    with timer.measure("predict"):
        predictions = model.predict(sample if staged else feature_space(sample))
    print(
        f"This particular patient had a {100 * predictions[0][0]:.1f} "
        "percent probability of having a heart disease, as evaluated by "
        "our model."
    )
