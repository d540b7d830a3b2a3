"""keras_stage/models/backends/tensorflow.py: `TensorFlowBackend`.

The JAX backend's own runs are in the jax environment (tests/jax/); the
refusal of the backends keras_stage does not stage on is base_test.py's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_stage
from keras_stage.models import backends
from keras_stage.models.backends.tensorflow import (
    TensorFlowBackend,
    worker_count,
)


def _model():
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput(name="stage")(inputs)
    return keras_stage.Model(inputs, keras.layers.Dense(1)(x))


def test_tensorflow_runs_graph_steps_with_device_buffers():
    backend = backends.for_model(_model())
    assert isinstance(backend, TensorFlowBackend)
    assert backend.reads_in_graph("train") and backend.uses_device_buffer
    assert not backend.reads_in_graph("predict")


def test_tensorflow_is_supported():
    model = _model()
    backends.get("tensorflow").check_supported(model, model.get_layer("stage"))
    assert tuple(backends.BACKENDS) == ("tensorflow", "jax", "torch")


def test_string_arrays_are_left_to_keras_on_tensorflow():
    words = np.array(["a", "b"], dtype=object)
    assert (
        TensorFlowBackend("tensorflow").host_arrays({"w": words})["w"] is words
    )


def test_a_string_model_exports_on_tensorflow(tmp_path):
    inputs = keras.Input(shape=(), dtype="string")
    x = keras_stage.layers.StagedInput()(inputs)
    x = keras.layers.Hashing(num_bins=4)(x)
    model = keras_stage.Model(inputs, x)
    TensorFlowBackend("tensorflow").check_exportable(model)  # nothing to refuse
    model.export(str(tmp_path / "exported"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "exported"))
    assert served.serve(tf.constant(["a"])).shape == (1,)


def test_one_machine_strategies_count_one_worker():
    assert worker_count(tf.distribute.get_strategy()) == 1
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0"])
    assert worker_count(mirrored) == 1


_TWO_WORKERS = r"""
import json, os, sys
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": [f"localhost:{p}" for p in sys.argv[1:3]]},
    "task": {"type": "worker", "index": int(sys.argv[3])},
})
import keras, numpy as np, tensorflow as tf
import keras_stage
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput()(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
data = np.ones((8, 2), "float32")
try:
    model.fit(data, data[:, :1], batch_size=4, verbose=0)
except NotImplementedError as e:
    print("REFUSED", str(e).replace("\n", " "))
else:
    print("TRAINED")
# Neither worker exits before both are done: the other may still be pulling
# a collective's buffer (compile's broadcast of the initial weights) from
# this one's server ("Socket closed" otherwise, under load).
import time
done = sys.argv[4]
open(os.path.join(done, sys.argv[3]), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(done)) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.timeout(180)
def test_a_staged_fit_with_two_real_workers_says_what_works(tmp_path):
    # Two worker processes of one MultiWorkerMirroredStrategy cluster on
    # this machine: Keras 3 cannot fit there (keras-team/keras#20585), and
    # the staged fit says so at once instead of failing in its first step.
    import socket

    from tests.helpers import run_forked_together

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            ports.append(str(s.getsockname()[1]))
    # Two processes of their own, forked side by side from one that
    # imported TensorFlow (run_forked_together): the script sets TF_CONFIG
    # before it makes the strategy, which reads it.
    workers = run_forked_together(
        [
            dict(
                argv=["worker.py", *ports, str(index), str(tmp_path)],
                code=_TWO_WORKERS,
                env={"TF_CPP_MIN_LOG_LEVEL": "2"},
            )
            for index in range(2)
        ],
        timeout=150,
    )
    for worker in workers:
        out, err = worker.stdout, worker.stderr
        assert worker.returncode == 0, err[-3000:]
        assert "REFUSED" in out, (out, err[-3000:])
        assert "2 workers" in out
        assert "keras-team/keras#20585" in out
        assert "MirroredStrategy" in out
