"""`Workload`: what every benchmark workload provides, and how it is built.

This module owns the contract between a workload and the modes that train
it. A workload is a whole model, `raw inputs -> preprocessing layers ->
trunk`, plus the raw data it is fed. From those three parts the base class
builds everything a mode needs: the whole model (optionally with a
`StagedInput` first), the trunk alone on `keras.Input`s at the cut, the
preprocessing as a plain function (for a hand-written `tf.data` pipeline),
and the raw dataset.

The preprocessing is a list of Keras layers. The same classes run in the
model (plain, SmartStage) and, called as a function, in `dataset.map`
(expert mode) or `keras_stage.data.stage` (input-bound mode), so every mode
does exactly the same work per batch.
"""

import keras
import tensorflow as tf

# Scales of the trunk's width for `--trunk`: names for the usual choices;
# any positive number is also accepted.
TRUNK_SCALES = {"light": 1.0, "heavy": 4.0}


def trunk_scale(value):
    """The width multiplier of a `--trunk` value ("light", "heavy", "2.5").

    Args:
        value: A name in `TRUNK_SCALES`, a number, or a string of one.

    Returns:
        The multiplier, a positive float.

    Raises:
        ValueError: If `value` is neither a known name nor a positive number.
    """
    if isinstance(value, str) and value in TRUNK_SCALES:
        return TRUNK_SCALES[value]
    try:
        scale = float(value)
    except (TypeError, ValueError):
        scale = 0.0
    if not scale > 0:
        raise ValueError(
            f"Invalid trunk {value!r}: expected one of "
            f"{sorted(TRUNK_SCALES)} or a positive width multiplier."
        )
    return scale


def scaled(width, scale):
    """`width * scale`, rounded, at least 1."""
    return max(1, round(width * scale))


class Workload:
    """One benchmark workload: raw data, preprocessing layers and a trunk.

    Subclasses set the class attributes and implement `make_raw_data`,
    `raw_inputs`, `preprocessing` and `trunk`.

    Args:
        steps: Batches per epoch (one timed repetition is one epoch).
        trunk: Width multiplier of the trunk, or a name in `TRUNK_SCALES`.
        batch_size: Batch size; `None` for the workload's default.
        seed: Seed of the generated data and of the model weights.
        data_dir: Where a workload that writes files writes them; `None`
            for a temporary folder removed by `close`.
    """

    name = ""
    description = ""
    default_batch_size = 256
    # Batches per epoch of `make bench` and of `make bench-quick`: enough
    # steps that an epoch's time is mostly steps, not its start and end.
    default_steps = 40
    quick_steps = 12
    # Default repetitions of `make bench` (and `make bench-quick`) times
    # this; an explicit `--reps` is taken as it is.
    reps_factor = 1

    def __init__(
        self, steps, trunk="light", batch_size=None, seed=0, data_dir=None
    ):
        if steps < 1:
            raise ValueError(f"steps must be at least 1; got {steps}")
        self.steps = int(steps)
        self.trunk_scale = trunk_scale(trunk)
        self.batch_size = int(batch_size or self.default_batch_size)
        self.seed = seed
        self.data_dir = data_dir
        self._raw = None

    # -- to implement -------------------------------------------------------

    def make_raw_data(self):
        """The raw examples in memory: `(x, y)`, `steps * batch_size` long."""
        raise NotImplementedError

    def raw_inputs(self):
        """Fresh `keras.Input`(s) for one raw example."""
        raise NotImplementedError

    def preprocessing(self):
        """Fresh preprocessing layers, applied in order (may be empty)."""
        raise NotImplementedError

    def trunk(self, features):
        """Builds fresh trunk layers on `features`; returns the outputs."""
        raise NotImplementedError

    def compile_kwargs(self):
        """What `compile` gets: optimizer and loss (fresh each call)."""
        return {"optimizer": keras.optimizers.Adam(1e-3), "loss": "mse"}

    def params(self):
        """Workload-specific sizes, for the report."""
        return {}

    # -- built from the above -----------------------------------------------

    def raw_data(self):
        """`make_raw_data()`, generated once and kept."""
        if self._raw is None:
            self._raw = self.make_raw_data()
        return self._raw

    def raw_dataset(self):
        """Batches of raw examples and labels: a plain `tf.data` dataset.

        Exactly `steps` batches, tf.data's default options, no map: this
        is what the plain, staged and input-bound modes are fed.
        """
        x, y = self.raw_data()
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(self.batch_size)

    def preprocess_fn(self):
        """The preprocessing as a plain function of a raw batch.

        Returns:
            A function `raw batch -> features` running fresh instances of
            `preprocessing()`'s layers (in training mode, as in `fit`), or
            `None` when the workload has no preprocessing.
        """
        layers = self.preprocessing()
        if not layers:
            return None

        def preprocess(x):
            for layer in layers:
                x = layer(x, training=True)
            return x

        return preprocess

    def whole_model(self, model_class=keras.Model, staged_input=None):
        """The whole model: raw inputs -> preprocessing -> trunk.

        Args:
            model_class: `keras.Model` or `keras_stage.Model`.
            staged_input: A `StagedInput` layer put first, or `None`.

        Returns:
            An uncompiled model of `model_class`.
        """
        keras.utils.set_random_seed(self.seed)
        inputs = self.raw_inputs()
        x = inputs if staged_input is None else staged_input(inputs)
        for layer in self.preprocessing():
            x = layer(x)
        return model_class(inputs, self.trunk(x), name=f"{self.name}_whole")

    def trunk_model(self):
        """The trunk alone, on `keras.Input`s shaped like the features."""
        # The features' shapes and dtypes, from a symbolic pass of the
        # preprocessing (compute_output_spec of each layer).
        features = self.raw_inputs()
        for layer in self.preprocessing():
            features = layer(features)
        keras.utils.set_random_seed(self.seed)
        if isinstance(features, dict):
            # Named after their keys: Keras warns about dict inputs
            # whose tensor names differ from the keys.
            inputs = {
                key: keras.Input(t.shape[1:], dtype=t.dtype, name=key)
                for key, t in features.items()
            }
        else:
            inputs = keras.Input(features.shape[1:], dtype=features.dtype)
        return keras.Model(
            inputs, self.trunk(inputs), name=f"{self.name}_trunk"
        )

    def info(self):
        """What the report says about the workload."""
        description = self.description  # the widths of `--trunk light`
        if self.trunk_scale != 1:
            description += (
                f"; trunk widths x{self.trunk_scale:g} (--trunk; the "
                "sizes are in the JSON's info)"
            )
        return {
            "description": description,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "trunk_scale": self.trunk_scale,
            "seed": self.seed,
            **self.params(),
        }

    def close(self):
        """Removes what the workload wrote (nothing by default)."""
