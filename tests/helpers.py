"""Helpers shared by the tests."""

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback


def count_step_traces(monkeypatch):
    """The traces of keras_stage models' steps from now on, as they happen.

    A list of `(model name, phase)`, one per trace of a `keras_stage.Model`'s
    train/test/predict step (the trunk's, or the whole model's when it runs
    unstaged), kept for the test's duration.
    """
    import tensorflow as tf

    from keras_stage.models.backends import tensorflow_steps

    traced = []
    calling_trunk = tensorflow_steps.calling_trunk

    def counting(model, phase):
        if not tf.executing_eagerly():
            traced.append((model.name, phase))
        return calling_trunk(model, phase)

    monkeypatch.setattr(tensorflow_steps, "calling_trunk", counting)
    return traced


def twin_optimizer():
    """The optimizer of a test that trains a staged model beside plain Keras.

    SGD: equal batches give equal weights with any optimizer, and Adam's
    slot variables and update would about double what each fit traces.
    Adam's state is tested where it is the point: the `.keras` round trips
    (smart_stage_test, model_test, staged_input_test) and determinism_test's
    model fit before op determinism.
    """
    import keras

    return keras.optimizers.SGD(learning_rate=0.05)


def dense_staged_model(middle=(), smart_stage=False, **options):
    """`(model, layer)`: a `keras_stage.Model` of 2 features through a
    `StagedInput` named "stage" (with `options`), `middle` layers and a
    Dense(1) head, compiled with SGD and MSE."""
    import keras

    import keras_stage

    inputs = keras.Input(shape=(2,))
    x = keras_stage.layers.StagedInput(name="stage", **options)(inputs)
    for layer in middle:
        x = layer(x)
    model = keras_stage.Model(inputs, keras.layers.Dense(1, name="head")(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=smart_stage)
    return model, model.get_layer("stage")


def sweep(cases, kept):
    """`cases` for `pytest.mark.parametrize`, those not in `kept` long.

    A behaviour's cases beyond those `make test` keeps to guard it run in
    `make test-long` (CI runs both): each stays tested, and the default
    suite gives its verdict in minutes.
    """
    import pytest

    missing = set(kept) - set(cases)
    assert not missing, f"kept cases not among the cases: {missing}"
    return [
        case if case in kept else pytest.param(case, marks=pytest.mark.long)
        for case in cases
    ]


def stage_threads():
    """The keras_stage helper threads alive now."""
    return {
        t for t in threading.enumerate() if t.name.startswith("keras_stage")
    }


def wait_until(predicate, timeout=10.0, interval=0.02):
    """Polls `predicate` until it is true or `timeout` seconds have passed.

    Returns its last value, for the test to assert on. A wait for another
    thread (a buffer filling, a thread ending) polls with a deadline far
    beyond what it takes on an idle machine, rather than sleeping for a
    fixed time: it returns as soon as the thing happened, and a slow or
    loaded machine only makes it wait longer.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


# Stacks taken by a test's hang watchdog, printed again at the very end of
# the run (conftest.py): CI shows a failing run's last lines, where the
# full dump in the test's captured stderr may be cut.
HANG_REPORTS = []


def record_hang(test, frames_per_thread=12):
    """Keeps where every other thread is now: its innermost frames.

    As in a traceback, innermost last; the stage's helper threads come
    last, so a log's last lines show the innermost frames of the thread
    that runs the stage's calls.
    """
    here = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sorted(
        sys._current_frames().items(),
        key=lambda item: str(names.get(item[0])).startswith("keras_stage"),
    )
    lines = [f"{test}: threads when the watchdog fired"]
    lines.extend(busiest_threads())
    for ident, frame in frames:
        if ident == here:
            continue
        lines.append(f"  thread {names.get(ident, ident)}:")
        for entry in traceback.extract_stack(frame)[-frames_per_thread:]:
            where = "/".join(entry.filename.split("/")[-2:])
            lines.append(f"    {where}:{entry.lineno} {entry.name}")
    HANG_REPORTS.append("\n".join(lines))


def _thread_cpu():
    """`{(tid, name): CPU seconds}` of this process's OS threads (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu[tid, name] = (int(fields[11]) + int(fields[12])) / ticks
    return cpu


def busiest_threads(seconds=1.0, count=5):
    """Lines naming the OS threads that used the most CPU over `seconds`.

    A test that is slow without being blocked may be starved: a thread
    another test left running (a pipeline pulling from a Python source
    holds the GIL) shows here with its TensorFlow or Python name.
    """
    if not os.path.isdir("/proc/self/task"):
        return []
    before = _thread_cpu()
    time.sleep(seconds)
    after = _thread_cpu()
    used = sorted(
        ((after[key] - before.get(key, 0.0), key) for key in after),
        reverse=True,
    )
    lines = [f"  busiest threads over {seconds:g} s ({len(after)} alive):"]
    for cpu, (tid, name) in used[:count]:
        lines.append(f"    {name} (tid {tid}): {cpu / seconds:.0%} of a core")
    return lines


class GcClock:
    """Seconds the garbage collector ran while the clock was started.

    A slow example may be slow because collections of a process full of
    models take long, not because a stage stalled; a watchdog's report
    says which.
    """

    def __init__(self):
        self.seconds = 0.0
        self.collections = 0
        self._began = None

    def _callback(self, phase, info):
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.collections += 1
            self._began = None

    @property
    def running_seconds(self):
        """How long the collection under way has run, or None if none is.

        A collection that never ends (a finalizer blocked on a lock) shows
        here, and in a thread dump as "Garbage-collecting".
        """
        began = self._began
        return None if began is None else time.perf_counter() - began

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info):
        gc.callbacks.remove(self._callback)


def tensorboard_scalars(folder):
    """{tag: [(step, value), ...]} of every event file under `folder`.

    The reader the TensorBoard example prints from, so that the tests read
    the event files as a user following it would.
    """
    from examples.tensorboard import scalars

    return scalars(folder)


def counters_with(stats, unconsumed):
    """The counters of `stats` with `unconsumed` elements not consumed.

    Finished (slot 0, with the orphans of slot 7) and ready (slot 8).
    """
    counters = stats._counters.numpy()
    counters[0] = counters[2] + counters[7] + unconsumed  # produced
    counters[8] = counters[2] + unconsumed  # ready
    return counters


def printed_in_fresh_python(code, timeout=100):
    """What `code` prints in a new interpreter (which must exit cleanly).

    For what only a fresh process shows: an import blocked with
    `sys.modules[name] = None` before anything imported it.
    """
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    ).stdout


# -- fresh processes forked from one that imported TensorFlow ----------------

# The forking process, started on first use: it imports TensorFlow, Keras
# and NumPy once, then serves requests on a Unix socket, forking a child
# per process asked for. A child starts as a fresh `python -c` would after
# those imports: no TensorFlow op has run, no device is initialised, no
# keras_stage module is loaded, and it exits as an interpreter does (atexit
# handlers, non-daemon threads joined). Importing TensorFlow takes 5-8 s of
# CPU; a fork, a few milliseconds. Under pytest-xdist the workers share
# one forking process (`FORKING_FOLDER`, set by tests/conftest.py); a
# pytest run in one process starts its own.
_FORK_SERVER = r"""
import atexit, json, os, runpy, signal, socket, sys, threading, traceback
import numpy, tensorflow, keras  # noqa: F401

def child(request, out, err):
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = request["argv"]
    try:
        if request.get("module"):
            runpy.run_module(request["module"], run_name="__main__",
                             alter_sys=True)
        else:
            exec(compile(request["code"], "<string>", "exec"),
                 {"__name__": "__main__"})
        status = 0
    except SystemExit as e:
        status = e.code
    except BaseException:
        traceback.print_exc()
        status = 1
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    if request.get("interpreter_exit"):
        # The interpreter's whole exit, as a fresh `python` ends: out of
        # answer(), serve() and this script, then the modules' teardown
        # with the finalizers it runs.
        sys.exit(status)
    # What an interpreter's exit does, in its order (non-daemon threads
    # joined, atexit handlers, the streams flushed), less tearing down
    # the modules of TensorFlow and Keras: a second of CPU, seen by no one.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

def answer(connection):
    # One call, in a process of its own forked for it: the children (run
    # at once: the processes of one cluster), their pids, their statuses.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    stream = connection.makefile("rw")
    requests = json.loads(stream.readline())
    pids = []
    for request in requests:
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT, 0o600)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            stream.close()
            connection.close()
            child(request, out, err)  # ends with os._exit or sys.exit
        os.close(out)
        os.close(err)
        pids.append(pid)
    stream.write(json.dumps(pids) + "\n")
    stream.flush()
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    stream.write(json.dumps(codes) + "\n")
    stream.flush()

def serve(path):
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the answering forks
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(64)
    while True:
        connection, _ = listening.accept()
        if os.fork() == 0:
            listening.close()
            me = os.getpid()
            try:
                answer(connection)
            except BaseException:
                if os.getpid() != me:
                    raise  # a child's interpreter exit (SystemExit)
                traceback.print_exc()  # a caller gone, say
            finally:
                if os.getpid() == me:
                    os._exit(0)  # never back to serving
        connection.close()

serve(sys.argv[1])
"""

# The environment variable naming the folder of a forking process that
# several test processes share: its socket, its pid and the lock under
# which the first to need it starts it (tests/conftest.py sets it in
# pytest-xdist's controller, and ends the process after the run).
FORKING_FOLDER = "KERAS_STAGE_TESTS_FORKING_FOLDER"

_own_folder = None
_started = {}  # folder: the forking process this process started there


def _forking_folder():
    global _own_folder
    shared = os.environ.get(FORKING_FOLDER)
    if shared:
        return shared
    if _own_folder is None:
        import tempfile

        _own_folder = tempfile.mkdtemp(prefix="keras_stage_forking_")
        atexit.register(stop_forking_process, _own_folder)
    return _own_folder


def _connected(path):
    import socket

    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        connection.close()
        return None
    return connection


def _running(folder):
    """The forking process's pid, if it is alive."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(folder, "pid")) as f:
            pid = int(f.read())
        os.kill(pid, 0)
        return pid
    return None


def _connect_to_forking_process():
    import fcntl

    folder = _forking_folder()
    path = os.path.join(folder, "socket")
    connection = _connected(path)
    if connection is not None:
        return connection
    with open(os.path.join(folder, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starts it; the rest wait
        connection = _connected(path)
        if connection is not None:
            return connection
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a forking process that died
        server = subprocess.Popen(
            [sys.executable, "-c", _FORK_SERVER, path],
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
            start_new_session=True,
        )
        _started[folder] = server
        with open(os.path.join(folder, "pid"), "w") as f:
            f.write(str(server.pid))
        deadline = time.monotonic() + 180  # TensorFlow's import
        while connection is None:
            if server.poll() is not None or time.monotonic() > deadline:
                stop_forking_process(folder)
                raise RuntimeError("the forking process did not start")
            time.sleep(0.05)
            connection = _connected(path)
        return connection


def stop_forking_process(folder):
    """Ends the forking process of `folder` and its children; removes it."""
    import shutil

    pid = _running(folder)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    server = _started.pop(folder, None)
    if server is not None:
        server.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _next_line(connection, pending, seconds):
    """`(line, rest)`: the next line from `connection`, None after `seconds`.

    Read from its file descriptor, not with a buffered readline: that can
    take both of a call's lines (the pids and, once a quick child has
    ended, the exit codes) off the socket at once, and a `select` on it
    then waits for a line already read.
    """
    deadline = time.monotonic() + seconds
    while b"\n" not in pending:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([connection], [], [], max(left, 0))
        if not ready:
            return None, pending
        chunk = connection.recv(65536)
        if not chunk:
            raise EOFError
        pending += chunk
    line, pending = pending.split(b"\n", 1)
    return line.decode(), pending


def run_forked(
    argv,
    code=None,
    module=None,
    cwd=None,
    env=None,
    timeout=100,
    interpreter_exit=False,
):
    """`subprocess.run(argv, capture_output=True, text=True)`, forked.

    Runs `code` (as `python -c code` would) or `module` (as `python -m
    module`) in a child of the forking process above, with `sys.argv` set
    to `argv` and this process's environment, `env` added, as its own;
    returns a `subprocess.CompletedProcess`. For the checks that need a
    process of their own (TensorFlow's devices not initialised yet,
    warnings given once per process, a script run from the start, what
    keras_stage's import loads) but not a fresh import of TensorFlow;
    what blocking a module before TensorFlow's import does is checked in
    a fresh `python`.
    A child still running after `timeout` seconds is killed and
    `subprocess.TimeoutExpired` raised. With `interpreter_exit` the child
    ends as a fresh interpreter does, its modules torn down and the
    finalizers that calls run, rather than skipping that teardown: for
    what happens at a process's exit.
    """
    job = dict(
        argv=argv,
        code=code,
        module=module,
        cwd=cwd,
        env=env,
        interpreter_exit=interpreter_exit,
    )
    return run_forked_together([job], timeout)[0]


def run_forked_together(jobs, timeout=100):
    """`run_forked` of each of `jobs` (dicts of its arguments), all at once.

    The children run side by side (the processes of one cluster); returns
    their `subprocess.CompletedProcess`es once all have ended, or kills
    them all after `timeout` seconds.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        requests = []
        for i, job in enumerate(jobs):
            requests.append(
                {
                    "argv": list(job["argv"]),
                    "code": job.get("code"),
                    "module": job.get("module"),
                    "cwd": job.get("cwd") or os.getcwd(),
                    "env": {**os.environ, **(job.get("env") or {})},
                    "interpreter_exit": job.get("interpreter_exit", False),
                    "out": os.path.join(folder, f"{i}.out"),
                    "err": os.path.join(folder, f"{i}.err"),
                }
            )
        connection = _connect_to_forking_process()
        pending = b""
        pids = None

        def answer(seconds):
            nonlocal pending
            try:
                line, pending = _next_line(connection, pending, seconds)
            except EOFError:
                raise RuntimeError(
                    "the forking process ended unexpectedly"
                ) from None
            return json.loads(line) if line is not None else None

        try:
            connection.sendall((json.dumps(requests) + "\n").encode())
            pids = answer(60)
            if pids is None:
                raise RuntimeError("the forking process did not fork")
            codes = answer(timeout)
            if codes is None:
                # Past its timeout: the children are killed, as
                # subprocess.run kills its child, and reported ended.
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                answer(30)
                raise subprocess.TimeoutExpired(requests[0]["argv"], timeout)
        except BaseException:
            # Interrupted too (a test's timeout, Ctrl+C): no child of the
            # call runs on.
            for pid in pids or ():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise
        finally:
            connection.close()

        def read(path):
            with open(path, errors="replace") as f:
                return f.read()

        return [
            subprocess.CompletedProcess(
                r["argv"], code, read(r["out"]), read(r["err"])
            )
            for r, code in zip(requests, codes, strict=True)
        ]


def printed_in_forked_python(code, timeout=100):
    """What `code` prints in a process of its own (which must exit cleanly).

    `printed_in_fresh_python`, forked (`run_forked`) from a process that
    imported TensorFlow, Keras and NumPy and nothing of keras_stage: for
    what keras_stage's own imports do, or a module blocked with
    `sys.modules[name] = None` that TensorFlow does not import itself.
    """
    done = run_forked(["-c"], code=code, timeout=timeout)
    if done.returncode:
        raise subprocess.CalledProcessError(
            done.returncode, ["-c", code], done.stdout, done.stderr
        )
    return done.stdout


def write_script(folder, template, **values):
    """`folder/train.py`: `template` filled in with `values` and `root`.

    `root` is the repository's folder, for the script's `sys.path`: the
    reliability tests run training scripts in processes they kill.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = folder / "train.py"
    script.write_text(textwrap.dedent(template.format(root=root, **values)))
    return script


def result_of_script(code, timeout):
    """`(result, stderr)` of `code` run in a new interpreter.

    `code` prints one line `"RESULT " + json.dumps(result)`; it may end
    with `os._exit` (a service read a stage abandoned could hold a normal
    exit), so its exit status is not checked. Fails, with the output's
    tail, if it printed no result.
    """
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [
        line for line in done.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[0][len("RESULT ") :]), done.stderr


def staged_prefix_outputs(model, inputs, batch_size, epochs):
    """Epochs of the training stage of `model`'s SmartStage prefix.

    `model`'s `StagedInput` is named "stage"; its prefix runs on `inputs`
    in batches of `batch_size`, numbered for per-batch seeds, on 4
    threads. Returns each epoch's list of first cut tensors (NumPy).
    """
    import tensorflow as tf

    from keras_stage.data import stage
    from keras_stage.planner import plan_model

    _, split = plan_model(model, model.get_layer("stage"))
    dataset = tf.data.Dataset.from_tensor_slices((inputs,)).batch(batch_size)
    staged = stage(
        split.number(dataset), fn=split.stage_fn(training=True), num_threads=4
    )
    try:
        return [[e[0].numpy() for e in staged] for _ in range(epochs)]
    finally:
        staged.close()


def check_a_tensorflow_ops_layer_is_staged(kind):
    """A user's layer of TensorFlow ops (`kind` "layer") or a `Lambda` of
    them ("lambda") parses strings in the stage on the running backend, and
    the trained model predicts from its weights."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_stage

    class ParseNumbers(keras.layers.Layer):
        """ "1.5" -> 1.5, as a user writes such a layer."""

        def call(self, lines):
            return tf.strings.to_number(lines, tf.float32)

        def compute_output_spec(self, lines):
            return keras.KerasTensor(lines.shape, "float32")

    parse = (
        ParseNumbers(name="parse")
        if kind == "layer"
        else keras.layers.Lambda(
            lambda s: tf.strings.to_number(s, tf.float32),
            output_shape=(1,),
            name="parse",
        )
    )
    inputs = keras.Input(shape=(1,), dtype="string")
    x = keras_stage.layers.StagedInput(name="stage")(inputs)
    x = keras.layers.Normalization(mean=2.0, variance=4.0, name="norm")(
        parse(x)
    )
    model = keras_stage.Model(inputs, keras.layers.Dense(1, name="out")(x))
    model.compile(optimizer="sgd", loss="mse", smart_stage=True)
    assert model.get_stage_plan().staged_layers == ["stage", "parse", "norm"]
    # A dataset: Keras's array adapter takes no 2-D string arrays.
    lines = tf.constant([[f"{i / 8}"] for i in range(32)])
    numbers = np.array([[i / 8] for i in range(32)], dtype="float32")
    data = tf.data.Dataset.from_tensor_slices((lines, numbers)).batch(8)
    history = model.fit(data, epochs=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    kernel, bias = model.get_layer("out").get_weights()
    np.testing.assert_allclose(
        model.predict(data.map(lambda x, y: x), verbose=0),
        (numbers - 2.0) / 2.0 @ kernel + bias,
        rtol=1e-6,
        atol=1e-6,
    )


# The staged layers of each keras-rs-shaped recommender
# (`benchmarks.workloads.recommenders`), in its plan's order, on every
# backend.
RECOMMENDER_STAGED = {
    "retrieval": ["stage", "user_lookup", "movie_lookup"],
    "deep_retrieval": [
        "stage",
        "genre_lookup",
        "occupation_lookup",
        "age_bins",
        "gender_lookup",
        "user_lookup",
        "movie_lookup",
    ],
    "dlrm": ["stage", *(f"hash_{i}" for i in reversed(range(8))), "dense_norm"],
}


def check_recommender_matches_hand_split(name, rtol=1e-5):
    """keras-rs-shaped subclass `name` (its lookups in its call) trains
    staged as its hand split does, the lookups in `dataset.map` and the
    same subclass on the ids (as keras-rs's examples do): the same plan
    on every backend, equal losses and weights (`rtol`: XLA may fuse the
    trunk's ops another way), predictions of the same shape."""
    import keras
    import numpy as np

    import keras_stage
    from benchmarks.workloads import recommenders

    data = recommenders.MODELS[name][1](1024)
    staged = recommenders.build(name, keras_stage.Model)
    staged_history = staged.fit(
        recommenders.dataset(data, 128, seed=5),
        epochs=2,
        validation_data=recommenders.dataset(data, 256),
        shuffle=False,  # the dataset shuffles itself
        verbose=0,
    ).history
    assert staged.get_stage_plan().staged_layers == RECOMMENDER_STAGED[name]
    assert staged_history["stage_wait_ratio"]  # PrefetchCallback reports
    hand = recommenders.build(name, keras.Model, preprocessed=True)
    lookups = recommenders.preprocessor(name)

    def split(seed=None, batch_size=128):
        return recommenders.dataset(data, batch_size, seed, lookups.preprocess)

    hand_history = hand.fit(
        split(5),
        epochs=2,
        validation_data=split(batch_size=256),
        shuffle=False,
        verbose=0,
    ).history
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(
            staged_history[key], hand_history[key], rtol=rtol
        )
    for a, b in zip(staged.get_weights(), hand.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol / 10)
    staged_out = staged.predict(recommenders.dataset(data, 256), verbose=0)
    hand_out = hand.predict(split(batch_size=256), verbose=0)
    assert keras.tree.map_structure(np.shape, staged_out) == (
        keras.tree.map_structure(np.shape, hand_out)
    )
