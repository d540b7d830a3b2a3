"""Whole user scripts, each written once for plain Keras and for staged.

A module's `run(staged, timer, tiny=False, **options)` is a user's script,
keras_stage's lines (`# 1`, `# 2`, `# 3`) taking effect where `staged`;
where plain Keras cannot fit the model, plain is the hand split (`# split`).
"""

import contextlib
import importlib
import time

TF, ANY = ("tensorflow",), ("tensorflow", "jax", "torch")
# name: (module, backends, options of its `run`), in a run's order.
SCRIPTS = {
    "featurespace_seeded": ("featurespace", TF, {"seeded": True}),
    "featurespace": ("featurespace", TF, {}),
    "criteo": ("criteo", TF, {}),
    "criteo_holdout": ("criteo", TF, {"calls": "holdout"}),
    "first_calls": ("criteo", TF, {"calls": "first_calls"}),
    "readme": ("readme", TF, {}),
    "dcn": ("dcn", TF, {}),
    "remote": ("remote", TF, {}),
    "featurespace_split": ("featurespace", ANY, {"split": True}),
    "tabular_split": ("split", ANY, {"name": "tabular"}),
    "criteo_split": ("split", ANY, {"name": "criteo_columns"}),
    "recommender": ("recommender", ANY, {}),
}
NEEDS = {"dcn": "keras_rs"}  # modules beyond the primary environment's


def one_script(name, staged, tiny=False):
    """Runs script `name`; returns what its timer timed, in seconds."""
    module, _, options = SCRIPTS[name]
    timer = ScriptTimer()
    module = importlib.import_module(f"benchmarks.scripts.{module}")
    module.run(staged, timer, tiny=tiny, **options)
    return timer.stop()


def datasets(work, batches, seeds=(4, 1, 2, 3)):
    """`(x, [dataset])`: `batches[i]` batches of data from `seeds[i]`, the
    first shuffled; `x` the first's, to adapt to."""
    parts = [
        work.data(count * work.batch_size, seed)
        for count, seed in zip(batches, seeds, strict=True)
    ]
    first = work.dataset(*parts[0], shuffle_seed=0)
    return parts[0][0], [first] + [work.dataset(*p) for p in parts[1:]]


def hand_split(work, adapt, parts):
    """`(compiled trunk model, parts mapped)`: plain where it cannot fit the
    whole model, the preprocessing in `dataset.map` of each part."""
    from benchmarks.modes import Built

    preprocess, model = work.split(adapt)
    model.compile(**work.compile_kwargs())
    return model, list(map(Built(model, "expert", preprocess).feed, parts))


class ScriptTimer:
    """Seconds from `start()` to `stop()` (`script`), and of the first call
    of each name measured."""

    def __init__(self):
        self.seconds, self.started = {}, None

    def start(self):
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def measure(self, name):
        started = time.perf_counter()
        yield
        self.seconds.setdefault(name, time.perf_counter() - started)

    def stop(self):
        if self.started is None:
            raise RuntimeError("The script never called `timer.start()`.")
        self.seconds["script"] = time.perf_counter() - self.started
        return self.seconds
