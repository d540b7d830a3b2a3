"""Shared test setup: quiet TensorFlow, seed everything, check for leaks."""

import gc
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import weakref  # noqa: E402

import pytest  # noqa: E402

from tests import helpers  # noqa: E402
from tests.helpers import HANG_REPORTS, stage_threads  # noqa: E402

# TensorFlow, Keras and keras_stage are imported by the fixtures, not here:
# under pytest-xdist this file is also loaded by the process that only
# hands out the tests and prints the summary, and importing TensorFlow
# there (5-8 s of CPU) delayed the start of every worker.


@pytest.fixture(autouse=True)
def _seed_everything():
    import keras

    # Python, NumPy and the backend, so staged and plain runs start alike.
    keras.utils.set_random_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _measure_costs_afresh():
    # Staged-call costs are shared between models with the same stage
    # (`call.facts.costs`): each test starts as a fresh process would.
    from keras_stage.models.decision.calls import forget_shared_costs

    forget_shared_costs()
    yield


@pytest.fixture(autouse=True)
def _first_calls_staged(request, monkeypatch):
    # Most tests check the staged path on a few in-memory batches, which a
    # first call skips by default (`decision.calls.FIRST_CALL_BATCHES`):
    # they run with such calls staged, as before that rule. The rule's own
    # tests (marked `first_call_rule`) and every test run in a fresh
    # process (the examples, the README's) keep it.
    from keras_stage.models.decision import calls

    if request.node.get_closest_marker("first_call_rule") is None:
        monkeypatch.setattr(calls, "FIRST_CALL_BATCHES", 0)
    yield


@pytest.fixture(autouse=True)
def _close_stages_the_test_left_open():
    # A stage a test iterated and dropped keeps its idle helper thread until
    # the garbage collector frees it, which may be several tests later; the
    # tests that count stage threads must not see another test's. Tests
    # that check their own stages close check them before this runs.
    from keras_stage.data import live_stages

    before = weakref.WeakSet(live_stages())
    yield
    for staged in live_stages():
        if staged not in before:
            staged.close(timeout=5.0)


# The tf.data iterators alive, made since the current test began.
_TEST_ITERATORS = weakref.WeakSet()


def _track_iterators():
    # Once per test process, before its first test.
    from tensorflow.python.data.ops import iterator_ops

    owned = iterator_ops.OwnedIterator
    if getattr(owned.__init__, "_tracked", False):
        return
    untracked = owned.__init__

    def tracked(self, *args, **kwargs):
        untracked(self, *args, **kwargs)
        _TEST_ITERATORS.add(self)

    tracked._tracked = True
    owned.__init__ = tracked


@pytest.fixture(autouse=True)
def _a_test_s_iterators_die_with_it():
    # Named to sort first: autouse fixtures set up in name order, so this
    # one is torn down last, after the stages are closed.
    # Tearing down a tf.data iterator cancels and joins its autotuning
    # thread, and TensorFlow (2.21 at least) can miss that wake-up:
    # the cancellation's callback wakes the thread before the cancelled
    # flag is set, and it sleeps out its optimization period again, which
    # doubles from 10 ms up to 60 s over the iterator's life. An iterator a
    # test left in a reference cycle (a model, a stage, a traceback) lived
    # until a later test's garbage collection: tests stalled for up to a
    # minute inside whatever allocated then (a trace, a graph's op),
    # sometimes past their timeout. Collected when its test ends, it is
    # as old as the test: a missed wake-up costs at most its period then,
    # a fraction of the test's run (reproduced without keras_stage: of 24
    # iterators 50 s old, on a loaded machine, 3 took 31-58 s to delete;
    # none with tf.data's autotuning off).
    _track_iterators()
    _TEST_ITERATORS.clear()
    yield
    if _TEST_ITERATORS:  # made by the test and not freed yet
        gc.collect()
        _TEST_ITERATORS.clear()
        # What outlived the collection (the wider fixtures, the caches of
        # TensorFlow and Keras) joins the frozen objects of
        # `pytest_collection_finish`: the next test's collection scans
        # only what was made since. Without this, each collection scanned
        # all the earlier tests' survivors: 50-250 ms each late in a run,
        # 21 s of CPU over the suite's 2 workers. The cost: a survivor that
        # later becomes garbage in a reference cycle (a module fixture's
        # model) is not collected, only memory.
        gc.freeze()


# Modules of the longest single tests (the examples' runs, a demo of half a
# minute, a fresh interpreter's TensorFlow import) and of the longest
# teardown (the tf.data service fits': on a loaded machine, stopping the
# `LocalService` workers can wait on their tasks for a minute or more, a
# wait TensorFlow's `WorkerServer.stop` gives no way to shorten):
# run first. pytest-xdist's worksteal hands each worker a contiguous share
# of the collection and lets an idle worker take the end of another's, so
# a long test late in a share could start when the other workers have
# little left, and the run wait for it alone; early, the other workers
# keep both cores busy meanwhile.
_RUN_FIRST = (
    "tests/examples_test.py",
    "tests/import_test.py",
    "tests/models/service_fit_test.py",
)


def pytest_configure(config):
    # pytest-xdist's controller: its workers share one forking process
    # (tests.helpers.run_forked), started by the first that needs it, in
    # place of one each (TensorFlow imported once, not once per worker).
    if getattr(config, "workerinput", None) is None and getattr(
        config.option, "numprocesses", None
    ):
        import tempfile

        folder = tempfile.mkdtemp(prefix="keras_stage_forking_")
        os.environ[helpers.FORKING_FOLDER] = folder
        config.add_cleanup(lambda: helpers.stop_forking_process(folder))


def pytest_collection_modifyitems(items):
    # A stable sort: the order within each part stays the collection's.
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in _RUN_FIRST)


def pytest_collection_finish(session):
    # What the imports and the collection made (TensorFlow, Keras, the test
    # modules: hundreds of thousands of objects that live as long as the
    # process) is moved out of the garbage collector's view: a full
    # collection, which the fixture above runs after every test that made a
    # tf.data iterator, then scans only what the tests made since. Measured
    # on tests/models/errors_test.py: its 15 collections 6.1 s -> 0.7 s, the
    # file's CPU time -11%. Only what is alive now is frozen: whatever a
    # test leaves behind is collected as before (then what survives that
    # collection is frozen too, above).
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # The watchdog's stacks travel with the test's report: under
    # pytest-xdist (`make test`) the test ran in a worker process, and
    # only its reports reach the process that prints the summary.
    outcome = yield
    report = outcome.get_result()
    while HANG_REPORTS:
        report.user_properties.append(("hang_report", HANG_REPORTS.pop(0)))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    # Last in the output, so a CI log cut in the middle still shows it.
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, text in getattr(report, "user_properties", ()):
                if key == "hang_report":
                    terminalreporter.write_sep("=", "hang watchdog")
                    terminalreporter.write_line(text)


@pytest.fixture
def release():
    """An event a hanging source waits on; set when the test ends.

    Then the pipelines the test hung are collected here, once their threads
    have finished, not by whichever later allocation sets off a
    collection: a tf.data iterator's finalizer waits for its threads. A
    suspected cause, not a proven one, of a rare stall of the first fuzz
    example after these tests: its thread dump showed a collection under
    way while the stage's helper thread traced the step.
    """
    event = threading.Event()
    yield event
    event.set()
    deadline = time.monotonic() + 10.0
    while stage_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
