"""`TorchBackend`: Keras's torch steps run in Python, one batch at a time,
from a `torch.utils.data.DataLoader`. The stage hands Keras one over its
eager dataset whose batches are already torch tensors: views of the stage's
buffers on the CPU (DLPack, no copy), and on a GPU copies made one batch
ahead from pinned memory on a stream of their own."""

import keras
import tensorflow as tf

from keras_stage.models.backends.jax import JaxBackend
from keras_stage.models.model_state import keras_builds


class TorchBackend(JaxBackend):
    """The PyTorch backend; see `Backend` and the module docstring.

    As on JAX, every batch is read in Python and every call is staged; the
    stage's buffer stays on the host and `TorchBatches` puts each batch on
    the trunk's device (`torch_batches.py`).
    """

    jit_by_default = False  # Keras's "auto" on torch: eager steps
    device_note = (
        "on the PyTorch backend the stage's buffer stays on the host and "
        "each batch goes to the device Keras trains on (pinned memory, "
        "copied one batch ahead on a CUDA stream of its own)"
    )
    export_refusal = (
        "torch has no string tensors: its exports trace the model with "
        "numeric tensors only"
    )

    def check_strategy(self, model):
        """Refuses what Keras's torch trainer cannot fit with one stage."""
        if keras.distribution.distribution() is not None:
            raise NotImplementedError(
                f"Model '{model.name}' would fit under a keras.distribution, "
                "which Keras supports on the JAX backend only. On PyTorch, "
                "train one process per device with "
                "torch.nn.parallel.DistributedDataParallel and a loop of "
                "your own (keras.io's 'Multi-GPU distributed training with "
                "PyTorch'), reading `keras_stage.data.stage(dataset.shard("
                "world_size, rank))`; or use KERAS_BACKEND=jax with "
                "keras.distribution."
            )
        if tf.distribute.has_strategy():
            strategy = type(tf.distribute.get_strategy()).__name__
            raise NotImplementedError(
                f"Model '{model.name}' is fit inside a tf.distribute "
                f"strategy's scope ({strategy}), which Keras's torch "
                "trainer ignores. Fit "
                "outside the scope, or set KERAS_BACKEND=tensorflow to "
                "train under the strategy."
            )
        world = _torch_world_size()
        if world > 1:
            raise NotImplementedError(
                f"Model '{model.name}' would fit in one of {world} "
                "torch.distributed processes: Keras's fit neither shards "
                "the data nor averages gradients across them, so each "
                "would train its own copy on all the data. Train with "
                "torch.nn.parallel.DistributedDataParallel and a loop of "
                "your own, reading `keras_stage.data.stage(dataset.shard("
                "world_size, rank))`."
            )

    def feed(self, data, phase):
        """A `DataLoader` of `TorchBatches` over the stage's eager dataset
        (Keras takes it as it is; a `tf.data.Dataset` it would convert in
        each step, a copy per tensor)."""
        # torch is imported on this backend only.
        from keras_stage.models.backends import torch_batches

        return torch_batches.data_loader(data.eager_dataset)

    def build(self, model, data, phase):
        """As on JAX (`JaxBackend.build`), and the torch generator's draw of
        the `DataLoader` iterator Keras's read would make: an unseeded
        `Dropout` draws its masks from that generator."""
        if keras_builds(model):
            from keras_stage.models.backends import torch_batches

            torch_batches.draw_loader_seed()
        super().build(model, data, phase)

    def narrows_int64(self):
        return False  # torch keeps int64


def _torch_world_size():
    import torch  # only on this backend

    distributed = torch.distributed
    if not distributed.is_available() or not distributed.is_initialized():
        return 1
    return distributed.get_world_size()
