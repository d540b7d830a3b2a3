"""The Python boundary of a stage: exception policies and the timeout.

A blocked TensorFlow call cannot be interrupted, so with a timeout each
blocking call of the consumer (`next(iterator)`, one Keras step) runs on a
helper thread while the caller waits with a deadline; a call whose elements
are buffered runs in the caller's thread (`ReadyElements`).
"""

import atexit
import logging
import re
import threading
import time
import weakref

import tensorflow as tf

from keras_stage.data.errors import StageTimeoutError, annotate

logger = logging.getLogger("keras_stage")

_POLL_SECONDS = 0.5  # how often a waiting caller checks the wait clock
# One buffered call in this many still records (see `StageRunner.call`).
READY_SAMPLE = 16
# How long the interpreter's exit waits for keras_stage's threads.
EXIT_WAIT_SECONDS = 10.0
_call_threads = weakref.WeakSet()  # every `_CallThread` not yet ended


def wait_at_exit(waits):
    """Calls each `wait(seconds)` of `waits` within `EXIT_WAIT_SECONDS`: a
    daemon thread ended inside TensorFlow's C++ at exit aborts the process."""
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for wait in waits:
        wait(max(0.0, deadline - time.monotonic()))


@atexit.register
def _end_call_threads():
    # Not waiting for one a timeout left blocked on its source.
    wait_at_exit(
        (lambda seconds, c=caller: c.close(0.0 if c.stalled else seconds))
        for caller in list(_call_threads)
    )


_NODE = re.compile(r"\{\{node ([^}]+)\}\}")


def failing_layer(error, layers):
    """The layer among `layers` whose op raised `error`, or None: read from
    the node's scopes ("model_stage_1/parse_numbers_1/StringToNumber")."""
    message = getattr(error, "message", None) or str(error)
    names = set(layers)
    for node in _NODE.findall(message):
        # The innermost scope first: a layer called inside another.
        for scope in reversed(node.split("/")[:-1]):
            for name in (scope, re.sub(r"_\d+$", "", scope)):
                if name in names:
                    return name
    return None


def _is_end_of_data(error):
    """Whether `error` ends an iterator, not a truncated record's OutOfRange."""
    if isinstance(error, StopIteration):
        return True
    message = getattr(error, "message", None) or ""
    return (
        isinstance(error, tf.errors.OutOfRangeError)
        and "End of sequence" in message
    )


# The error types a bad record raises, which `ignored_exception_types`
# can usefully skip; others would hit every later batch too.
_PER_RECORD_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.DataLossError)
# The closed stage's own assertion (`StageStats`), as tf.data quotes it.
_OWN_ASSERTION = re.compile(r"Stage \\?'.*?\\?' was closed")


def _is_per_record(error):
    """Whether `error` may be one bad record's (see `_PER_RECORD_ERRORS`)."""
    message = getattr(error, "message", None) or str(error)
    return isinstance(error, _PER_RECORD_ERRORS) and not (
        _OWN_ASSERTION.search(message)
    )


def _is_clock_refused(error):
    """Whether `error` is a clock op refused under op determinism."""
    message = getattr(error, "message", None) or ""
    return (
        isinstance(error, tf.errors.FailedPreconditionError)
        and "Timestamp" in message
        and "determinism" in message
    )


def _is_short_epoch(error):
    """Whether `error` is `assert_cardinality`'s: an epoch ended early."""
    message = getattr(error, "message", None) or ""
    return (
        isinstance(error, tf.errors.FailedPreconditionError)
        and "was expected to contain" in message
    )


class SkipElement(Exception):
    """Raised by `StageRunner.call` when the element was ignored."""


class EndOfData(Exception):
    """Raised by `StageRunner.call` when a closed exception type ended it."""


class _CallThread:
    """One daemon thread running the blocking calls handed to it (not a
    `ThreadPoolExecutor`, whose exit hook would join an abandoned call)."""

    def __init__(self, name):
        self._cond = threading.Condition()
        self._job = None
        self._result = None
        self._closed = False
        # Left blocked on its source by a timeout: nothing waits for it.
        self.stalled = False
        self._thread = threading.Thread(
            target=self._loop, name=name, daemon=True
        )
        self._thread.start()
        _call_threads.add(self)

    def _loop(self):
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                fn, args = self._job
            try:
                result = (True, fn(*args))
            except BaseException as e:  # handed to the caller
                result = (False, e)
            # Idle references would keep the iterator and stage alive.
            del fn, args
            with self._cond:
                self._job = None
                # An abandoned call's result has no reader: released now,
                # not at interpreter exit (where it can deadlock).
                self._result = None if self._closed else result
                self._cond.notify_all()
            del result

    def submit(self, fn, args):
        with self._cond:
            if self._job is not None:
                raise RuntimeError("a stage call is still running")
            self._result = None
            self._job = (fn, args)
            self._cond.notify_all()

    def wait(self, seconds):
        """Returns (ok, value) or None if still running after `seconds`."""
        with self._cond:
            if self._result is None:
                self._cond.wait(seconds)
            result, self._result = self._result, None
            return result

    def close(self, timeout=None):
        """Ends the thread after its current call, waiting up to `timeout`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def alive(self):
        return self._thread.is_alive()


class ReadyElements:
    """Finished elements a consumer's next calls can take without waiting,
    so without a timeout. The counters are shared by every iterator, so a
    count is trusted only for an iterator started after every earlier one
    was gone, less what those left behind."""

    def __init__(self, stats):
        self.stats = stats
        self.counts_fetches = True  # whether a fetch is counted unreported
        self._iterator = None  # a weak reference to the current one
        self._earlier = []  # weak references to those before it
        self._left_behind = None  # None: the count is not trusted
        self._ready = 0
        self._level = 0  # the count at the last reading, for `fill`
        self._noted = False  # whether the current iterator's calls report

    def take(self, iterator, elements):
        """Whether a call of `iterator` taking `elements` finds them ready
        (then counted as taken); never for an iterator's first call."""
        if not self.stats.pipeline_counts:  # op determinism
            return False
        if not self._follow(iterator) or self._left_behind is None:
            return False
        if self._ready < elements:
            if not (self.counts_fetches or self._noted):
                # A step that does not record counts no fetch.
                return False
            self._ready = self.stats.unconsumed() - self._left_behind
            self._level = self._ready
            if self._ready < elements:
                return False
        self._ready -= elements
        return True

    def note(self, iterator, unconsumed):
        """Notes the unconsumed count after a call of `iterator` (a floor)."""
        if self._left_behind is None or not self._is_current(iterator):
            return
        self._noted = True
        self._level = int(unconsumed) - self._left_behind
        self._ready = max(self._ready, self._level)

    def fill(self, others=True):
        """The buffer fill a fetch of a ready element saw, estimated from
        the last reading (`others=False`: for a fetch timed on the host)."""
        return max(self._level - (1 if others else 0), 0)

    def _is_current(self, iterator):
        return self._iterator is not None and self._iterator() is iterator

    def _follow(self, iterator):
        """Whether `iterator` was current already; makes it current."""
        if self._is_current(iterator):
            return True
        self._start(iterator)
        return False

    def _start(self, iterator):
        if self._iterator is not None:
            self._earlier.append(self._iterator)
        self._earlier = [ref for ref in self._earlier if ref() is not None]
        self._ready = self._level = 0
        self._noted = False
        self._left_behind = None
        try:
            self._iterator = weakref.ref(iterator)
        except TypeError:  # cannot tell when it is gone: never trusted
            self._iterator = None
            return
        if not self._earlier:
            self._left_behind = self.stats.unconsumed()


class _HostWait:
    """A call's input wait timed on the host from the consumed count (no
    graph clock, or `host_timed`): since its start or last arrival, until
    it has `elements` (None: until it returns)."""

    def __init__(self, stats, started, elements):
        self._stats = stats
        self._since = started
        self._first = self._last = stats.consumed()
        self._elements = elements

    def seconds_waiting(self):
        count = self._stats.consumed()
        now = time.time()
        if count != self._last:
            self._last, self._since = count, now
        if self._elements is not None and count - self._first >= self._elements:
            return 0.0
        return max(0.0, now - self._since)


class StageRunner:
    """Applies a stage's exception policies and timeout to blocking calls
    (`gate`: the pipeline's open flag, which a timeout clears;
    `counts_in_order`: the stage counts elements ready in delivery order)."""

    def __init__(
        self, options, stats, gate=None, counts_in_order=False, ledger=None
    ):
        self.options = options
        self.stats = stats
        self._gate = gate
        self._ledger = ledger
        # The model layers the stage runs (SmartStage), to name in errors.
        self.staged_layers = ()
        self._caller = None
        self._abandoned = []
        self._ready = ReadyElements(stats) if counts_in_order else None
        self._ready_calls = 0  # see `_sample_ready`
        self._elements = None  # see `call`
        self.records_in_step = False
        # The names staging.py gives the stage's tf.data transformations.
        self._own_ops = re.compile(
            rf"\b{re.escape(options.name)}_(map|ready|buffer|wait|fetch)\b"
        )

    @property
    def name(self):
        return self.options.name

    @property
    def records_in_step(self):
        """Whether the consumer records its fetches in its own step (the
        timeout then counts from the call's start)."""
        return self._records_in_step

    @records_in_step.setter
    def records_in_step(self, value):
        self._records_in_step = bool(value)
        if self._ready is not None:
            self._ready.counts_fetches = not value

    def raised_by_stage(self, error):
        """Whether `error` came out of this stage's pipeline, not from other
        work of the call (a training step): never skip a model's error."""
        message = getattr(error, "message", None) or str(error)
        return (
            self._own_ops.search(message) is not None
            or "IteratorGetNext" in message
        )

    def call(
        self,
        fn,
        *args,
        check_origin=False,
        elements=None,
        ready_fn=None,
        host_timed=False,
    ):
        """Runs `fn(*args)` under the stage's policies.

        With `check_origin`, errors not raised by the stage's pipeline pass
        through. `elements`: the most the call fetches from the stage's
        iterator `args[0]`. `ready_fn`: the same call without recording, for
        buffered calls (all if `host_timed`, else all but one in
        `READY_SAMPLE`). Raises `SkipElement` (an ignored exception type),
        `EndOfData` (a closed one, or the end), `StageTimeoutError`, or any
        other error with its type, the stage named.
        """
        started = time.time()
        try:
            timeout = self.options.timeout
            # On the service a lost worker is noticed from the wait.
            waits = timeout is not None or self._ledger is not None
            # Without a timeout, the count only serves `ready_fn`.
            buffered = (waits or ready_fn is not None) and self._buffered(
                args, elements
            )
            if (
                buffered
                and ready_fn is not None
                and (host_timed or self._sample_ready())
            ):
                out = ready_fn(*args)
                fill = self._ready.fill(others=not host_timed)
                self.stats.count_taken(elements, fill)
                return out
            if buffered or not waits:
                return fn(*args)
            self._elements = elements
            if self._ledger is not None and args:
                self._ledger.note_call(args[0])
            return self._call_with_timeout(fn, args, started, host_timed)
        except StageTimeoutError:
            raise
        except Exception as e:
            if self._ledger is not None and self._ledger.is_end(e):
                # A service epoch the stage ended (a lost worker).
                raise EndOfData() from None
            if check_origin and not (
                self.raised_by_stage(e) or self._refused_own_clock(e)
            ):
                raise
            return self._apply_policies(e)

    def _refused_own_clock(self, error):
        """Whether `error` is the stage's clock refused by op determinism."""
        return _is_clock_refused(error) and self.stats.clock_refused

    def _sample_ready(self):
        """Whether a ready call may skip recording (all but one in N)."""
        self._ready_calls = (self._ready_calls + 1) % READY_SAMPLE
        return self._ready_calls != 0

    def _buffered(self, args, elements):
        """Whether the call's `elements` are in the buffer already."""
        if elements is None or self._ready is None:
            return False
        return self._ready.take(args[0], elements)

    def take_report(self, iterator, values, called=None):
        """Takes the report a call of `iterator` returned with its outputs
        (see `StageStats.take_report` and `ReadyElements.note`)."""
        unconsumed = self.stats.take_report(values, called)
        if self._ready is None:
            return
        self._ready.note(iterator, unconsumed)

    def _apply_policies(self, error):
        options = self.options
        if _is_end_of_data(error):
            # Whatever the types: skipping it would never end.
            raise EndOfData() from error
        if isinstance(error, options.ignored_exception_types):
            self.stats.record_skip(error)
            logger.debug("stage %r skipped an element: %s", self.name, error)
            raise SkipElement() from error
        if isinstance(error, options.closed_exception_types + (StopIteration,)):
            raise EndOfData() from error
        if isinstance(error, tf.errors.OpError):
            raise annotate(error, self.name, self._hint(error)) from None
        raise error

    def _hint(self, error):
        """Where in the staged layers `error` arose, and what to do."""
        layer = failing_layer(error, self.staged_layers)
        where = None if layer is None else f"in its layer '{layer}'"
        advice = None
        if _is_clock_refused(error):
            advice = (
                "its counters were traced with a clock before op determinism "
                "was enabled, and TensorFlow refuses that clock now: build "
                "the stage, and any step recording it, again after "
                "tf.config.experimental.enable_op_determinism() (a "
                "keras_stage model: compile it again)"
            )
        elif _is_short_epoch(error):
            advice = (
                "its source ended before the batch count it was given for "
                "an epoch: on the tf.data service, the epoch lost a "
                "worker's batches; across jax.distributed processes, the "
                "last global batch did not give every process a share "
                "(this process's shard is a batch short, where plain "
                "Keras's processes wait on each other): batch with "
                "drop_remainder=True, or give it a row count the global "
                "batch size divides"
            )
        elif _is_per_record(error):
            advice = (
                f"to skip the batches that fail like this, add "
                f"tf.errors.{type(error).__name__} to the stage's "
                "ignored_exception_types"
            )
        return "; ".join(part for part in (where, advice) if part) or None

    def _call_with_timeout(self, fn, args, started, host_timed=False):
        if self._caller is None or not self._caller.alive:
            self._caller = _CallThread(f"keras_stage-{self.name}")
        caller = self._caller
        progress = None
        if host_timed or not self.stats.fetches_timed:
            progress = _HostWait(self.stats, started, self._elements)
        try:
            caller.submit(fn, args)
            while True:
                result = caller.wait(_POLL_SECONDS)
                if result is not None:
                    break
                if progress is not None:
                    waited = progress.seconds_waiting()
                else:
                    waited = self.stats.seconds_waiting(
                        since=started if self.records_in_step else None
                    )
                ledger = self._ledger
                if ledger is not None and ledger.should_end(waited):
                    ledger.request_end(waited)  # fails this call's fetch
                timeout = self.options.timeout
                if timeout is not None and waited > timeout:
                    self.stats.close()
                    self.close_gate()
                    # Blocked on the source: `close` need not wait for it.
                    caller.stalled = True
                    raise self._timeout_error(waited)
        except BaseException:
            # A timeout or Ctrl-C: nobody will read the call's result.
            self._abandon(caller)
            raise
        ok, value = result
        if ok:
            return value
        raise value

    def _abandon(self, caller):
        """Leaves `caller` to end once its call returns; `close` waits."""
        caller.close(timeout=0)
        self._abandoned.append(caller)
        if self._caller is caller:
            self._caller = None

    def _timeout_error(self, waited):
        snap = self.stats.snapshot()
        cause = (
            "the source or the staged computation is blocked (a hung read, "
            "a generator that never yields, a remote store not answering). "
            "Fix the source"
        )
        if self.options.service is not None:
            # A job whose worker stops mid-epoch never ends.
            cause = (
                "the stage runs on the tf.data service at "
                f"{self.options.service} and a worker stopped, or the "
                "dispatcher did: the service does not end an epoch whose "
                "worker was lost (with `worker_timeout` set the stage ends "
                "one that has delivered; this one had not). Check the "
                "workers and run the call again "
                "(keras.callbacks.BackupAndRestore resumes a fit)"
            )
        return StageTimeoutError(
            f"Stage '{self.name}' timed out: the consumer waited "
            f"{waited:.1f} s for the next element (timeout="
            f"{self.options.timeout:g} s). {snap['produced']} elements were "
            f"produced and {snap['consumed']} consumed so far. Likely cause: "
            f"{cause}, or raise `timeout` if elements legitimately take this "
            "long."
        )

    def close_gate(self):
        """Makes elements the pipeline finishes from now on fail."""
        if self._gate is not None:
            self._gate.assign(False)

    def open_gate(self):
        """Lets the pipeline finish elements again (a stage run by calls)."""
        if self._gate is not None:
            self._gate.assign(True)

    def close(self, timeout=5.0):
        """Stops the helper thread; returns True if no thread is left."""
        deadline = time.monotonic() + timeout
        if self._caller is not None:
            self._abandon(self._caller)
        # Not waiting for one a timeout left blocked on the source.
        for caller in self._abandoned:
            wait = 0.0 if caller.stalled else timeout
            caller.close(max(0.0, min(wait, deadline - time.monotonic())))
        self._abandoned = [c for c in self._abandoned if c.alive]
        return not self._abandoned
