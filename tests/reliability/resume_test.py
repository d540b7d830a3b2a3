"""Exactly-once resume: a staged run killed mid-epoch and restarted.

A training process with `keras.callbacks.BackupAndRestore` is killed with
SIGKILL in the middle of an epoch and started again. Across the whole run,
every example of every epoch must be trained on exactly once: none lost in
the stage's buffer, none repeated. The trunk records the ids of the
examples it trains on; a callback commits them to a log whenever
BackupAndRestore saves the weights (what a kill loses is what was trained
after the last save, weights and ids alike).
"""

import json
import os
import signal
import subprocess
import sys
import warnings
from collections import Counter

import pytest

from tests.helpers import run_forked, write_script

NUM_EXAMPLES = 96
BATCH = 4
EPOCHS = 3
SAVE_FREQ = 5

SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
import numpy as np
import tensorflow as tf
import keras
import keras_stage

backup_dir, log_path, kill_at, deterministic, smart_stage, source = (
    sys.argv[1:7])
kill_at = tuple(int(v) for v in kill_at.split(",")) if kill_at else None
keras.utils.set_random_seed(0)
recorded = []


class Recorder(keras.layers.Layer):
    # In the trunk (it follows a Dense): records the ids of each trained
    # batch, in the training step.
    def call(self, inputs):
        h, ids = inputs

        def note(ids):
            recorded.extend(int(i) for i in ids.numpy())
            return np.int64(0)

        done = tf.py_function(note, [ids], tf.int64)
        with tf.control_dependencies([done]):
            return tf.identity(h)


class Commit(keras.callbacks.Callback):
    # Writes the recorded ids exactly when BackupAndRestore saves (same
    # schedule: every {save_freq} batches), and at the end of the run.
    def __init__(self):
        super().__init__()
        self.epoch, self.last, self.since = 0, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.since += batch + 1 if batch <= self.last else batch - self.last
        self.last = batch
        if self.since >= {save_freq}:
            self.since = 0
            self.commit()
        if kill_at == (self.epoch, batch):
            os.kill(os.getpid(), 9)

    def on_epoch_end(self, epoch, logs=None):
        self.last = 0

    def on_train_end(self, logs=None):
        self.commit()

    def commit(self):
        with open(log_path, "a") as f:
            f.write(json.dumps({{"ids": recorded}}) + "\\n")
        recorded.clear()


class Epochs(keras.callbacks.Callback):
    # Tags recorded ids with their epoch (a marker in the id stream).
    def on_epoch_begin(self, epoch, logs=None):
        recorded.append(-1 - epoch)


fit_data = {{}}
if source == "dataset":
    ids = tf.data.Dataset.range({n}).shuffle({n}, seed=7)
    fit_data["x"] = ids.map(
        lambda i: ({{"id": i, "x": tf.reshape(tf.cast(i, tf.float32), [1])}},
                   tf.reshape(tf.cast(i % 3, tf.float32), [1]))
    ).batch({batch})
else:  # NumPy arrays, batched (and shuffled) by Keras
    ids = np.arange({n}, dtype="int64")
    fit_data = dict(
        x={{"id": ids, "x": ids.astype("float32")[:, None]}},
        y=(ids % 3).astype("float32")[:, None],
        batch_size={batch},
        shuffle=source == "arrays-shuffled",
    )

inputs = {{"id": keras.Input((), dtype="int64", name="id"),
          "x": keras.Input((1,), name="x")}}
staged = keras_stage.layers.StagedInput(
    capacity=4, num_threads=2, deterministic=deterministic == "1")(inputs)
x = keras.layers.Rescaling(0.01)(staged["x"])
h = keras.layers.Dense(4)(x)
h = Recorder()([h, staged["id"]])
model = keras_stage.Model(inputs, keras.layers.Dense(1)(h))
model.compile(optimizer="sgd", loss="mse", smart_stage=smart_stage == "1")
backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq={save_freq})
model.fit(**fit_data, epochs={epochs}, verbose=0,
          callbacks=[Epochs(), backup, Commit()])
print("done")
"""


def _write_script(tmp_path, template):
    """`tmp_path/train.py`: `template` filled in with this module's sizes."""
    return write_script(
        tmp_path,
        template,
        n=NUM_EXAMPLES,
        batch=BATCH,
        epochs=EPOCHS,
        save_freq=SAVE_FREQ,
    )


def _run(tmp_path, kill_at, deterministic, smart_stage, source):
    script = _write_script(tmp_path, SCRIPT)
    args = [
        sys.executable,
        str(script),
        str(tmp_path / "backup"),
        str(tmp_path / "ids.jsonl"),
        kill_at,
        "1" if deterministic else "0",
        "1" if smart_stage else "0",
        source,
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=240)


def _committed_ids_per_epoch(log_path):
    """{epoch: Counter of ids} from the committed log."""
    per_epoch, epoch = {}, None
    with open(log_path) as f:
        for line in f:
            for i in json.loads(line)["ids"]:
                if i < 0:
                    epoch = -1 - i
                    per_epoch.setdefault(epoch, Counter())
                else:
                    per_epoch[epoch][i] += 1
    return per_epoch


@pytest.mark.reliability
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "deterministic,smart_stage,source",
    [
        pytest.param(True, True, "dataset", marks=pytest.mark.long),
        pytest.param(False, True, "dataset", marks=pytest.mark.long),
        pytest.param(True, False, "dataset", marks=pytest.mark.long),
        pytest.param(True, True, "arrays", marks=pytest.mark.long),
        pytest.param(True, True, "arrays-shuffled", marks=pytest.mark.long),
    ],
    ids=[
        "deterministic",
        "nondeterministic",
        "no-smart-stage",
        "arrays",
        "arrays-shuffled",
    ],
)
def test_killed_run_resumes_with_every_example_once(
    tmp_path, deterministic, smart_stage, source
):
    # Killed in epoch 1 at batch 13, three batches after the save at 10:
    # the stage's buffer holds batches past 13 when it dies.
    killed = _run(tmp_path, "1,13", deterministic, smart_stage, source)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert os.path.isdir(tmp_path / "backup")

    resumed = _run(tmp_path, "", deterministic, smart_stage, source)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "done" in resumed.stdout

    per_epoch = _committed_ids_per_epoch(tmp_path / "ids.jsonl")
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, counts in per_epoch.items():
        missing = set(range(NUM_EXAMPLES)) - set(counts)
        repeated = {i: n for i, n in counts.items() if n > 1}
        assert not missing and not repeated, (
            f"epoch {epoch}: {len(missing)} examples never trained "
            f"({sorted(missing)[:10]}), repeated: {repeated}"
        )


@pytest.mark.reliability
@pytest.mark.timeout(120)
def test_generator_source_warns_that_its_position_cannot_be_saved(tmp_path):
    import keras
    import numpy as np

    import keras_stage

    def batches():
        for _ in range(6):
            yield np.ones((2, 2), "float32"), np.ones((2, 1), "float32")

    inputs = keras.Input((2,))
    x = keras_stage.layers.StagedInput(capacity=2, num_threads=1)(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    backup = keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)
    # Recorded rather than pytest.warns: Keras's generator adapter also
    # warns (a NumPy deprecation) and this checks ours only.
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        history = model.fit(
            batches(), shuffle=False, verbose=0, callbacks=[backup]
        )
    ours = [x for x in w if "position cannot be saved" in str(x.message)]
    assert len(ours) == 1 and ours[0].category is UserWarning
    assert len(history.history["loss"]) == 1


@pytest.mark.reliability
@pytest.mark.timeout(120)
def test_backup_folder_holds_at_most_two_iterator_checkpoints(tmp_path):
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_stage
    from keras_stage.callbacks.data_backup import SUBDIR

    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((64, 2), "float32"), np.ones((64, 1), "float32"))
    ).batch(2)
    inputs = keras.Input((2,))
    x = keras_stage.layers.StagedInput(capacity=2, num_threads=1)(inputs)
    model = keras_stage.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    backup = keras.callbacks.BackupAndRestore(
        str(tmp_path), save_freq=3, delete_checkpoint=False
    )
    model.fit(data, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    names = os.listdir(tmp_path / SUBDIR)
    prefixes = {n.split(".")[0] for n in names if n.startswith("iterator-")}
    assert 1 <= len(prefixes) <= 2, names
    with open(tmp_path / SUBDIR / "position.json") as f:
        position = json.load(f)
    assert position["epoch"] == 1 and position["iterator"]


SAME_RUN_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
import numpy as np
import tensorflow as tf
import keras
import keras_stage

backup_dir, out, kill_at, source = sys.argv[1:5]
# "e,b": after training batch b of epoch e; "val:e,b": after validation
# batch b of epoch e's validation.
during_validation = kill_at.startswith("val:")
kill_at = kill_at.removeprefix("val:")
kill_at = tuple(int(v) for v in kill_at.split(",")) if kill_at else None
keras.utils.set_random_seed(0)


class Kill(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not during_validation and kill_at == (self.epoch, batch):
            os.kill(os.getpid(), 9)

    def on_test_batch_end(self, batch, logs=None):
        if during_validation and kill_at == (self.epoch, batch):
            os.kill(os.getpid(), 9)


ids = np.arange({n}, dtype="int64")
inputs = keras.Input((1,), name="x")
staged = keras_stage.layers.StagedInput(capacity=4, num_threads=2)(inputs)
h = keras.layers.Dense(4)(keras.layers.Rescaling(0.01)(staged))
model = keras_stage.Model(inputs, keras.layers.Dense(1)(h))
# Adam: its update reads the optimizer's iteration count.
model.compile(optimizer="adam", loss="mse", metrics=["mae"], smart_stage=True)
callbacks = [Kill()]
if backup_dir != "-":
    callbacks.insert(0, keras.callbacks.BackupAndRestore(
        backup_dir, save_freq={save_freq}))
x, y = ids.astype("float32")[:, None], (ids % 3).astype("float32")[:, None]
if source == "dataset":  # reshuffled each epoch, from its seed's sequence
    data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
        {n}, seed=7).batch({batch}))
else:  # Keras shuffles arrays the same in every epoch under a global seed
    data = dict(x=x, y=y, batch_size={batch}, shuffle=True)
history = model.fit(**data, epochs={epochs}, verbose=0, callbacks=callbacks,
          validation_data=(x[:16], y[:16]), validation_batch_size={batch})
np.savez(out, *model.get_weights(),
         iterations=int(model.optimizer.iterations),
         loss=np.array(history.history["loss"]),
         mae=np.array(history.history["mae"]),
         val_loss=np.array(history.history["val_loss"]))
print("done")
"""


@pytest.mark.reliability
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "source, kill_at",
    [
        # The default suite keeps one kill and resume (`make test`); the
        # other kill points are a long sweep (`make test-long`).
        pytest.param("arrays", "1,13", marks=pytest.mark.long),
        ("dataset", "1,13"),
        pytest.param("arrays", "val:1,2", marks=pytest.mark.long),
        pytest.param("dataset", "val:1,2", marks=pytest.mark.long),
    ],
    ids=[
        "arrays",
        "dataset",
        "arrays-during-validation",
        "dataset-during-validation",
    ],
)
def test_a_resumed_run_ends_with_the_uninterrupted_run_s_iterations_and_weights(
    tmp_path, source, kill_at
):
    # Killed in epoch 1 at batch 13, resumed after the save at batch 10
    # (or during epoch 1's validation, resumed after the save at batch 20,
    # a checkpoint taken after the stage had read the epoch's source to
    # its end).
    # The resumed epoch's data ends 13 steps before Keras's count of the
    # epoch; a step that ran into that end still counted an optimizer
    # iteration (73 where 72 were trained), and Adam's later updates
    # differed by it. And Keras makes an iterator after an epoch it
    # stepped through, not after one that ended early: the reshuffled
    # dataset's epoch 2 drew the order of the sequence's wrong draw.
    import numpy as np

    script = _write_script(tmp_path, SAME_RUN_SCRIPT)

    def run(backup, out, kill_at=""):
        # `python train.py ...` in a process of its own, forked from one
        # that imported TensorFlow (run_forked): killed, it dies alone.
        args = [str(script), backup, str(out), kill_at, source]
        return run_forked(args, code=script.read_text(), timeout=240)

    reference = run("-", tmp_path / "reference.npz")
    assert reference.returncode == 0, reference.stderr[-3000:]
    backup = str(tmp_path / "backup")
    killed = run(backup, tmp_path / "resumed.npz", kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run(backup, tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    want = np.load(tmp_path / "reference.npz")
    got = np.load(tmp_path / "resumed.npz")
    assert int(got["iterations"]) == int(want["iterations"]) == 72
    weights = [k for k in want.files if k.startswith("arr_")]
    for key in weights:
        np.testing.assert_array_equal(got[key], want[key])
    # The History from the resume on: the resumed epoch's loss averages
    # the whole epoch (its metrics saved with the position), as unstopped.
    np.testing.assert_array_equal(got["loss"], want["loss"][1:])
    np.testing.assert_array_equal(got["mae"], want["mae"][1:])
    np.testing.assert_array_equal(got["val_loss"], want["val_loss"][1:])
