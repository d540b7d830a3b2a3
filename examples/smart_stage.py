"""SmartStage: which layers `compile(smart_stage=True)` runs in the stage.

The model reads raw CSV lines ("age,income,city") and has a mix of layers:

- stageable ones, which touch no state that training changes: a layer that
  parses the lines (`tf.io.decode_csv`), an adapted `Normalization`, a
  `Hashing` of the city, a `GaussianNoise` augmentation (random layers
  draw from a seed stream of their own in the stage) and a frozen
  "pretrained" `Dense` encoder (`trainable=False`);
- layers that must stay in the trunk, the train step: a
  `BatchNormalization(center=False, scale=False)` after the frozen encoder
  (no trainable weights, but it updates its moving statistics while
  training), the city `Embedding` and the Dense head (trainable weights),
  and whatever depends on them.

It prints `model.stage_summary()`, then the same plan from
`model.get_stage_plan()` as data (staged layers, trunk layers with the
reason for each, the tensors that cross the cut), and trains a few epochs
to show the split model trains and predicts from raw lines.

Run with `python -m examples.smart_stage` (`--tiny` for a smoke run).
See docs/smart-stage.md.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402

SEED = 0
CITIES = ["paris", "lyon", "nice", "lille", "brest"]
HASH_BINS = 16


@keras.saving.register_keras_serializable(package="keras_stage_examples")
class ParseRow(keras.layers.Layer):
    """Parses "age,income,city" lines into numbers and a city string."""

    def call(self, lines):
        age, income, city = tf.io.decode_csv(lines, [[0.0], [0.0], [""]])
        return {"numbers": tf.stack([age, income], axis=1), "city": city}

    def compute_output_spec(self, lines):
        # Keras cannot infer string outputs by tracing; say what they are.
        return {
            "numbers": keras.KerasTensor((lines.shape[0], 2), "float32"),
            "city": keras.KerasTensor(lines.shape, "string"),
        }


def make_lines(count):
    rng = np.random.default_rng(SEED)
    age = rng.integers(18, 80, count)
    income = rng.normal(40_000, 12_000, count).round()
    city = rng.integers(0, len(CITIES), count)
    lines = np.array(
        [
            f"{a},{i:.0f},{CITIES[c]}"
            for a, i, c in zip(age, income, city, strict=True)
        ],
        dtype=object,
    )
    spend = (age / 80 + income / 80_000 + city / len(CITIES)).astype("float32")
    return lines, spend[:, None]


def build_model(lines):
    inputs = keras.Input(shape=(), dtype="string", name="line")
    x = keras_stage.layers.StagedInput(capacity=4, num_threads=2)(inputs)
    row = ParseRow(name="parse_row")(x)

    normalize = keras.layers.Normalization(name="normalize")
    normalize.adapt(ParseRow()(tf.constant(list(lines)))["numbers"])
    numbers = normalize(row["numbers"])
    numbers = keras.layers.GaussianNoise(0.05, seed=SEED, name="noise")(numbers)
    encoder = keras.layers.Dense(8, activation="tanh", name="pretrained")
    encoder.trainable = False  # frozen: training reads it, never writes it
    numbers = encoder(numbers)
    # No trainable weights (no center, no scale), yet it must stay in the
    # trunk: it updates its moving statistics on every training batch.
    numbers = keras.layers.BatchNormalization(
        center=False, scale=False, name="batch_norm"
    )(numbers)

    city = keras.layers.Hashing(num_bins=HASH_BINS, name="city_hash")(
        row["city"]
    )
    city = keras.layers.Embedding(HASH_BINS, 4, name="city_emb")(city)

    h = keras.layers.Concatenate(name="concat")([numbers, city])
    outputs = keras.layers.Dense(1, name="head")(h)
    return keras_stage.Model(inputs, outputs, name="spend")


def print_plan(plan):
    print("\nThe same plan as data, model.get_stage_plan():")
    print(f"  staged_layers: {plan.staged_layers}")
    print(f"  trunk_layers:  {plan.trunk_layers}")
    print("  reasons (why each trunk layer is not staged):")
    for name in plan.trunk_layers:
        print(f"    {name:<12} {plan.reasons[name]}")
    print("  boundary (what the stage hands to the train step):")
    for tensor in plan.boundary:
        print(
            f"    {tensor.name:<16} {tensor.dtype:<8} "
            f"shape={tensor.shape} {tensor.bytes_per_example} bytes/example"
        )
    print(f"  cut: {plan.cut_reason}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    count, epochs = (256, 1) if args.tiny else (16_384, 4)
    keras.utils.set_random_seed(SEED)

    lines, spend = make_lines(count)
    print(f"{count} lines like {lines[0]!r} -> spend {spend[0, 0]:.2f}")
    model = build_model(lines[:1024])
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    print("\nmodel.stage_summary():")
    model.stage_summary(line_length=90)
    print_plan(model.get_stage_plan())

    print(f"\nfit, {epochs} epoch(s): the staged layers run on the stage's")
    print("threads, the trunk in the train step")
    history = model.fit(
        lines,
        spend,
        batch_size=128,
        epochs=epochs,
        callbacks=[keras_stage.callbacks.PrefetchCallback(verbose=1)],
        verbose=0,
    )
    print("  loss: " + ", ".join(f"{v:.4f}" for v in history.history["loss"]))
    predicted = model.predict(lines[:3], verbose=0)[:, 0]
    print("predict on raw lines (the whole model, preprocessing included):")
    for line, value, target in zip(
        lines[:3], predicted, spend[:3, 0], strict=True
    ):
        print(f"  {line!r:<24} -> {value:.2f} (target {target:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
