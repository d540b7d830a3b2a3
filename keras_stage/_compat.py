"""The only place keras_stage touches private TensorFlow/Keras symbols.

Each function wraps one private attribute with a comment saying why it is
unavoidable; `tests/compat_test.py` fails loudly when a new release moves
one. Keras is imported inside the functions that need it, so the Keras-free
engine (`keras_stage.data`) can use this module too.
"""


def dataset_variant(dataset):
    """The variant tensor of a `tf.data.Dataset`.

    `tf.data.Dataset.__init__` takes it to build a dataset subclass (what
    `StagedDataset` is), but TF exposes it only as `_variant_tensor`.
    """
    return dataset._variant_tensor


def get_data_adapter(**kwargs):
    """Keras's own converter of fit/evaluate/predict inputs to tf.data.

    keras_stage must turn numpy arrays, generators and PyDatasets into a
    dataset exactly as Keras does (same batching, same shuffling, same
    class weights) before staging it; Keras has no public API for this.
    """
    from keras.src.trainers.data_adapters import get_data_adapter as get

    return get(**kwargs)


def train_validation_split(arrays, validation_split):
    """Keras's split of arrays for `validation_split` (last fraction)."""
    from keras.src.trainers.data_adapters.array_slicing import (
        train_validation_split as split,
    )

    return split(arrays, validation_split=validation_split)


def keras_functional_class():
    """Keras's `Functional` model class.

    `keras_stage.Model(inputs, outputs)` must build a functional model of a
    keras_stage class without letting Keras rewrite `keras_stage.Model`'s
    bases (see `models/model.py`); Keras exports no public name for it.
    """
    from keras.src.models.functional import Functional

    return Functional
