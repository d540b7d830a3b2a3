"""keras-rs's recommenders as subclassed models, their lookups in `call`.

keras-rs's examples (keras.io's retrieval, `deep_recommender.py`, DLRM)
look string ids up in `dataset.map`; here the lookups are in the models'
calls, for SmartStage. `preprocessed=True`: the same model without them,
for the hand split (`preprocessor(name).preprocess` in `dataset.map`).
Data is synthetic, MovieLens- and Criteo-shaped.
"""

import functools
import types

import keras
import numpy as np
import tensorflow as tf

from benchmarks.workloads.base import Workload

USERS, MOVIES, OCCUPATIONS, GENRES = 600, 400, 21, 18
AGE_BINS = [18.0, 25.0, 35.0, 45.0, 50.0, 56.0]
SPARSE, DENSE, HASH_BINS = 8, 4, 1000


def movielens(rows, seed=0):
    """`(x, y)`: MovieLens-shaped ratings, ids as strings (as its files)."""
    rng = np.random.default_rng(seed)
    user = rng.integers(1, USERS + 40, rows)  # some ids out of vocabulary
    movie = rng.integers(1, MOVIES + 30, rows)
    x = {
        "user_id": np.array([f"u{i}" for i in user]),
        "movie_id": np.array([f"m{i}" for i in movie]),
        "user_gender": np.array(["F", "M"])[rng.integers(0, 2, rows)],
        "raw_user_age": rng.uniform(12, 70, rows).astype("float32"),
        "user_occupation_label": rng.integers(0, OCCUPATIONS, rows),
        "movie_genres": rng.integers(0, GENRES, (rows, 3)),
    }
    y = rng.uniform(0.0, 1.0, rows).astype("float32")
    return x, y


def criteo(rows, seed=0):
    """`(x, y)`: Criteo-shaped rows: dense floats, sparse string ids."""
    rng = np.random.default_rng(seed)
    x = {"dense": rng.lognormal(0.0, 1.0, (rows, DENSE)).astype("float32")}
    for i in range(SPARSE):
        x[f"cat_{i}"] = np.array(
            [f"c{i}_{v}" for v in rng.integers(0, 50 * (i + 1), rows)]
        )
    y = rng.integers(0, 2, (rows, 1)).astype("float32")
    return x, y


def dataset(data, batch_size, seed=None, preprocess=None):
    """`data` batched, shuffled with `seed` unless None, `preprocess`ed."""
    ds = tf.data.Dataset.from_tensor_slices(data)
    if seed is not None:
        ds = ds.shuffle(len(data[1]), seed=seed)
    ds = ds.batch(batch_size)
    if preprocess is not None:
        ds = ds.map(
            lambda x, y: (preprocess(x), y),
            num_parallel_calls=tf.data.AUTOTUNE,
        ).prefetch(tf.data.AUTOTUNE)
    return ds


def _ids(prefix, count, name):
    vocabulary = [f"{prefix}{i}" for i in range(1, count + 1)]
    return keras.layers.StringLookup(vocabulary=vocabulary, name=name)


@functools.cache
def models(base):
    """A namespace of the recommender classes on `base` (`keras.Model` or
    `keras_stage.Model`, whose models have a StagedInput first)."""
    import keras_stage

    staged = base is not keras.Model

    class _LooksUp(base):
        """A model with lookups (`preprocess`), none if `preprocessed`."""

        def __init__(self, preprocessed=False, **kwargs):
            super().__init__(**kwargs)
            self.preprocessed = preprocessed

        def looked_up(self, inputs):
            return inputs if self.preprocessed else self.preprocess(inputs)

    class _Recommender(_LooksUp):
        def __init__(self, preprocessed=False, stage=None, **kwargs):
            super().__init__(preprocessed, **kwargs)
            self.stage = (  # `stage`: the mode's StagedInput, its options
                stage or keras_stage.layers.StagedInput(name="stage")
                if staged and not preprocessed
                else None
            )

        def staged_input(self, inputs):
            return inputs if self.stage is None else self.stage(inputs)

        def get_config(self):
            return {**super().get_config(), "preprocessed": self.preprocessed}

        def dot_loss(self, a, b, y, sample_weight):
            """`loss_fn` of `y` and the dot products of `a`'s, `b`'s rows."""
            scores = keras.ops.sum(a * b, axis=1, keepdims=True)
            y = keras.ops.expand_dims(y, -1)
            return self.loss_fn(y, scores, sample_weight)

    class Retrieval(_Recommender):
        """keras.io's basic retrieval: a user and a movie embedding, an
        overridden `compute_loss`, no top-k scoring while training."""

        def __init__(self, embedding_dimension=32, **kwargs):
            super().__init__(**kwargs)
            self.embedding_dimension = embedding_dimension
            if not self.preprocessed:
                self.user_lookup = _ids("u", USERS, "user_lookup")
                self.movie_lookup = _ids("m", MOVIES, "movie_lookup")
            self.user_embedding = keras.layers.Embedding(
                USERS + 1, embedding_dimension, name="user_embedding"
            )
            self.movie_embedding = keras.layers.Embedding(
                MOVIES + 1, embedding_dimension, name="movie_embedding"
            )
            self.loss_fn = keras.losses.MeanSquaredError()

        def preprocess(self, inputs):
            return {
                "user": self.user_lookup(inputs["user_id"]),
                "movie": self.movie_lookup(inputs["movie_id"]),
            }

        def call(self, inputs, training=False):
            inputs = self.looked_up(self.staged_input(inputs))
            users = self.user_embedding(inputs["user"])
            movies = self.movie_embedding(inputs["movie"])
            result = {"user_embeddings": users, "movie_embeddings": movies}
            if not training:
                # keras-rs's BruteForceRetrieval: the top 10 movies.
                scores = keras.ops.matmul(
                    users, keras.ops.transpose(self.movie_embedding.embeddings)
                )
                result["predictions"] = keras.ops.top_k(scores, 10)[1]
            return result

        def compute_loss(self, x, y, y_pred, sample_weight, training=True):
            pair = y_pred["user_embeddings"], y_pred["movie_embeddings"]
            return self.dot_loss(*pair, y, sample_weight)

        def get_config(self):
            config = {"embedding_dimension": self.embedding_dimension}
            return {**super().get_config(), **config}

    class QueryTower(_LooksUp):
        """`deep_recommender.py`'s query model, its lookups in its call."""

        def __init__(self, preprocessed=False, dimension=32, **kwargs):
            super().__init__(preprocessed, **kwargs)
            if not self.preprocessed:
                self.user_lookup = _ids("u", USERS, "user_lookup")
                self.gender_lookup = keras.layers.StringLookup(
                    vocabulary=["F", "M"], name="gender_lookup"
                )
                self.age_bins = keras.layers.Discretization(
                    bin_boundaries=AGE_BINS, name="age_bins"
                )
                self.occupation_lookup = keras.layers.IntegerLookup(
                    vocabulary=list(range(OCCUPATIONS)),
                    name="occupation_lookup",
                )
            sizes = {"user": USERS + 1, "gender": 3, "age": len(AGE_BINS) + 1}
            sizes["occupation"] = OCCUPATIONS + 1
            self.embeddings = {
                n: keras.layers.Embedding(size, dimension, name=f"{n}_emb")
                for n, size in sizes.items()
            }
            self.dense = keras.layers.Dense(dimension, name="query_dense")

        def preprocess(self, inputs):
            return {
                "user": self.user_lookup(inputs["user_id"]),
                "gender": self.gender_lookup(inputs["user_gender"]),
                "age": self.age_bins(inputs["raw_user_age"]),
                "occupation": self.occupation_lookup(
                    inputs["user_occupation_label"]
                ),
            }

        def call(self, inputs):
            inputs = self.looked_up(inputs)
            features = [self.embeddings[n](inputs[n]) for n in self.embeddings]
            return self.dense(keras.ops.concatenate(features, axis=1))

    class CandidateTower(_LooksUp):
        """`deep_recommender.py`'s candidate model: the movie id and the mean
        of its genres' embeddings, its lookups in its call."""

        def __init__(self, preprocessed=False, dimension=32, **kwargs):
            super().__init__(preprocessed, **kwargs)
            if not self.preprocessed:
                self.movie_lookup = _ids("m", MOVIES, "movie_lookup")
                self.genre_lookup = keras.layers.IntegerLookup(
                    vocabulary=list(range(GENRES)), name="genre_lookup"
                )
            self.movie_embedding = keras.layers.Embedding(
                MOVIES + 1, dimension, name="movie_emb"
            )
            self.genre_embedding = keras.layers.Embedding(
                GENRES + 1, dimension, name="genre_emb"
            )
            self.dense = keras.layers.Dense(dimension, name="candidate_dense")

        def preprocess(self, inputs):
            return {
                "movie": self.movie_lookup(inputs["movie_id"]),
                "genres": self.genre_lookup(inputs["movie_genres"]),
            }

        def call(self, inputs):
            inputs = self.looked_up(inputs)
            genres = keras.ops.mean(self.genre_embedding(inputs["genres"]), 1)
            movie = self.movie_embedding(inputs["movie"])
            return self.dense(keras.ops.concatenate([movie, genres], axis=1))

    class DeepRetrieval(_Recommender):
        """`deep_recommender.py`'s retrieval model: a query and a candidate
        tower, each with its own lookups."""

        def __init__(self, dimension=32, **kwargs):
            super().__init__(**kwargs)
            self.dimension = dimension
            args = (self.preprocessed, dimension)
            self.query = QueryTower(*args, name="query_tower")
            self.candidate = CandidateTower(*args, name="candidate_tower")
            self.loss_fn = keras.losses.MeanSquaredError()

        def preprocess(self, inputs):
            return {
                **self.query.preprocess(inputs),
                **self.candidate.preprocess(inputs),
            }

        def call(self, inputs, training=False):
            inputs = self.staged_input(inputs)
            return {
                "query": self.query(inputs),
                "candidate": self.candidate(inputs),
            }

        def compute_loss(self, x, y, y_pred, sample_weight, training=True):
            pair = y_pred["query"], y_pred["candidate"]
            return self.dot_loss(*pair, y, sample_weight)

        def get_config(self):
            return {**super().get_config(), "dimension": self.dimension}

    class DLRM(_Recommender):
        """`ml_perf/model.py`'s DLRM shape: normalized dense features
        through a bottom MLP, hashed sparse ids embedded, their pairwise
        dot products, a top MLP."""

        def __init__(self, dimension=16, **kwargs):
            super().__init__(**kwargs)
            self.dimension = dimension
            if not self.preprocessed:
                self.normalize = keras.layers.Normalization(
                    mean=1.6, variance=4.7, name="dense_norm"
                )
                # Built now: plain Keras would build it while tracing the
                # model's call, its constants then out of the step's graph.
                self.normalize.build((None, DENSE))
                self.hashing = [
                    keras.layers.Hashing(HASH_BINS, name=f"hash_{i}")
                    for i in range(SPARSE)
                ]
            self.embeddings = [
                keras.layers.Embedding(HASH_BINS, dimension, name=f"emb_{i}")
                for i in range(SPARSE)
            ]
            self.bottom = keras.layers.Dense(dimension, "relu", name="bottom")
            self.top = keras.layers.Dense(32, "relu", name="top")
            self.out = keras.layers.Dense(1, "sigmoid", name="click")

        def preprocess(self, inputs):
            features = {"dense": self.normalize(inputs["dense"])}
            for i, hashing in enumerate(self.hashing):
                features[f"cat_{i}"] = hashing(inputs[f"cat_{i}"])
            return features

        def call(self, inputs):
            inputs = self.looked_up(self.staged_input(inputs))
            vectors = [self.bottom(inputs["dense"])] + [
                embedding(inputs[f"cat_{i}"])
                for i, embedding in enumerate(self.embeddings)
            ]
            stacked = keras.ops.stack(vectors, axis=1)
            dots = keras.ops.matmul(
                stacked, keras.ops.transpose(stacked, (0, 2, 1))
            )
            flat = keras.ops.reshape(dots, (-1, len(vectors) ** 2))
            x = keras.ops.concatenate([vectors[0], flat], axis=1)
            return self.out(self.top(x))

        def get_config(self):
            return {**super().get_config(), "dimension": self.dimension}

    classes = (Retrieval, QueryTower, CandidateTower, DeepRetrieval, DLRM)
    for cls in classes:
        cls.__qualname__ = cls.__name__
    return types.SimpleNamespace(**{cls.__name__: cls for cls in classes})


# Per model: (its class's name in `models`, data, compile arguments).
MODELS = {
    "retrieval": ("Retrieval", movielens, {}),
    "deep_retrieval": ("DeepRetrieval", movielens, {}),
    "dlrm": ("DLRM", criteo, {"loss": "binary_crossentropy"}),
}


def _class(name, base=keras.Model):
    return getattr(models(base), MODELS[name][0])


def preprocessor(name):
    """Model `name`'s lookups, for the hand split's `dataset.map` (in the
    model it trains, Keras would turn XLA off)."""
    return _class(name)(name=f"{name}_lookups")


def build(name, base, preprocessed=False, seed=1):
    """Model `name` on `base` after `set_random_seed(seed)`, compiled with
    Adam (and SmartStage where `base` stages)."""
    keras.utils.set_random_seed(seed)
    model = _class(name, base)(preprocessed=preprocessed, name=name)
    kwargs = dict(MODELS[name][2])
    if base is not keras.Model and not preprocessed:
        kwargs["smart_stage"] = True
    model.compile(optimizer=keras.optimizers.Adam(0.01), **kwargs)
    return model


class Recommender(Workload):
    """A model of `MODELS` as a workload, its own StagedInput in `whole`."""

    batch_size, steps, quick_steps = 512, 128, 8
    backends = ("tensorflow", "jax", "torch")

    def data(self, rows, seed=0):
        return MODELS[self.name][1](rows, seed)

    def whole(self, base, adapt, staged_input=None, seed=1):
        keras.utils.set_random_seed(seed)
        return _class(self.name, base)(name=self.name, stage=staged_input)

    def split(self, adapt, seed=1):
        keras.utils.set_random_seed(seed)
        # The trunk first: its initial weights those of `whole`'s model.
        trunk = _class(self.name)(preprocessed=True, name=self.name)
        return preprocessor(self.name).preprocess, trunk

    def compile_kwargs(self, learning_rate=0.01):
        return {
            "optimizer": keras.optimizers.Adam(learning_rate),
            **MODELS[self.name][2],
        }


WORKLOADS = {
    name: type(name, (Recommender,), {"name": name, "description": name})
    for name in MODELS
}
