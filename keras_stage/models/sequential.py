"""`keras_stage.Sequential`: `keras.Sequential` whose data can be staged."""

import keras

from keras_stage.models.staging_mixin import StagingMixin


@keras.saving.register_keras_serializable(package="keras_stage")
class Sequential(StagingMixin, keras.Sequential):
    """A `keras.Sequential` that stages its data when it has a `StagedInput`.

    Put the `StagedInput` first, right after `keras.Input`. See
    `keras_stage.Model` for what staging changes (only where the data
    comes from) and `keras_stage.data.stage` for the options.

    Example:

    >>> import numpy as np, keras, keras_stage
    >>> model = keras_stage.Sequential([
    ...     keras.Input(shape=(3,)),
    ...     keras_stage.layers.StagedInput(capacity=2, num_threads=2),
    ...     keras.layers.Dense(1),
    ... ])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> model.predict(np.ones((4, 3)), verbose=0).shape
    (4, 1)
    """
