"""keras_stage/models/backends/torch_batches.py: a stage's batches as torch
tensors. Runs where torch is installed (`make test-torch`); skipped in the
TensorFlow environment, which has no torch."""

import numpy as np
import pytest
import tensorflow as tf

torch = pytest.importorskip("torch")

from keras_stage.models.backends import torch_batches  # noqa: E402


def test_dense_tensors_become_torch_views_and_strings_stay():
    batch = {
        "x": tf.constant([[1.5, 2.5]]),
        "ids": tf.constant([[3]], tf.int64),
        "mask": tf.constant([True]),
        "word": tf.constant(["a"]),
    }
    converted = torch_batches.to_torch(batch)
    assert converted["x"].dtype == torch.float32
    assert converted["ids"].dtype == torch.int64
    assert converted["mask"].dtype == torch.bool
    assert converted["x"].tolist() == [[1.5, 2.5]]
    assert isinstance(converted["word"], tf.Tensor)
    # A view of the tensor's buffer, not a copy.
    assert converted["x"].data_ptr() == np.asarray(batch["x"]).ctypes.data


def test_the_loader_counts_and_repeats_its_epochs():
    rows = tf.data.Dataset.from_tensor_slices(
        (np.arange(6.0, dtype="float32"), np.arange(6))
    )
    dataset = rows.batch(4)
    loader = torch_batches.data_loader(dataset)
    assert len(loader) == 2  # Keras's batch count, from the cardinality
    for _ in range(2):  # each epoch reads the dataset again
        batches = list(loader)
        assert [x.tolist() for x, _ in batches] == [[0, 1, 2, 3], [4, 5]]
        assert all(isinstance(y, torch.Tensor) for _, y in batches)
    unknown = torch_batches.data_loader(
        rows.filter(lambda x, y: y < 5).batch(4)
    )
    with pytest.raises(TypeError):
        len(unknown)  # Keras then counts as it reads
    assert sum(len(x) for x, _ in unknown) == 5


def test_batches_stay_on_the_cpu_where_keras_trains():
    assert torch_batches.trunk_device().type == "cpu"
    batches = torch_batches.TorchBatches(tf.data.Dataset.range(3).batch(2))
    assert all(batch.device.type == "cpu" for batch in batches)


class _RecordedCopies(torch_batches.DeviceCopies):
    """`DeviceCopies` with the CUDA copies and waits recorded instead."""

    def __init__(self, events):
        self._events = events

    def start(self, batch):
        self._events.append(("copy", batch))
        return batch

    def ready(self, batch):
        self._events.append(("step", batch))
        return batch


def test_the_next_batch_is_copied_before_the_step_takes_this_one():
    events = []
    out = list(_RecordedCopies(events).one_ahead(iter([1, 2, 3])))
    assert out == [1, 2, 3]
    assert events == [
        ("copy", 1),
        ("copy", 2),
        ("step", 1),
        ("copy", 3),
        ("step", 2),
        ("step", 3),
    ]
    assert list(_RecordedCopies([]).one_ahead(iter([]))) == []


def test_the_seed_draw_is_a_loader_iterator_s():
    # What Keras's read of the first batch would draw from torch's
    # generator, which an unseeded Dropout then draws its masks from.
    loader = torch_batches.data_loader(tf.data.Dataset.range(4).batch(2))
    torch.manual_seed(0)
    iter(loader)
    expected = torch.random.get_rng_state()
    torch.manual_seed(0)
    torch_batches.draw_loader_seed()
    assert torch.equal(torch.random.get_rng_state(), expected)
    torch.manual_seed(0)
    assert not torch.equal(torch.random.get_rng_state(), expected)
