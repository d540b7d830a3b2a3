"""Whole user scripts, each written once for plain Keras and for staged.

One module per script, each with `run(mode, timer, tiny=False)`: the
script as a user writes it, in `mode` "plain" (a `keras.Model`,
preprocessing in the model) or "staged" (the same script with keras_stage's
three lines: `StagedInput()` right after the inputs, `keras_stage.Model`,
`compile(..., smart_stage=True)`). Everything else is the same in both
modes, imports included. A script makes its data first, then calls
`timer.start()` where it starts building its model, and wraps its first
`fit`, `evaluate` and `predict` in `timer.measure(...)`; `tiny` shrinks
its calls to a smoke test's size. A script that cannot run here (an extra
not installed) raises `Skipped`.

`benchmarks.first_calls --scripts ...` runs each script in fresh processes
(`one_script`) and compares the modes.
"""

import contextlib
import importlib
import time

# In the order `benchmarks.first_calls --scripts` runs them by default.
SCRIPTS = (
    "featurespace_seeded",
    "featurespace",
    "criteo",
    "criteo_holdout",
    "readme",
    "dcn",
    "remote",
    # Plain is the hand split: they run on JAX and torch too.
    "featurespace_split",
    "tabular_split",
    "criteo_split",
    # A subclassed model (keras-rs's deep retrieval), on every backend.
    "recommender",
)
MODES = ("plain", "staged")
# The timed parts a script may have, besides the whole script.
CALLS = ("fit", "evaluate", "evaluate_holdout", "predict")


class Skipped(Exception):
    """A script cannot run here; the message says why and how to fix it."""


def is_staged(mode):
    """Whether `mode` is "staged" (True) or "plain" (False).

    Raises:
        ValueError: For any other mode.
    """
    if mode not in MODES:
        raise ValueError(
            f"Invalid value for argument `mode`. Expected one of {MODES}. "
            f"Received: mode={mode!r}"
        )
    return mode == "staged"


class ScriptTimer:
    """The seconds of a script from its model's construction to its end.

    `start()` marks where the model starts being built; `measure(name)`
    times the first call of each name (a later one is not recorded);
    `stop()` ends the script's time. `seconds` holds `"script"` and each
    measured call; `started_at` is the `time.perf_counter()` of `start()`.
    """

    def __init__(self):
        self.seconds = {}
        self.started_at = None

    def start(self):
        """Starts the script's time (once, before the model is built)."""
        if self.started_at is not None:
            raise RuntimeError("ScriptTimer.start() called twice")
        self.started_at = time.perf_counter()

    @contextlib.contextmanager
    def measure(self, name):
        """Times the block as `name`, if no `name` was timed before."""
        if self.started_at is None:
            raise RuntimeError(f"measure({name!r}) before start()")
        started = time.perf_counter()
        yield
        self.seconds.setdefault(name, time.perf_counter() - started)

    def stop(self):
        """Ends the script's time; returns `seconds`."""
        if self.started_at is None:
            raise RuntimeError("the script never called timer.start()")
        self.seconds["script"] = time.perf_counter() - self.started_at
        return self.seconds


def one_script(name, mode, tiny=False):
    """Imports script `name`, runs it in `mode`; returns what was timed.

    Returns:
        `{"seconds": {...}, "prepare_seconds": ...}` (`prepare_seconds`:
        the script's imports and data, before `timer.start()`), or
        `{"skipped": reason}` when the script raised `Skipped`.
    """
    if name not in SCRIPTS:
        raise ValueError(
            f"Unknown script {name!r}: expected one of {list(SCRIPTS)}"
        )
    started = time.perf_counter()
    timer = ScriptTimer()
    try:
        module = importlib.import_module(f"benchmarks.scripts.{name}")
        module.run(mode, timer, tiny=tiny)
    except Skipped as skipped:
        return {"skipped": str(skipped)}
    seconds = timer.stop()
    return {
        "seconds": seconds,
        "prepare_seconds": timer.started_at - started,
    }
