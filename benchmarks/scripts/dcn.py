"""keras.io's "Ranking with Deep and Cross Networks", lookups in the model.

The example's MovieLens model (the stacked DCN: an embedding of 8 per
feature, concatenated, `keras_rs.layers.FeatureCross()`, Dense(192, relu)
x 2, Dense(1); AdamW(1e-2), mean squared error, RMSE) written as one
functional model whose `IntegerLookup`s and `StringLookup`s run in the
model, not in the dataset's map as in the example (so there is no
`cache()` of the looked-up ids either). The data is MovieLens-100K-shaped
and synthetic (943 users with a gender, an age bucket, an occupation and a
zip code each, 1682 movies, ratings 1 to 5; no download here). The script
seeds everything (`keras.utils.set_random_seed(0)`), shuffles its
training rows, and fits 8 epochs of 10 batches of 4096, then evaluates 5
batches.

keras-rs is a benchmark extra (requirements/bench-extra.txt); without it
the script is skipped.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_stage
from benchmarks.scripts import Skipped, is_staged

INT_FEATURES = ("movie_id", "user_id", "user_gender", "bucketized_user_age")
STR_FEATURES = ("user_zip_code", "user_occupation_text")
USERS = 943
MOVIES = 1682
AGE_BUCKETS = (1, 18, 25, 35, 45, 50, 56)
OCCUPATIONS = tuple(f"occupation{i}" for i in range(21))
ZIP_CODES = 795
BATCH_SIZE = 4096
# Full size, then `tiny`: training batches, test batches, epochs.
SIZES = {False: (10, 5, 8), True: (1, 1, 1)}
KERAS_RS_INSTALL = (
    "pip install --no-deps -r requirements/bench-extra.txt "
    "(keras-rs, a benchmark extra)"
)


def make_ratings(count, seed):
    """`count` MovieLens-100K-like ratings: `(features, rating)`.

    `features` is a dict of rank-1 columns (int64 ids, strings as object
    arrays); `rating` a float32 array of stars, 1 to 5, that depends on the
    user, the movie and a cross of the user's gender and age.
    """
    rng = np.random.default_rng(seed)
    users = np.random.default_rng(0)  # the same users in every split
    gender = users.integers(2, size=USERS)
    age = users.choice(AGE_BUCKETS, size=USERS)
    occupation = users.integers(len(OCCUPATIONS), size=USERS)
    zip_code = users.integers(ZIP_CODES, size=USERS)
    user_bias = users.normal(0, 0.5, USERS)
    movie_bias = users.normal(0, 0.7, MOVIES)
    # Popular movies and active users get most ratings, as in MovieLens.
    user = (rng.zipf(1.5, count) - 1) % USERS
    movie = (rng.zipf(1.3, count) - 1) % MOVIES
    cross = np.where(gender[user] == 1, 0.02, -0.02) * (age[user] - 30)
    stars = 3.5 + user_bias[user] + movie_bias[movie] + cross
    stars += rng.normal(0, 0.8, count)
    features = {
        "movie_id": movie.astype("int64") + 1,
        "user_id": user.astype("int64") + 1,
        "user_gender": gender[user].astype("int64"),
        "bucketized_user_age": age[user].astype("int64"),
        "user_zip_code": np.array(
            [f"{10000 + 97 * z:05d}" for z in zip_code[user]], dtype=object
        ),
        "user_occupation_text": np.array(
            [OCCUPATIONS[o] for o in occupation[user]], dtype=object
        ),
    }
    return features, np.clip(np.rint(stars), 1, 5).astype("float32")


def run(mode, timer, tiny=False):
    """The script in `mode` (see `benchmarks.scripts`)."""
    staged = is_staged(mode)
    try:
        import keras_rs
    except ImportError as error:
        raise Skipped(
            f"keras_rs is not importable ({error}): {KERAS_RS_INSTALL}"
        ) from error
    keras.utils.set_random_seed(0)
    train_batches, test_batches, epochs = SIZES[tiny]
    train = make_ratings(train_batches * BATCH_SIZE, seed=1)
    test = make_ratings(test_batches * BATCH_SIZE, seed=2)
    # As the example: each feature's values in all the ratings.
    vocabularies = {
        name: np.unique(np.concatenate([train[0][name], test[0][name]]))
        for name in INT_FEATURES + STR_FEATURES
    }
    train_ds = (
        tf.data.Dataset.from_tensor_slices(train)
        .shuffle(len(train[1]))
        .batch(BATCH_SIZE)
    )
    test_ds = tf.data.Dataset.from_tensor_slices(test).batch(BATCH_SIZE)

    timer.start()
    inputs = {
        # Named after their keys: Keras warns about dict inputs whose
        # tensor names differ from the keys.
        name: keras.Input(
            shape=(),
            dtype="int64" if name in INT_FEATURES else "string",
            name=name,
        )
        for name in INT_FEATURES + STR_FEATURES
    }
    x = keras_stage.layers.StagedInput()(inputs) if staged else inputs  # 1
    embeddings = []
    for name, vocabulary in vocabularies.items():
        lookup_class = (
            keras.layers.IntegerLookup
            if name in INT_FEATURES
            else keras.layers.StringLookup
        )
        ids = lookup_class(vocabulary=vocabulary)(x[name])
        embeddings.append(
            keras.layers.Embedding(input_dim=len(vocabulary) + 1, output_dim=8)(
                ids
            )
        )
    x = keras.layers.Concatenate(axis=1)(embeddings)
    x = keras_rs.layers.FeatureCross()(x)
    for units in (192, 192):
        x = keras.layers.Dense(units, activation="relu")(x)
    outputs = keras.layers.Dense(1)(x)
    model_class = keras_stage.Model if staged else keras.Model  # 2
    model = model_class(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=1e-2),
        loss=keras.losses.MeanSquaredError(),
        metrics=[keras.metrics.RootMeanSquaredError()],
        **({"smart_stage": True} if staged else {}),  # 3
    )
    with timer.measure("fit"):
        model.fit(train_ds, epochs=epochs, verbose=0)
    with timer.measure("evaluate"):
        results = model.evaluate(test_ds, return_dict=True, verbose=0)
    print(f"RMSE = {results['root_mean_squared_error']}")
