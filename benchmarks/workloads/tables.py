"""Tables: `none`, `dense` (nothing to stage: the gap is the machinery's
cost), keras.io's `tabular`, `featurespace` and `dcn`, on synthetic data."""

import keras
import numpy as np
import tensorflow as tf

from benchmarks.workloads.base import Workload

ANY = ("tensorflow", "jax", "torch")


class Dense(Workload):
    name = "dense"
    description = (
        "no preprocessing: 32 float features -> Dense(64) x 2 -> Dense(1)"
    )
    batch_size, features, widths = 32, 32, (64, 64)
    backends = ANY

    def data(self, rows, seed=0):
        x = np.random.default_rng(seed).normal(size=(rows, self.features))
        x = x.astype("float32")
        return x, (x[:, :8].sum(axis=1, keepdims=True) > 0).astype("float32")

    def inputs(self):
        return keras.Input(shape=(self.features,), name="features")

    def trunk(self, features):
        x = features
        for width in self.widths:
            x = keras.layers.Dense(width, activation="relu")(x)
        return keras.layers.Dense(1)(x)


class NoneWorkload(Dense):
    name = "none"
    description = (
        "nothing to stage: 64 float features -> Dense(256) x 2 -> Dense(1)"
    )
    batch_size, steps, quick_steps = 256, 400, 150
    features, widths = 64, (256, 256)


_THAL = ("fixed", "normal", "reversible")
CATEGORICAL = ("sex", "cp", "fbs", "restecg", "exang", "ca")


class Tabular(Workload):
    name = "tabular"
    description = (
        "keras.io structured data: 4 numeric columns -> adapted Normalization, "
        "'thal' -> StringLookup(one_hot), 'city' -> Hashing(64) -> one-hot, "
        "'cp' -> IntegerLookup(one_hot); Concatenate -> Dense(32) -> Dense(1)"
    )
    batch_size = 32
    backends = ANY
    numeric = ("age", "trestbps", "chol", "thalach")

    def data(self, rows, seed=0):
        rng = np.random.default_rng(seed)
        x = {
            name: rng.normal(50 + 30 * i, 10, (rows, 1)).astype("float32")
            for i, name in enumerate(self.numeric)
        }
        thal = rng.integers(len(_THAL), size=rows)
        x["thal"] = np.array([_THAL[i] for i in thal], dtype=object)
        x["city"] = _strings("city{}", rng.integers(40, size=rows))
        x["cp"] = rng.integers(5, size=(rows, 1)).astype("int64")
        score = (x["age"][:, 0] - 50) / 10 + thal - 1 + (x["cp"][:, 0] > 2)
        return x, (score > 0).astype("float32")[:, None]

    def inputs(self):
        inputs = {n: keras.Input(shape=(1,), name=n) for n in self.numeric}
        for name in ("thal", "city"):  # rank 1: Keras rejects 2-D object arrays
            inputs[name] = keras.Input(shape=(), dtype="string", name=name)
        inputs["cp"] = keras.Input(shape=(1,), dtype="int64", name="cp")
        return inputs

    def preprocessing(self, adapt):
        norms = {}
        for name in self.numeric:
            norms[name] = keras.layers.Normalization(name=f"{name}_norm")
            norms[name].adapt(adapt[name])
        thal = keras.layers.StringLookup(
            vocabulary=list(_THAL), output_mode="one_hot"
        )
        city = keras.layers.Hashing(64, name="city_hash")
        bins = keras.layers.CategoryEncoding(64, "one_hot", name="city_bins")
        cp = keras.layers.IntegerLookup(
            vocabulary=list(range(5)), output_mode="one_hot"
        )

        def preprocess(x):
            out = [norms[n](x[n]) for n in self.numeric]
            return out + [thal(x["thal"]), bins(city(x["city"])), cp(x["cp"])]

        return preprocess

    def trunk(self, columns):
        x = keras.layers.Concatenate(name="features")(columns)
        x = keras.layers.Dense(32, activation="relu")(x)
        return keras.layers.Dense(1, activation="sigmoid")(x)

    def compile_kwargs(self, learning_rate=1e-3):
        extra = {"loss": "binary_crossentropy", "metrics": ["accuracy"]}
        return {**super().compile_kwargs(learning_rate), **extra}


def heart(rows, seed):
    """Heart-disease-like columns as pandas reads keras.io's CSV, a target."""
    rng = np.random.default_rng(seed)

    def integers(mean, spread, low, high):
        return np.clip(
            np.rint(rng.normal(mean, spread, rows)), low, high
        ).astype("int64")

    def choice(values, p):
        drawn = rng.choice(np.asarray(values, dtype="int64"), rows, p=p)
        # Every value in the first rows: the lookups have no OOV index.
        drawn[: len(values)] = values[:rows]
        return drawn

    x = {
        "age": integers(54, 9, 29, 77),
        "sex": choice([0, 1], [0.32, 0.68]),
        "cp": choice([0, 1, 2, 3, 4], [0.05, 0.2, 0.2, 0.3, 0.25]),
        "trestbps": integers(131, 17, 94, 200),
        "chol": integers(246, 52, 126, 564),
        "fbs": choice([0, 1], [0.85, 0.15]),
        "restecg": choice([0, 1, 2], [0.5, 0.02, 0.48]),
        "thalach": integers(150, 23, 71, 202),
        "exang": choice([0, 1], [0.67, 0.33]),
        "oldpeak": np.round(np.minimum(rng.exponential(1.0, rows), 6.2), 1),
        "slope": choice([1, 2, 3], [0.47, 0.46, 0.07]),
        "ca": choice([0, 1, 2, 3], [0.59, 0.22, 0.13, 0.06]),
    }
    thal = rng.choice(3, rows, p=[0.06, 0.56, 0.38])
    thal[:3] = range(3)[:rows]
    x["thal"] = np.array([_THAL[i] for i in thal], dtype=object)
    logit = 0.05 * (x["age"] - 54) + 0.8 * x["exang"] + 0.6 * x["ca"]
    logit += 0.7 * x["oldpeak"] + 1.2 * (thal == 2) - 1.5
    logit -= 0.03 * (x["thalach"] - 150)
    target = rng.random(rows) < 1 / (1 + np.exp(-logit))
    return dict(sorted(x.items())), target.astype("int64")  # a model's order


def feature_space():
    """keras.io's customised `FeatureSpace` of the table, not adapted."""
    fs = keras.utils.FeatureSpace
    features = {
        name: fs.integer_categorical(num_oov_indices=0) for name in CATEGORICAL
    }
    features["thal"] = fs.string_categorical(num_oov_indices=0)
    features["age"] = fs.float_discretized(num_bins=30)
    for name in ("trestbps", "chol", "thalach", "oldpeak", "slope"):
        features[name] = fs.float_normalized()
    crosses = [
        fs.cross(feature_names=("sex", "age"), crossing_dim=64),
        fs.cross(feature_names=("thal", "ca"), crossing_dim=16),
    ]
    return fs(features=features, crosses=crosses, output_mode="concat")


class FeatureSpaceWorkload(Tabular):
    name = "featurespace"
    description = (
        "keras.io FeatureSpace example: 13 heart-disease columns (integer and "
        "string categorical, age in 30 bins, 5 normalised, 2 crosses) -> "
        "Dense(32) -> Dropout(0.5) -> Dense(1, sigmoid)"
    )
    train_rows, val_rows = 242, 61  # the example's 303, a fifth to validate

    def data(self, rows, seed=0):
        return heart(rows, seed)

    def inputs(self):
        # The FeatureSpace's own inputs' dtypes (it makes them once adapted).
        dtypes = {n: "float32" for n in heart(1, 0)[0]}
        dtypes.update({n: "int32" for n in CATEGORICAL}, thal="string")
        return {n: keras.Input((1,), dtype=dtypes[n], name=n) for n in dtypes}

    def preprocessing(self, adapt):
        space = feature_space()
        space.adapt(
            tf.data.Dataset.from_tensor_slices(adapt).batch(self.batch_size)
        )
        # In a model, the encoding as a nested model (its features hang off
        # the FeatureSpace's own inputs, so a StagedInput can go before it);
        # in `dataset.map`, the FeatureSpace itself, as keras.io's example.
        raw = dict(space.get_inputs())
        encode = keras.Model(
            raw, space.get_encoded_features(), name="feature_space"
        )
        return lambda x: encode(x) if _symbolic(x) else space(x)

    def trunk(self, features):
        x = keras.layers.Dense(32, activation="relu")(features)
        x = keras.layers.Dropout(0.5)(x)
        return keras.layers.Dense(1, activation="sigmoid")(x)


def _strings(pattern, values):
    return np.array([pattern.format(v) for v in values], dtype=object)


def _symbolic(x):
    return isinstance(keras.tree.flatten(x)[0], keras.KerasTensor)


class DCN(Workload):
    name = "dcn"
    description = (
        "keras.io DCN ranking: 4 int ids -> IntegerLookup, 2 strings -> "
        "StringLookup; trunk: Embedding(vocabulary + 1, 8) each, Concatenate, "
        "cross x0 * Dense(48)(x0) + x0, Dense(192) x 2, Dense(1); AdamW(1e-2)"
    )
    batch_size, steps, quick_steps = 1024, 16, 2
    backends = ANY
    integers = ("movie_id", "user_id", "user_gender", "bucketized_user_age")
    strings = ("user_zip_code", "user_occupation_text")

    def data(self, rows, seed=0):
        rng, users = np.random.default_rng(seed), np.random.default_rng(0)
        gender = users.integers(2, size=943)
        age = users.choice([1, 18, 25, 35, 45, 50, 56], 943)
        occupation = users.integers(21, size=943)
        zip_code = users.integers(795, size=943)
        bias_user = users.normal(0, 0.5, 943)
        bias_movie = users.normal(0, 0.7, 1682)
        user = (rng.zipf(1.5, rows) - 1) % 943  # active users, popular movies
        movie = (rng.zipf(1.3, rows) - 1) % 1682
        stars = 3.5 + bias_user[user] + bias_movie[movie]
        stars += rng.normal(0, 0.8, rows)
        stars += np.where(gender[user] == 1, 0.02, -0.02) * (age[user] - 30)
        x = {
            "movie_id": movie.astype("int64") + 1,
            "user_id": user.astype("int64") + 1,
            "user_gender": gender[user].astype("int64"),
            "bucketized_user_age": age[user].astype("int64"),
            "user_zip_code": _strings("{:05d}", 10000 + 97 * zip_code[user]),
            "user_occupation_text": _strings("occupation{}", occupation[user]),
        }
        return x, np.clip(np.rint(stars), 1, 5).astype("float32")[:, None]

    def inputs(self):
        dtypes = {n: "int64" for n in self.integers}
        dtypes.update({n: "string" for n in self.strings})
        return {n: keras.Input((), dtype=d, name=n) for n, d in dtypes.items()}

    def preprocessing(self, adapt):
        names = self.integers + self.strings
        self.sizes = {name: len(np.unique(adapt[name])) + 1 for name in names}
        lookups = {
            name: (
                keras.layers.IntegerLookup
                if name in self.integers
                else keras.layers.StringLookup
            )(vocabulary=np.unique(adapt[name]), name=f"{name}_lookup")
            for name in names
        }
        return lambda x: [lookups[name](x[name]) for name in names]

    def trunk(self, columns):
        names = self.integers + self.strings
        embedded = [
            keras.layers.Embedding(self.sizes[name], 8)(column)
            for name, column in zip(names, columns, strict=True)
        ]
        x0 = keras.layers.Concatenate(name="features")(embedded)
        cross = keras.layers.Multiply()(
            [x0, keras.layers.Dense(x0.shape[-1])(x0)]
        )
        x = keras.layers.Add()([cross, x0])
        for _ in range(2):
            x = keras.layers.Dense(192, activation="relu")(x)
        return keras.layers.Dense(1)(x)

    def compile_kwargs(self, learning_rate=1e-2):
        optimizer = keras.optimizers.AdamW(learning_rate)
        return {"optimizer": optimizer, "loss": "mse"}
