"""A run killed at 20 random points and resumed ends as one never stopped.

One training run is killed with SIGKILL at 20 points drawn at random over
its course (mid-epoch, during validation, at an epoch's end, and inside a
backup: after Keras's write and before keras_stage's, with Keras's weights
or metadata torn, and inside keras_stage's own write), resumed after each,
and compared with the same run never stopped: the same weights (bit for
bit), optimizer iterations and History from the last resume on, and every
step trained on the same examples in the same order.

Two runs, each with `keras.utils.set_random_seed`, a staged random
augmentation layer (GaussianNoise), a Dropout in the trunk, Adam and
`deterministic=True`: a reshuffling seeded dataset with
`BackupAndRestore(save_freq=5)`, and shuffled arrays with `save_freq=6`
(every epoch's last batch saved). The points are drawn anew each run; the
seed is in every failure message (`KERAS_STAGE_KILL_SEED=...` replays it).
"""

import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import write_script

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.long,
    pytest.mark.timeout(1200),
]

NUM_EXAMPLES = 96
BATCH = 4
EPOCHS = 3
STEPS = NUM_EXAMPLES // BATCH  # per epoch
VAL_STEPS = 4
# Backups every 5 steps of 24-step epochs (the last batch saved only
# after a resume shifts them), or every 6 (the last batch of every epoch
# saved: a resumed epoch with no step left).
SAVE_FREQS = {"dataset": 5, "arrays": 6}
KILLS = 20

SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
import numpy as np
import tensorflow as tf
import keras
import keras_stage
from keras_stage.callbacks import data_backup

backup_dir, out, log_path, source, save_freq, point = sys.argv[1:7]
save_freq = int(save_freq)
# "train:g" after global step g; "val:e,b" after validation batch b of
# epoch e; "end:e" at epoch e's end; "ahead:g", "tornw:g", "tornm:g",
# "ours:g" at the first backup at or after step g: after Keras's write,
# before keras_stage's; Keras's weights, or its metadata, torn; inside
# keras_stage's own write.
kind, _, where = point.partition(":")
where = tuple(int(v) for v in where.split(",")) if where else ()
keras.utils.set_random_seed(0)
N, B = {n}, {batch}


def die():
    os.kill(os.getpid(), 9)


armed = []
copy = data_backup._copy


def copy_or_die(source, target):
    # keras_stage's write: its iterator checkpoint is written, the copy of
    # Keras's save and the journal are not.
    if armed:
        die()
    return copy(source, target)


data_backup._copy = copy_or_die
trained = []


class Recorder(keras.layers.Layer):
    # In the trunk (it follows a Dense): the ids each step trains on.
    def call(self, inputs):
        h, x = inputs

        def note(x):
            trained.append([int(round(v * N)) for v in x.numpy().ravel()])
            return np.int64(0)

        done = tf.py_function(note, [x], tf.int64)
        with tf.control_dependencies([done]):
            return tf.identity(h)


class Backup(keras.callbacks.BackupAndRestore):
    def on_train_batch_end(self, batch, logs=None):
        weights = os.path.join(backup_dir, "latest.weights.h5")

        def stamp():
            if not os.path.exists(weights):
                return 0
            return os.stat(weights).st_mtime_ns

        before = stamp()
        super().on_train_batch_end(batch, logs)
        saved = stamp() != before
        step = int(self.model.optimizer.iterations) - 1
        if not saved or kind not in ("ahead", "tornw", "tornm", "ours"):
            return
        if step < where[0]:
            return
        if kind == "ahead":
            die()
        if kind == "ours":
            armed.append(True)
            return
        path = weights if kind == "tornw" else os.path.join(
            backup_dir, "training_metadata.json")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        die()


class Points(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations) - 1
        with open(log_path, "a") as f:
            f.write(json.dumps([step, trained[-1]]) + "\\n")
        del trained[:]
        if kind == "train" and where == (step,):
            die()

    def on_test_batch_end(self, batch, logs=None):
        del trained[:]
        if kind == "val" and where == (self.epoch, batch):
            die()

    def on_epoch_end(self, epoch, logs=None):
        if kind == "end" and where == (epoch,):
            die()


ids = np.arange(N, dtype="int64")
x = ids.astype("float32")[:, None] / N
y = (ids % 3).astype("float32")[:, None]
if source == "dataset":
    fit_data = dict(
        x=tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=7).batch(B)
    )
else:
    fit_data = dict(x=x, y=y, batch_size=B, shuffle=True)
inputs = keras.Input((1,), name="x")
noisy = keras_stage.layers.StagedInput(capacity=4, num_threads=2)(inputs)
# Small enough noise that the trunk still reads each id from x.
noisy = keras.layers.GaussianNoise(2e-4, seed=3, name="noise")(noisy)
h = keras.layers.Dense(8, name="hidden")(noisy)
h = keras.layers.Dropout(0.3, seed=5, name="drop")(h)
h = Recorder(name="recorder")([h, noisy])
model = keras_stage.Model(inputs, keras.layers.Dense(1, name="out")(h))
model.compile(optimizer="adam", loss="mse", metrics=["mae"], smart_stage=True)
assert "noise" in model.get_stage_plan().staged_layers
history = model.fit(
    **fit_data,
    epochs={epochs},
    verbose=0,
    validation_data=(x[:16], y[:16]),
    validation_batch_size=B,
    callbacks=[Backup(backup_dir, save_freq=save_freq), Points()],
)
np.savez(
    out,
    *model.get_weights(),
    iterations=int(model.optimizer.iterations),
    **{{k: np.array(v) for k, v in history.history.items()}},
)
print("done")
"""


def _timeline():
    """Every kill point of the run, in the order the run passes them."""
    points = []
    for epoch in range(EPOCHS):
        points += [f"train:{epoch * STEPS + b}" for b in range(STEPS)]
        points += [f"val:{epoch},{b}" for b in range(VAL_STEPS)]
        points.append(f"end:{epoch}")
    return points


def _draw(rng, save_freq):
    """20 distinct points in run order, of every kind."""
    timeline = _timeline()
    by_kind = {}
    for point in timeline:
        by_kind.setdefault(point.partition(":")[0], []).append(point)
    chosen = rng.sample(by_kind["train"], 9)
    chosen += rng.sample(by_kind["val"], 4)
    chosen += rng.sample(by_kind["end"], 2)
    # A backup comes within save_freq steps of any step before the last
    # ones; a write point is the first backup at or after its step.
    steps = [p for p in by_kind["train"] if p not in chosen]
    last = EPOCHS * STEPS - save_freq
    steps = [p for p in steps if int(p.split(":")[1]) < last]
    kinds = ["ahead", "tornw", "tornm", "ours"]
    writes = rng.sample(steps, 5)
    chosen += [
        f"{kinds[i % 4]}:{p.split(':')[1]}" for i, p in enumerate(writes)
    ]

    def position(point):
        # Where the run passes it. A write point fires at the first backup
        # at or after its step: up to save_freq - 1 steps later, which
        # still leaves every later point reachable (the resumed run goes
        # back to the save before that backup, before the write point's
        # step).
        kind, _, where = point.partition(":")
        where = [int(v) for v in where.split(",")]
        if kind == "val":
            return (where[0] * STEPS + STEPS - 1, 1, where[1])
        if kind == "end":
            return (where[0] * STEPS + STEPS - 1, 2, 0)
        return (where[0], 0, 0)

    return sorted(chosen, key=position)


def _script(tmp_path):
    return write_script(
        tmp_path, SCRIPT, n=NUM_EXAMPLES, batch=BATCH, epochs=EPOCHS
    )


def _trained(log_path):
    """Step -> ids, the last write winning (a kill loses what came after
    the last backup, and the resumed run trains those steps again)."""
    steps = {}
    with open(log_path) as f:
        for line in f:
            if line.endswith("\n"):  # a kill can cut the last line
                step, ids = json.loads(line)
                steps[step] = ids
    return steps


@pytest.mark.parametrize("source", ["dataset", "arrays"])
def test_twenty_random_kills_resume_to_the_uninterrupted_run(tmp_path, source):
    drawn = random.SystemRandom().randrange(10**6)  # not the tests' seed
    seed = int(os.environ.get("KERAS_STAGE_KILL_SEED", drawn))
    rng = random.Random(seed)
    save_freq = SAVE_FREQS[source]
    points = _draw(rng, save_freq)
    assert len(set(points)) == KILLS
    replay = f"(replay: KERAS_STAGE_KILL_SEED={seed}; points {points})"
    script = _script(tmp_path)

    def run(backup, out, log, point=""):
        args = [sys.executable, str(script), backup, str(out), str(log)]
        args += [source, str(save_freq), point]
        return subprocess.run(args, capture_output=True, text=True, timeout=300)

    reference = run(
        str(tmp_path / "ref_backup"),
        tmp_path / "reference.npz",
        tmp_path / "reference.jsonl",
    )
    assert reference.returncode == 0, reference.stderr[-3000:]

    backup = str(tmp_path / "backup")
    log = tmp_path / "killed.jsonl"
    runs = []
    for point in points:
        killed = run(backup, tmp_path / "resumed.npz", log, point)
        assert killed.returncode == -signal.SIGKILL, (
            f"{point} did not kill the run {replay}: {killed.stderr[-3000:]}"
        )
        runs.append(killed)
    resumed = run(backup, tmp_path / "resumed.npz", log)
    assert resumed.returncode == 0, f"{replay}: {resumed.stderr[-3000:]}"
    runs.append(resumed)
    # A run after a kill inside a backup goes back to the save before it,
    # and says so; after any other kill the last backup is whole.
    writes = ("ahead", "tornw", "tornm", "ours")
    for point, after in zip(points, runs[1:], strict=True):
        inside = point.partition(":")[0] in writes
        assert ("was interrupted" in after.stderr) == inside, (
            f"after {point} {replay}: {after.stderr[-3000:]}"
        )

    want = np.load(tmp_path / "reference.npz")
    got = np.load(tmp_path / "resumed.npz")
    assert int(got["iterations"]) == int(want["iterations"]) == EPOCHS * STEPS
    weights = [k for k in want.files if k.startswith("arr_")]
    diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in weights)
    assert diff == 0.0, f"max |weight difference| {diff} {replay}"
    epochs = len(got["loss"])
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_array_equal(
            got[key], want[key][-epochs:], err_msg=f"{key} {replay}"
        )
    # Every step trained on the uninterrupted run's examples, in its
    # order: each example once per epoch.
    expected = _trained(tmp_path / "reference.jsonl")
    assert sorted(expected) == list(range(EPOCHS * STEPS))
    for epoch in range(EPOCHS):
        ids = [i for s in range(STEPS) for i in expected[epoch * STEPS + s]]
        assert sorted(ids) == list(range(NUM_EXAMPLES))
    assert _trained(log) == expected, replay
    print(
        f"{source} seed {seed}: {KILLS} kills {points}; "
        f"max |weight diff| {diff}"
    )
