"""`TorchBackend`: Keras's torch steps run eagerly in Python and take each
batch from a `DataLoader` over the stage's eager dataset; the stage hands
them torch tensors it made ahead (`torch_batches.py`)."""

import logging

from keras_stage.models.backends.jax import JaxBackend

logger = logging.getLogger("keras_stage")


class TorchBackend(JaxBackend):
    """The PyTorch backend; see `Backend` and the module docstring."""

    jit_by_default = False  # Keras's "auto" on torch: eager steps

    def check_supported(self, model, layer):
        pass

    def feed(self, data, phase):
        return data.eager_dataset

    def shard_batches(self, dataset):
        return None

    def narrows_int64(self):
        return False
