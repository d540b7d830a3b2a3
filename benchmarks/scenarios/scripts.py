"""`scripts`: whole user scripts, each run once in a fresh process.

A case is a script of `benchmarks.scripts`, written once for plain Keras
and with keras_stage's three lines; a trial runs it in a fresh Python
process, so nothing is warm and a staged model's one-time costs (its plan,
its stage, tracing) count. Metrics: `script`, from the model's
construction to the script's end, and its first `fit`, `evaluate`,
`predict` ... as the script makes them; the runner adds `seconds` (the
script's imports and data too) and `process` (the whole child process).
Off TensorFlow only the scripts whose plain is the hand split run.
"""

import importlib.util
import os

from benchmarks import scripts
from benchmarks.runner import Scenario


class Scripts(Scenario):
    name = "scripts"
    process = "round"
    rounds, quick_rounds = 5, 3

    def arguments(self, parser):
        names = ",".join(scripts.SCRIPTS)
        about = f"comma-separated, of: {names} (default: all on this backend)"
        parser.add_argument("--scripts", default="", help=about)
        smoke = "every script at its smallest: a smoke run, not a measure"
        parser.add_argument("--tiny", action="store_true", help=smoke)

    def cases(self, args):
        # Keras's own default; the parent imports neither it nor TensorFlow.
        backend = os.environ.get("KERAS_BACKEND", "tensorflow")
        names = [name for name in args.scripts.split(",") if name] or [
            name for name, s in scripts.SCRIPTS.items() if backend in s[1]
        ]
        unknown = [name for name in names if name not in scripts.SCRIPTS]
        if unknown:
            raise SystemExit(
                f"Unknown scripts {unknown}: expected some of "
                f"{list(scripts.SCRIPTS)}."
            )
        runnable = []
        for name in names:
            if why := cannot_run(name, backend):
                print(f"scripts: {name} cannot run here: {why}.", flush=True)
            else:
                runnable.append(name)
        if not runnable:
            raise SystemExit(f"scripts: none of {names} can run here.")
        return runnable

    def setup(self, case, mode, args):
        return case, mode.staged, args.tiny

    def trial(self, state):
        return scripts.one_script(*state)


def cannot_run(name, backend):
    """Why script `name` cannot run on `backend` here, or None."""
    if backend not in scripts.SCRIPTS[name][1]:
        return f"plain Keras cannot fit its string inputs on {backend}"
    needs = scripts.NEEDS.get(name)
    if needs and importlib.util.find_spec(needs) is None:
        return (
            f"{needs} is not installed (`pip install --no-deps -r "
            "requirements/bench-extra.txt`)"
        )
    return None


SCENARIO = Scripts()
