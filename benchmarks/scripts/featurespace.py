"""keras.io's "Structured data classification with FeatureSpace", one model.

The example as written (its customised `FeatureSpace`, adapted on the
training features; Dense(32, relu) -> Dropout(0.5) -> Dense(1, sigmoid);
20 epochs with validation; one sample predicted), but trained as its
end-to-end model: the `FeatureSpace` inside the model, fed the raw dict
dataset. The table is `benchmarks.workloads.heart`'s synthetic one (242
training and 61 validation rows); the model is built as
`benchmarks.regimes.FeatureSpaceModel` builds it.
"""

import keras
import tensorflow as tf

import keras_stage
from benchmarks import regimes
from benchmarks.scripts import is_staged
from benchmarks.workloads import heart

# `benchmarks.regimes`' seeds of the example's training and validation rows.
TRAIN_SEED = 7
VAL_SEED = 8
# The example's patient.
SAMPLE = {
    "age": 60,
    "sex": 1,
    "cp": 1,
    "trestbps": 145,
    "chol": 233,
    "fbs": 1,
    "restecg": 2,
    "thalach": 150,
    "exang": 0,
    "oldpeak": 2.3,
    "slope": 3,
    "ca": 0,
    "thal": "fixed",
}


class _Adapted(regimes.FeatureSpaceModel):
    """`FeatureSpaceModel`'s one model around a `FeatureSpace` adapted here.

    The regimes adapt theirs on unshuffled batches; the script adapts as
    the example does, on its shuffled training dataset.
    """

    def __init__(self, feature_space):
        self._feature_space = feature_space

    def feature_space(self, adapt_data):
        return self._feature_space


def dataframe_to_dataset(features, labels):
    """The example's `dataframe_to_dataset`, of `dict(dataframe)` columns."""
    dataset = tf.data.Dataset.from_tensor_slices((dict(features), labels))
    return dataset.shuffle(buffer_size=len(labels))


def run(mode, timer, tiny=False):
    """The example's script in `mode` (see `benchmarks.scripts`)."""
    staged = is_staged(mode)
    train_rows = 40 if tiny else heart.TRAIN_ROWS
    val_rows = 10 if tiny else heart.VAL_ROWS
    epochs = 1 if tiny else 20
    train_features, train_labels = heart.make_heart_data(train_rows, TRAIN_SEED)
    val_features, val_labels = heart.make_heart_data(val_rows, VAL_SEED)
    train_ds = dataframe_to_dataset(train_features, train_labels).batch(32)
    val_ds = dataframe_to_dataset(val_features, val_labels).batch(32)

    timer.start()
    feature_space = heart.feature_space()
    train_ds_with_no_labels = train_ds.map(lambda x, _: x)
    feature_space.adapt(train_ds_with_no_labels)
    spec = _Adapted(feature_space)
    staged_input = keras_stage.layers.StagedInput() if staged else None  # 1
    inputs, encoded_features = spec.inputs_and_features(None, staged_input)
    predictions = spec.trunk(encoded_features)
    model_class = keras_stage.Model if staged else keras.Model  # 2
    model = model_class(inputs=inputs, outputs=predictions)
    model.compile(
        optimizer="adam",
        loss="binary_crossentropy",
        metrics=["accuracy"],
        **({"smart_stage": True} if staged else {}),  # 3
    )
    with timer.measure("fit"):
        model.fit(train_ds, epochs=epochs, validation_data=val_ds, verbose=2)

    input_dict = {
        name: keras.ops.convert_to_tensor([value])
        for name, value in SAMPLE.items()
    }
    with timer.measure("predict"):
        predictions = model.predict(input_dict)
    print(
        f"This particular patient had a {100 * predictions[0][0]:.1f} "
        "percent probability of having a heart disease, as evaluated by "
        "our model."
    )
