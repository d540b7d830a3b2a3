"""keras_stage/models/backends/torch.py: `TorchBackend`, read on TensorFlow.

Its runs are in the torch environment (tests/torch/); here, what it answers
without running a torch step.
"""

from keras_stage.models import backends
from keras_stage.models.backends.torch import TorchBackend


def test_torch_is_a_staging_backend_reading_every_batch_in_python():
    backend = backends.get("torch")
    assert isinstance(backend, TorchBackend)
    assert not backend.reads_in_graph("train")
    assert not backend.may_run_unstaged and not backend.native_tf
    assert not backend.jit_by_default
