"""`Workload`: one model and its data, written once for every benchmark.

A workload is raw data, the preprocessing a user would put in the model and
a trunk; from those come the whole model (a `StagedInput` first, staged) and
the hand split (the same layers in `dataset.map`, a `keras.Model` trunk).
"""

import keras
import tensorflow as tf


class Workload:
    """Raw data, preprocessing and a trunk; subclasses fill these in.

    `steps` and `quick_steps`: batches of one timed epoch of `bench`;
    `backends`: where its preprocessing runs in tf.data.
    """

    name = description = ""
    batch_size, steps, quick_steps = 256, 40, 12
    backends = ("tensorflow",)

    def data(self, rows, seed=0):
        """`rows` raw examples in memory: `(x, y)`."""
        raise NotImplementedError

    def inputs(self):
        """Fresh `keras.Input`(s) of one raw example."""
        raise NotImplementedError

    def preprocessing(self, adapt):
        """A function `x -> features` of fresh layers (adapted to `adapt`),
        for `keras.Input`s and `dataset.map`; None: nothing to preprocess."""
        return None

    def trunk(self, features):
        """Fresh trunk layers on `features`; returns the outputs."""
        raise NotImplementedError

    def compile_kwargs(self, learning_rate=1e-3):
        """What `compile` gets (fresh objects each call)."""
        optimizer = keras.optimizers.Adam(learning_rate)
        return {"optimizer": optimizer, "loss": "mse"}

    def _features(self, adapt, seed, staged_input=None):
        keras.utils.set_random_seed(seed)
        inputs = self.inputs()
        x = inputs if staged_input is None else staged_input(inputs)
        preprocess = self.preprocessing(adapt)
        features = x if preprocess is None else preprocess(x)
        keras.utils.set_random_seed(seed)
        return inputs, preprocess, features

    def whole(self, base, adapt, staged_input=None, seed=0):
        """The whole model of class `base`, `staged_input` on its inputs."""
        inputs, _, features = self._features(adapt, seed, staged_input)
        return base(inputs, self.trunk(features))

    def split(self, adapt, seed=0):
        """The hand split: `(preprocess or None, trunk keras.Model)`,
        `preprocess` mapping a raw batch's `x` (for `dataset.map`)."""
        _, preprocess, features = self._features(adapt, seed)
        names = keras.tree.map_structure(lambda _: None, features)
        if isinstance(features, dict):
            names = {key: key for key in features}
        trunk_inputs = keras.tree.map_structure_up_to(
            features, _input_like, features, names
        )
        trunk = keras.Model(trunk_inputs, self.trunk(trunk_inputs))
        if preprocess is None:
            return None, trunk

        def mapped(x):
            out = preprocess(x)
            if keras.backend.backend() == "jax":  # JAX has no int64
                out = tf.nest.map_structure(_int32, out)
            # tf.data's maps return tuples, not lists.
            return tuple(out) if isinstance(out, list) else out

        return mapped, trunk

    def dataset(self, x, y=None, shuffle_seed=None):
        """`x` (and `y`) batched; shuffled every epoch with a seed."""
        data = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y))
        if shuffle_seed is not None:
            rows = len(keras.tree.flatten(x)[0])
            data = data.shuffle(rows, seed=shuffle_seed)
        return data.batch(self.batch_size)


def _input_like(tensor, name):
    dtype = tensor.dtype
    if dtype == "int64" and keras.backend.backend() == "jax":
        dtype = "int32"  # as the map casts them
    return keras.Input(tensor.shape[1:], dtype=dtype, name=name)


def _int32(tensor):
    return tf.cast(tensor, tf.int32) if tensor.dtype == tf.int64 else tensor
