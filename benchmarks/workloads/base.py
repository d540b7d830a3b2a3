"""`Workload`: one model and its data, written once for every benchmark.

A workload is raw data, the preprocessing a user would put in the model
(parsing, hashing, lookups, decoding) and a trunk. From those the base class
builds what every mode needs: the whole model (with a `StagedInput` first,
for keras_stage) and the hand split (the same preprocessing layers in
`dataset.map`, a `keras.Model` of the trunk). The same layer classes run in
every mode, so every mode does the same work per batch.
"""

import keras
import tensorflow as tf


class Workload:
    """Raw data, preprocessing and a trunk; subclasses fill these in.

    Class attributes: `name`, `description`, `batch_size`, `steps` and
    `quick_steps` (batches of one timed epoch of `bench`, full and quick),
    `backends` (where its preprocessing runs in tf.data: off TensorFlow the
    features must stop before the first non-preprocessing layer).
    """

    name = ""
    description = ""
    batch_size = 256
    steps = 40
    quick_steps = 12
    backends = ("tensorflow",)

    def data(self, rows, seed=0):
        """`rows` raw examples in memory: `(x, y)`."""
        raise NotImplementedError

    def inputs(self):
        """Fresh `keras.Input`(s) of one raw example."""
        raise NotImplementedError

    def preprocessing(self, adapt):
        """A function `x -> features` of fresh preprocessing layers.

        `adapt` is the raw `x` of the training data, for layers that adapt.
        The function runs on `keras.Input`s and inside `dataset.map`.
        `None` when there is nothing to preprocess.
        """
        return None

    def trunk(self, features):
        """Fresh trunk layers on `features`; returns the outputs."""
        raise NotImplementedError

    def compile_kwargs(self, learning_rate=1e-3):
        """What `compile` gets (fresh objects each call)."""
        return {
            "optimizer": keras.optimizers.Adam(learning_rate),
            "loss": "mse",
        }

    # -- built from the above ----------------------------------------------

    def whole(self, base, adapt, staged_input=None, seed=0):
        """The whole model of class `base`, `staged_input` on its inputs."""
        keras.utils.set_random_seed(seed)
        inputs = self.inputs()
        x = inputs if staged_input is None else staged_input(inputs)
        preprocess = self.preprocessing(adapt)
        features = x if preprocess is None else preprocess(x)
        keras.utils.set_random_seed(seed)
        return base(inputs, self.trunk(features))

    def split(self, adapt, seed=0):
        """The hand split: `(preprocess or None, trunk keras.Model)`.

        `preprocess` maps a raw batch's `x` (for `dataset.map`).
        """
        keras.utils.set_random_seed(seed)
        inputs = self.inputs()
        preprocess = self.preprocessing(adapt)
        features = inputs if preprocess is None else preprocess(inputs)
        keras.utils.set_random_seed(seed)
        trunk_inputs = keras.tree.map_structure_up_to(
            features, _input_like, features, _names(features)
        )
        trunk = keras.Model(trunk_inputs, self.trunk(trunk_inputs))
        if preprocess is None:
            return None, trunk

        def mapped(x):
            out = preprocess(x)
            # tf.data maps return tuples, not lists; JAX has no int64.
            if keras.backend.backend() == "jax":
                out = tf.nest.map_structure(_int32, out)
            return tuple(out) if isinstance(out, list) else out

        return mapped, trunk

    def dataset(self, x, y=None, shuffle_seed=None):
        """`x` (and `y`) batched; shuffled every epoch with a seed."""
        data = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y))
        if shuffle_seed is not None:
            rows = len(keras.tree.flatten(x)[0])
            data = data.shuffle(rows, seed=shuffle_seed)
        return data.batch(self.batch_size)


def _names(features):
    """Input names for the trunk: a dict's keys, else None per tensor."""
    if isinstance(features, dict):
        return {key: key for key in features}
    return keras.tree.map_structure(lambda _: None, features)


def _input_like(tensor, name):
    dtype = tensor.dtype
    if dtype == "int64" and keras.backend.backend() == "jax":
        dtype = "int32"  # as the map casts them: JAX has no int64
    return keras.Input(tensor.shape[1:], dtype=dtype, name=name)


def _int32(tensor):
    return tf.cast(tensor, tf.int32) if tensor.dtype == tf.int64 else tensor
