"""`keras_stage.Model`: `keras.Model` whose data can go through a stage.

`Model(inputs, outputs)` returns `Functional`, a subclass of its own:
Keras's rewriting of the class's bases would break subclassing.
"""

import keras

from keras_stage import _compat
from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.staging_mixin import StagingMixin


def _functional_init_arguments(args, kwargs):
    # The same test as Keras's Model.__new__ (tests/_compat_test.py checks
    # that they agree).
    return (
        (len(args) == 2)
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


@keras.saving.register_keras_serializable(package="keras_stage")
class Model(StagingMixin, keras.Model):
    """A `keras.Model` that stages its data when it has a `StagedInput`.

    A drop-in replacement for `keras.Model` in both styles, functional
    (`keras_stage.Model(inputs, outputs)`) and subclassing
    (`class MyModel(keras_stage.Model)`). With a `StagedInput` applied to
    its inputs, `fit`, `evaluate` and `predict` run the input data through
    a stage with that layer's options (see `keras_stage.data.stage`);
    without one, it is exactly a `keras.Model`. `compile` also takes
    `smart_stage` (kept through `.keras` save/load).

    Example:

    >>> import numpy as np, keras, keras_stage
    >>> inputs = keras.Input(shape=(3,))
    >>> x = keras_stage.layers.StagedInput(capacity=2, num_threads=2)(inputs)
    >>> model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    >>> model.compile(optimizer="sgd", loss="mse", smart_stage=False)
    >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4,
    ...                     epochs=2, verbose=0)
    >>> len(history.history["loss"])
    2
    """

    def __new__(cls, *args, **kwargs):
        if _functional_init_arguments(args, kwargs):
            if cls is Model:
                return Functional.__new__(Functional, *args, **kwargs)
            if not _defines_init(cls):
                # Its arguments reach `keras.Model.__init__`: functional.
                _inject_functional(cls)
        return super().__new__(cls, *args, **kwargs)


def _defines_init(cls):
    """Whether a subclass of `Model` defines its own `__init__` (whose
    arguments are its own, not `keras.Model`'s)."""
    for klass in cls.__mro__:
        if klass is Model:
            return False
        if "__init__" in vars(klass):
            return True
    return False


def _inject_functional(cls):
    """Puts `Functional` in place of `Model` among the bases of `cls`, a
    subclass called as `cls(inputs, outputs)`, as Keras's `Model.__init__`
    puts its Functional in place of `keras.Model`; Keras's own would give
    `Model` both, an inconsistent method resolution order."""
    if cls is Model:
        return Functional
    if not issubclass(cls, Model) or issubclass(cls, Functional):
        return cls
    cls.__bases__ = tuple(_inject_functional(base) for base in cls.__bases__)
    return cls


@keras.saving.register_keras_serializable(package="keras_stage")
class Functional(_compat.keras_functional_class(), Model):
    """The class of `keras_stage.Model(inputs, outputs)` models."""

    def __new__(cls, *args, **kwargs):
        return keras.Model.__new__(cls)

    def call(self, inputs, training=None, mask=None, **kwargs):
        # Keras's Functional.call precedes StagingMixin's in the MRO.
        return tensorflow_steps.call_model(
            self, super().call, inputs, training=training, mask=mask, **kwargs
        )

    call.keras_stage_routed = True
