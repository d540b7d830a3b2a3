"""A heart-disease-like table and keras.io's `FeatureSpace` for it.

keras.io's "Structured data classification with FeatureSpace" trains on
the Cleveland Clinic heart-disease CSV (303 rows, 13 features). With no
download here, `make_heart_data` synthesises rows with the same columns,
dtypes and value ranges as that CSV read by pandas (integers as int64,
`oldpeak` as float64, `thal` as strings, an int64 `target`), and
`feature_space` is the example's second, customised `FeatureSpace`
(`num_oov_indices=0` lookups, 30 bins for `age`, two hashed crosses).
`benchmarks.regimes` trains it as the example does and as one model.
"""

import keras
import numpy as np

# The example's table: 303 rows, `dataframe.sample(frac=0.2)` to validate.
ROWS = 303
VAL_ROWS = 61
TRAIN_ROWS = ROWS - VAL_ROWS
THAL = ("fixed", "normal", "reversible")


def make_heart_data(count, seed):
    """`count` rows of a heart-disease-like table, from `seed`.

    Args:
        count: Rows.
        seed: Seed of the generator.

    Returns:
        `(features, target)`: a dict of rank-1 columns, as
        `dict(dataframe)` of the CSV gives them, and an int64 array.
    """
    rng = np.random.default_rng(seed)

    def integers(mean, spread, low, high):
        values = np.rint(rng.normal(mean, spread, count))
        return np.clip(values, low, high).astype("int64")

    def choice(values, p=None):
        drawn = rng.choice(np.asarray(values, dtype="int64"), count, p=p)
        # Every value in the first rows: the lookups have no out-of-
        # vocabulary index (`num_oov_indices=0`), so a value that a
        # small table's training rows lack would fail at validation.
        drawn[: len(values)] = values[:count]
        return drawn

    x = {
        "age": integers(54, 9, 29, 77),
        "sex": choice([0, 1], p=[0.32, 0.68]),
        "cp": choice([0, 1, 2, 3, 4], p=[0.05, 0.2, 0.2, 0.3, 0.25]),
        "trestbps": integers(131, 17, 94, 200),
        "chol": integers(246, 52, 126, 564),
        "fbs": choice([0, 1], p=[0.85, 0.15]),
        "restecg": choice([0, 1, 2], p=[0.5, 0.02, 0.48]),
        "thalach": integers(150, 23, 71, 202),
        "exang": choice([0, 1], p=[0.67, 0.33]),
        "oldpeak": np.round(np.minimum(rng.exponential(1.0, count), 6.2), 1),
        "slope": choice([1, 2, 3], p=[0.47, 0.46, 0.07]),
        "ca": choice([0, 1, 2, 3], p=[0.59, 0.22, 0.13, 0.06]),
    }
    thal = rng.choice(len(THAL), count, p=[0.06, 0.56, 0.38])
    thal[: len(THAL)] = range(len(THAL))[:count]
    x["thal"] = np.array([THAL[i] for i in thal], dtype=object)
    logit = (
        0.05 * (x["age"] - 54)
        + 0.8 * x["exang"]
        + 0.6 * x["ca"]
        + 0.7 * x["oldpeak"]
        + 1.2 * (thal == 2)
        - 0.03 * (x["thalach"] - 150)
        - 1.5
    )
    target = rng.random(count) < 1 / (1 + np.exp(-logit))
    # In the order of a functional model's dict inputs (sorted), which
    # Keras warns about when a dict of another order reaches it.
    return dict(sorted(x.items())), target.astype("int64")


def feature_space():
    """keras.io's customised `FeatureSpace` of the table, not yet adapted."""
    fs = keras.utils.FeatureSpace
    return fs(
        features={
            "sex": fs.integer_categorical(num_oov_indices=0),
            "cp": fs.integer_categorical(num_oov_indices=0),
            "fbs": fs.integer_categorical(num_oov_indices=0),
            "restecg": fs.integer_categorical(num_oov_indices=0),
            "exang": fs.integer_categorical(num_oov_indices=0),
            "ca": fs.integer_categorical(num_oov_indices=0),
            "thal": fs.string_categorical(num_oov_indices=0),
            "age": fs.float_discretized(num_bins=30),
            "trestbps": fs.float_normalized(),
            "chol": fs.float_normalized(),
            "thalach": fs.float_normalized(),
            "oldpeak": fs.float_normalized(),
            "slope": fs.float_normalized(),
        },
        crosses=[
            fs.cross(feature_names=("sex", "age"), crossing_dim=64),
            fs.cross(feature_names=("thal", "ca"), crossing_dim=16),
        ],
        output_mode="concat",
    )
