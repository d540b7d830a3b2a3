"""`TorchBatches`: a stage's batches as torch tensors, for Keras's torch
trainer, which takes a `torch.utils.data.DataLoader` as it is (a tf.data
dataset it would convert in the step, a copy per tensor).

Imported on the torch backend only (it imports torch).
"""

import keras
import tensorflow as tf
import torch


def data_loader(dataset):
    """A `DataLoader` over `TorchBatches(dataset)`, batches as they come.

    Keras counts a DataLoader's batches with `len` where its dataset has
    one, as it counts a tf.data dataset's with its cardinality.
    """
    batches = int(dataset.cardinality())
    if batches < 0:
        return torch.utils.data.DataLoader(
            TorchBatches(dataset), batch_size=None
        )
    return torch.utils.data.DataLoader(
        SizedTorchBatches(dataset, batches), batch_size=None
    )


def draw_loader_seed():
    """Draws from torch's default generator what a `DataLoader` iterator
    draws for its workers' seed, by making one over no batches."""
    iter(torch.utils.data.DataLoader(_NoBatches(), batch_size=None))


class _NoBatches(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


class TorchBatches(torch.utils.data.IterableDataset):
    """The batches of a tf.data `dataset` as torch tensors on `device`.

    Each `iter` iterates `dataset` again (Keras's next epoch). On the CPU a
    batch is a view of the stage's tensors (`torch.from_dlpack`, no copy);
    on a CUDA device, the next batch is copied from pinned memory on a
    stream of its own while the step runs on the current one
    (`DeviceCopies`).

    Args:
        dataset: a `tf.data.Dataset`. Its dense numeric tensors become
            torch tensors; ragged, sparse and string ones are passed on for
            Keras to convert or refuse.
        device: the torch device the trunk trains on; defaults to Keras's
            (`KERAS_TORCH_DEVICE`, else `cuda` where there is one), read
            when an epoch starts.

    Example:

    >>> import tensorflow as tf
    >>> batches = TorchBatches(tf.data.Dataset.range(4).batch(2))
    >>> [batch.tolist() for batch in batches]
    [[0, 1], [2, 3]]
    """

    def __init__(self, dataset, device=None):
        super().__init__()
        self._dataset = dataset
        self._device = device

    def __iter__(self):
        device = torch.device(self._device or trunk_device())
        batches = map(to_torch, iter(self._dataset))
        if device.type == "cpu":
            return batches
        return DeviceCopies(device).one_ahead(batches)


class SizedTorchBatches(TorchBatches):
    """`TorchBatches` of a dataset of `batches` batches (`len`)."""

    def __init__(self, dataset, batches, device=None):
        super().__init__(dataset, device)
        self._batches = batches

    def __len__(self):
        return self._batches


def trunk_device():
    """The torch device Keras puts new tensors on (its torch trainer's)."""
    return keras.ops.convert_to_tensor(0).device


def to_torch(batch):
    """`batch` with its dense numeric `tf.Tensor`s as torch tensors sharing
    their memory (DLPack); other leaves as they are."""

    def convert(leaf):
        if isinstance(leaf, tf.Tensor) and leaf.dtype != tf.string:
            return torch.from_dlpack(leaf)
        return leaf

    return tf.nest.map_structure(convert, batch)


class DeviceCopies:
    """Copies batches to a CUDA `device` one ahead of the step, on a stream
    of their own, from pinned host memory: the prefetcher of NVIDIA apex's
    ImageNet example, also what `DataLoader(pin_memory=True)` and a
    `non_blocking` copy do for a batch.

    Built on paper: this machine has no GPU. `one_ahead`'s order is tested
    with a stand-in for the copies (tests/models/backends/
    torch_batches_test.py).
    """

    def __init__(self, device):
        self._device = device
        self._stream = torch.cuda.Stream(device)

    def start(self, batch):
        """Starts `batch`'s copy to the device; returns the device batch."""
        with torch.cuda.stream(self._stream):
            return tf.nest.map_structure(self._copy, batch)

    def _copy(self, leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.pin_memory().to(self._device, non_blocking=True)

    def ready(self, batch):
        """`batch`, its copy done before the current stream's next work."""
        current = torch.cuda.current_stream(self._device)
        current.wait_stream(self._stream)
        for leaf in tf.nest.flatten(batch):
            if isinstance(leaf, torch.Tensor):
                # Not freed for the copy stream until the step is done.
                leaf.record_stream(current)
        return batch

    def one_ahead(self, batches):
        """`batches` on the device, each next one's copy started before the
        current one is handed to the step."""
        iterator = iter(batches)
        try:
            current = self.start(next(iterator))
        except StopIteration:
            return
        for following in iterator:
            following = self.start(following)
            yield self.ready(current)
            current = following
        yield self.ready(current)
