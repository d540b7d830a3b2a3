"""Fail-over on the tf.data service: a worker SIGKILLed mid-epoch.

Measured with TF 2.21 alone: the service never ends an epoch whose worker
was lost. The stage ends it (`keras_stage.data.failover`) and reports
exactly what the epoch lost. Workers run in separate processes here, as in
production; each scenario runs in a subprocess with a timeout, so a hang
fails the test instead of stalling the run.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from keras_stage.data import stage
from keras_stage.data.service import LocalService
from tests.helpers import result_of_script
from tests.op_determinism import op_determinism

# Service fail-over: a long sweep (`make test-long`).
pytestmark = pytest.mark.long

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

_PRELUDE = """
import json, os, signal, socket, subprocess, sys, time
sys.path.insert(0, {root!r})
import tensorflow as tf
service = tf.data.experimental.service
with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
dispatcher = service.DispatchServer(
    service.DispatcherConfig(port=port, worker_timeout_ms=2000)
)
WORKER = (
    "import sys, tensorflow as tf\\n"
    "s = tf.data.experimental.service\\n"
    "w = s.WorkerServer(s.WorkerConfig(\\n"
    "    dispatcher_address='localhost:' + sys.argv[1],\\n"
    "    heartbeat_interval_ms=500))\\n"
    "print('UP', flush=True)\\n"
    "w.join()\\n"
)
workers = [
    subprocess.Popen(
        [sys.executable, "-c", WORKER, str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={{**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}},
    )
    for _ in range(2)
]
for w in workers:
    assert w.stdout.readline().strip() == "UP"
target = f"grpc://localhost:{{port}}"


def wait_for_workers(count, seconds=60):
    # A worker joins the dispatcher after it starts; a job made before
    # then has no task on it. Each worker runs the whole probe in
    # parallel_epochs mode: `count` elements once all have joined.
    probe = tf.data.Dataset.range(1).apply(
        service.distribute("parallel_epochs", target)
    )
    deadline = time.monotonic() + seconds
    while len(list(probe)) < count:
        assert time.monotonic() < deadline, "the workers did not join"
        time.sleep(0.2)


wait_for_workers(2)


def kill_one():
    workers[0].send_signal(signal.SIGKILL)
    workers[0].wait()
    return time.monotonic()


def slow(x):
    # Native work (a few ms per element) on the workers.
    noise = tf.random.uniform([200, 200])
    return tf.reduce_sum(noise @ noise) * 0 + tf.cast(x, tf.float32)


def finish(result):
    for w in workers:
        w.kill()
    print("RESULT " + json.dumps(result), flush=True)
    # A service read the stage abandoned could hold a normal exit.
    os._exit(0)
"""

_ENGINE = """
staged = stage_fn = None
from keras_stage.data import stage
staged = stage(
    tf.data.Dataset.range(400), slow, num_threads=2, capacity=2,
    timeout=60, worker_timeout=3, service=target,
    processing_mode={mode!r},
)
result = {{"epochs": [], "seconds": [], "after_kill": None}}
# In parallel_epochs each worker streams 0, 1, 2...: 0 seen twice means
# both streams have started (a stream that never started is not counted,
# see docs/limitations.md), so the kill cuts a counted one.
started_streams = 1 if {mode!r} == "distributed_epoch" else 2
killed = None
for epoch in range(3):
    started, got = time.monotonic(), []
    for i, x in enumerate(staged):
        got.append(int(x))
        if (
            epoch == 0 and killed is None and i >= 30
            and got.count(0) >= started_streams
        ):
            killed = kill_one()
    if epoch == 0:
        result["after_kill"] = time.monotonic() - killed
    result["epochs"].append(got)
    result["seconds"].append(time.monotonic() - started)
result["reports"] = staged.service_ledger.epochs
finish(result)
"""

_FIT = """
import numpy as np, keras
import keras_stage
x = np.arange(4000, dtype="float32").reshape(-1, 1) / 4000
x = np.concatenate([x, np.zeros_like(x)], axis=1)
inputs = keras.Input((2,))
staged = keras_stage.layers.StagedInput(
    service=target, processing_mode={mode!r}, capacity=2, timeout=60,
    # Well above a loaded CI's pauses: a later epoch's survivor may pause
    # for seconds when other tests share the 2 cores, and a pause this
    # long would end its epoch as if its worker were lost.
    worker_timeout=10,
)(inputs)
# A staged computation slow enough for the kill to land mid-epoch.
prefix = keras.layers.Lambda(lambda t: t + 0 * tf.reduce_sum(
    tf.random.uniform([300, 300]) @ tf.random.uniform([300, 300])))(staged)
model = keras_stage.Model(inputs, keras.layers.Dense(1)(prefix))
model.compile("sgd", "mse", smart_stage=True)
seen = []


class Watch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        # Mid-epoch, once every worker's stream has started (a stream that
        # never started is not counted in parallel_epochs).
        if seen or self.epoch or batch < 20:
            return
        from keras_stage.data import live_stages
        (ledger,) = [
            s.service_ledger for s in live_stages() if s.service_ledger
        ]
        if ledger.streams_started in (None, 2):
            seen.append(kill_one())

    def on_epoch_end(self, epoch, logs=None):
        assert seen, "the first epoch ended before both streams started"


history = model.fit(
    x, x[:, :1], batch_size=32, epochs=3, verbose=0,
    callbacks=[keras_stage.callbacks.PrefetchCallback(), Watch()],
)
finish({{k: v for k, v in history.history.items()}})
"""


# `_FIT` on one dataset object, then another fit on it: the model keeps
# the stage across the two calls, and the second runs on the worker left.
_FIT_AGAIN = _FIT.replace(
    "history = model.fit(\n    x, x[:, :1], batch_size=32,",
    "import tensorflow as tf\n"
    "data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32)\n"
    "history = model.fit(\n    data,",
).replace(
    "finish({{k: v for k, v in history.history.items()}})",
    "kept = model._keras_stage_state.stages['train'].staged\n"
    "again = model.fit(data, epochs=1, verbose=0,\n"
    "    callbacks=[keras_stage.callbacks.PrefetchCallback()])\n"
    "same = model._keras_stage_state.stages['train'].staged is kept\n"
    "finish({{'first': history.history, 'again': again.history,\n"
    "         'same_stage': same}})",
)


def _run(body, mode, timeout=240):
    code = _PRELUDE.format(root=ROOT) + body.format(mode=mode)
    return result_of_script(code, timeout)


@pytest.mark.timeout(300)
def test_a_killed_worker_ends_a_distributed_epoch_with_its_loss_counted():
    result, log = _run(_ENGINE, "distributed_epoch")
    first, *later = result["epochs"]
    reports = result["reports"]
    # The epoch went on past the kill with the other worker, then ended
    # without a hang; nothing came twice (at most once per epoch).
    assert 30 < len(first) <= 400
    assert len(first) == len(set(first))
    # What it lost is counted exactly: the elements that never came.
    assert reports[0]["delivered"] == len(first)
    assert reports[0]["lost"] == 400 - len(first)
    assert reports[0]["repeated"] == 0
    # The epoch ended within worker_timeout (3 s) of the last element,
    # plus the time the survivor needed for the rest.
    assert result["after_kill"] < 30
    # Later epochs run on the survivor and hold every element once, ended
    # by the count (TensorFlow still gives their jobs a task on the lost
    # worker, which would never end).
    for got, report in zip(later, reports[1:], strict=True):
        assert sorted(got) == list(range(400))
        assert report["lost"] == 0 and report["repeated"] == 0
    if reports[0]["lost"]:
        assert "lost" in log


@pytest.mark.timeout(300)
def test_a_killed_worker_ends_a_parallel_epoch_with_its_copy_counted():
    result, _ = _run(_ENGINE, "parallel_epochs")
    first, *later = result["epochs"]
    reports = result["reports"]
    # Every worker runs the whole dataset: each element at most twice.
    counts = np.bincount(first, minlength=400)
    assert counts.max() <= 2
    assert reports[0]["copies"] == 2
    assert reports[0]["expected"] == 800
    assert reports[0]["delivered"] == len(first)
    assert reports[0]["lost"] == 800 - len(first)
    assert reports[0]["lost"] > 0
    assert reports[0]["ended_early"] is True
    # The survivor's copy is whole.
    assert (counts >= 1).all()
    for got, report in zip(later, reports[1:], strict=True):
        assert sorted(got) == list(range(400))
        assert report["copies"] == 1
        assert report["lost"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["distributed_epoch", "parallel_epochs"])
def test_a_fit_goes_on_after_a_killed_worker_and_logs_each_epochs_loss(mode):
    history, log = _run(_FIT, mode)
    copies = 2 if mode == "parallel_epochs" else 1
    assert len(history["loss"]) == 3  # every epoch ran
    assert all(np.isfinite(history["loss"]))
    delivered = history["stage_service_delivered"]
    lost = history["stage_service_lost"]
    repeated = history["stage_service_repeated"]
    assert len(delivered) == len(lost) == len(repeated) == 3
    assert repeated == [0, 0, 0]
    # The kill epoch: its copies' examples, delivered or lost, no other.
    assert delivered[0] + lost[0] == 4000 * copies
    # After it, one worker: a whole pass per epoch in distributed mode;
    # in parallel mode the last partial batch re-formed by the trainer
    # waits for an end the lost worker's task never gives, and is lost
    # (4000 = 125 full batches of 32: none here).
    for d, n in zip(delivered[1:], lost[1:], strict=True):
        assert d + n == 4000
        assert n == 0, (history, log[-4000:])


@pytest.mark.timeout(300)
def test_a_fit_after_a_killed_worker_reuses_its_stage_on_the_survivor():
    assert "data," in _FIT_AGAIN and "same_stage" in _FIT_AGAIN
    result, log = _run(_FIT_AGAIN, "distributed_epoch")
    first, again = result["first"], result["again"]
    assert len(first["loss"]) == 3 and len(again["loss"]) == 1
    # A dataset's size is not known to the ledger (no loss counted): the
    # epochs after the kill deliver whole passes, ended by the service.
    assert first["stage_service_delivered"][1:] == [4000, 4000]
    # The next call runs the stage the first built, on the worker left: a
    # whole pass, not ended early.
    assert result["same_stage"]
    assert again["stage_service_delivered"] == [4000], (again, log[-4000:])
    assert again["stage_service_ended_early"] == [0]
    assert all(np.isfinite(again["loss"]))


def test_healthy_epochs_lose_nothing_and_end_by_themselves():
    # In-process workers, nothing killed: the service ends every epoch,
    # and the ledger counts every element once per copy.
    with LocalService(num_workers=2) as running:
        for mode, copies in (("distributed_epoch", 1), ("parallel_epochs", 2)):
            staged = stage(
                tf.data.Dataset.range(50),
                lambda x: x + 1,
                service=running.target,
                processing_mode=mode,
                worker_timeout=30,
            )
            for _ in range(2):
                got = sorted(int(x) for x in staged)
                assert got == sorted(list(range(1, 51)) * copies)
            reports = staged.service_ledger.epochs
            assert [r["delivered"] for r in reports] == [50 * copies] * 2
            assert [r["lost"] for r in reports] == [0, 0]
            # A parallel epoch ends with its workers' streams; a
            # distributed one once it holds the whole source.
            assert not any(r["ended_early"] for r in reports)


def test_worker_timeout_none_counts_without_the_end_branch():
    with LocalService(num_workers=1) as running:
        staged = stage(
            tf.data.Dataset.range(20),
            service=running.target,
            worker_timeout=None,
        )
        assert sorted(int(x) for x in staged) == list(range(20))
        assert staged.service_ledger.epochs[-1]["lost"] == 0


@pytest.mark.parametrize("bad", [0, -1.0, "10", True, float("nan")])
def test_worker_timeout_names_the_argument(bad):
    with pytest.raises(ValueError, match="worker_timeout"):
        stage(tf.data.Dataset.range(3), worker_timeout=bad)


@pytest.mark.timeout(120)
def test_under_op_determinism_the_service_stage_runs_whole_epochs(caplog):
    # Op determinism makes tf.data take interleaved branches in turn, so
    # the end branch would hold up every read: the stage drops it then
    # (no fail-over; its `timeout` applies) and says so.
    with LocalService(num_workers=2) as running:
        with op_determinism(), caplog.at_level("WARNING", "keras_stage"):
            # Built under it, as op determinism asks (no clock traced).
            staged = stage(
                tf.data.Dataset.range(50),
                lambda x: x + 1,
                service=running.target,
                worker_timeout=30,
            )
            for _ in range(2):
                got = sorted(int(x) for x in staged)
                assert got == list(range(1, 51))
        reports = staged.service_ledger.epochs
        assert [r["delivered"] for r in reports] == [50, 50]
        assert not any(r["ended_early"] for r in reports)
        warned = [
            r.getMessage()
            for r in caplog.records
            if "op determinism" in r.getMessage()
            and "cannot end an epoch" in r.getMessage()
        ]
        assert len(warned) == 1
