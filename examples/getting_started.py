"""Getting started: the three-line change on a model that preprocesses text.

The model takes raw strings, a city name and a short review, and keeps its
preprocessing inside: `StringLookup` turns the city into an id,
`TextVectorization` splits the review into word ids, and embeddings and a
Dense head predict a rating. The keras_stage changes, marked
`# keras_stage:` in the code:

1. a `keras_stage.layers.StagedInput` right after the inputs, and
   `keras_stage.Model` in place of `keras.Model`;
2. `compile(..., smart_stage=True)`, so the string preprocessing runs in
   the stage, ahead of the training step;
3. a `keras_stage.callbacks.PrefetchCallback(verbose=1)` in `fit`, which
   prints whether the step waited for data.

Then `evaluate`, `predict` on raw strings, a `.keras` save and a load: the
loaded model still contains its preprocessing and predicts the same ratings
from the same raw strings.

Run with `python -m examples.getting_started` (`--tiny` for a smoke run).
See docs/getting-started.md.
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_stage  # noqa: E402

SEED = 0
CITIES = ["paris", "lyon", "nice", "lille", "brest", "nancy", "dijon", "metz"]
WORDS = [f"word{i}" for i in range(40)]


def make_reviews(count, seed):
    """Raw string features and a rating that depends on both of them."""
    rng = np.random.default_rng(seed)
    city = rng.integers(0, len(CITIES), count)
    words = rng.integers(0, len(WORDS), (count, 3))
    x = {
        "city": np.array([CITIES[c] for c in city], dtype=object),
        "review": np.array(
            [" ".join(WORDS[w] for w in row) for row in words], dtype=object
        ),
    }
    y = (city / len(CITIES) + (words % 5).mean(axis=1) / 5).astype("float32")
    return x, y[:, None]


def build_model(train_reviews):
    inputs = {
        "city": keras.Input(shape=(), dtype="string", name="city"),
        "review": keras.Input(shape=(), dtype="string", name="review"),
    }
    # keras_stage: everything from here to the first trainable layer can
    # run ahead of the training step, on up to 2 batches at once.
    x = keras_stage.layers.StagedInput(capacity=4, num_threads=2)(inputs)
    city_id = keras.layers.StringLookup(vocabulary=CITIES, name="city_lookup")(
        x["city"]
    )
    vectorize = keras.layers.TextVectorization(
        max_tokens=len(WORDS) + 2, output_sequence_length=3, name="vectorize"
    )
    vectorize.adapt(train_reviews)
    word_ids = vectorize(x["review"])
    city = keras.layers.Embedding(len(CITIES) + 1, 4, name="city_emb")(city_id)
    words = keras.layers.Embedding(len(WORDS) + 2, 8, name="word_emb")(word_ids)
    words = keras.layers.GlobalAveragePooling1D(name="mean_words")(words)
    h = keras.layers.Concatenate(name="concat")([city, words])
    h = keras.layers.Dense(16, activation="relu", name="hidden")(h)
    outputs = keras.layers.Dense(1, name="rating")(h)
    # keras_stage: the Model class that stages fit, evaluate and predict.
    return keras_stage.Model(inputs, outputs, name="ratings")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    train_count, epochs = (1088, 2) if args.tiny else (8192, 5)
    keras.utils.set_random_seed(SEED)

    x_train, y_train = make_reviews(train_count, seed=1)
    x_test, y_test = make_reviews(train_count // 4, seed=2)
    print(
        f"{train_count} raw examples like city={x_train['city'][0]!r}, "
        f"review={x_train['review'][0]!r} -> rating {y_train[0, 0]:.2f}"
    )
    model = build_model(x_train["review"])
    # keras_stage: smart_stage=True runs the string lookups in the stage.
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    plan = model.get_stage_plan()
    print(f"Runs in the stage: {', '.join(plan.staged_layers)}")
    print(f"Runs in the train step: {', '.join(plan.trunk_layers)}")

    print(f"\nfit, {epochs} epochs; the PrefetchCallback's verdict per epoch:")
    history = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=epochs,
        # keras_stage: the callback reports how long the step waited.
        callbacks=[keras_stage.callbacks.PrefetchCallback(verbose=1)],
        verbose=0,
    )
    for key in ("loss", "stage_wait_ratio", "stage_buffer_fill"):
        values = ", ".join(f"{v:.3f}" for v in history.history[key])
        print(f"  {key}: {values}")

    test_loss = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f"\nevaluate on {len(y_test)} held-out examples: mse {test_loss:.4f}")
    raw = {key: values[:3] for key, values in x_test.items()}
    predicted = model.predict(raw, verbose=0)
    print("predict on raw strings:")
    for city, review, rating in zip(
        raw["city"], raw["review"], predicted[:, 0], strict=True
    ):
        print(f"  {city!r:>8} {review!r:<26} -> {rating:.3f}")

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ratings.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    names = [layer.name for layer in loaded.layers]
    print(
        "\nsaved to .keras and loaded back: a keras_stage.Model: "
        f"{isinstance(loaded, keras_stage.Model)}, smart_stage="
        f"{loaded.smart_stage}"
    )
    print(f"  its layers: {', '.join(names)}")
    print(
        "  preprocessing kept: "
        f"{'city_lookup' in names and 'vectorize' in names}"
    )
    again = loaded.predict(raw, verbose=0)
    same = np.array_equal(predicted, again)
    print(
        f"  loaded.predict(raw strings) equals model.predict: {same} "
        f"(max |difference| {np.max(np.abs(predicted - again)):.2g})"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
