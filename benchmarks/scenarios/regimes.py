"""`regimes`: short sequences of whole calls, as a user's script makes them.

A case is `workload/regime`; one round of a mode is the regime's whole
sequence of `fit`, `evaluate` and `predict` calls on one model kept across
rounds (`fresh_model` and `tuner_search` build new models each round, so
they are cold: their point). `--feed dataset` passes `tf.data.Dataset`s
(built once per round, the same object to each call, as a script does);
`--feed arrays` passes numpy arrays. `--determinism` turns on Keras's op
determinism recipe for the process.
"""

import tempfile

import keras
import tensorflow as tf

import keras_stage
from benchmarks.runner import Scenario
from benchmarks.workloads import workload

# Batches (rows for predict and the FeatureSpace example), epochs, calls.
_SIZES = (
    "train 30 epochs 8 val_train 30 val 10 val_epochs 4 eval 20 eval_calls 3"
    " fit_calls 4 predict_rows 8 predict_calls 10 fresh_trials 3"
    " fresh_epochs 2 long 60 long_epochs 2 tuner_trials 4 tuner_epochs 2"
    " tune 20 example_epochs 20"
).split()
SIZES = dict(zip(_SIZES[::2], map(int, _SIZES[1::2]), strict=True))
TINY = {key: 1 if "calls" not in key else 2 for key in SIZES}
SHORT = ("short_epochs", "validation", "evaluate_x3", "fit_epochs1_x4")
# Each workload's regimes, batch size and sizes unlike SIZES.
WORKLOADS = {
    "tabular": (SHORT + ("predict8_x10", "fresh_model"), 32, {}),
    "dense": (SHORT + ("predict8_x10", "fresh_model"), 32, {}),
    "criteo": (
        ("validation", "evaluate_x3", "fit_epochs1_x4", "fresh_model"),
        128,
        {"val_train": 40, "val_epochs": 3},
    ),
    "featurespace": (("featurespace_fit",), 32, {}),
}


def _fit(run, part, epochs, validation=None):
    run.call("fit", part, epochs=epochs, validation=validation)


REGIMES = {
    "short_epochs": lambda r, s: _fit(r, "train", s["epochs"]),
    "validation": lambda r, s: _fit(r, "val_train", s["val_epochs"], "val"),
    "evaluate_x3": lambda r, s: r.repeat("evaluate", "eval", s["eval_calls"]),
    "fit_epochs1_x4": lambda r, s: r.repeat("fit", "train", s["fit_calls"]),
    "predict8_x10": lambda r, s: r.repeat(
        "predict", "predict", s["predict_calls"]
    ),
    "fresh_model": lambda r, s: [
        _fit(r.fresh(), "train", s["fresh_epochs"])
        for _ in range(s["fresh_trials"])
    ],
    "fit_2_epochs": lambda r, s: _fit(r, "long", s["long_epochs"]),
    "featurespace_fit": lambda r, s: _fit(
        r, "example_train", s["example_epochs"], "example_val"
    ),
    "tuner_search": lambda r, s: tuner_search(r, s),
}
COLD = ("fresh_model", "tuner_search")
# Each part's data seed; predict and the example's parts in rows.
SEEDS = {"train": 0, "val": 1, "eval": 2, "predict": 3, "val_train": 4}
SEEDS.update(long=5, tune=6, example_train=7, example_val=8)


class Run:
    """One mode of one case: its model, data and how calls are fed."""

    def __init__(self, case, mode, args):
        name, self.regime = case.split("/")
        _, batch_size, sizes = WORKLOADS.get(name, ((), 32, {}))
        self.sizes = TINY if args.tiny else {**SIZES, **sizes}
        self.work = workload(name, batch_size=batch_size)
        self.mode, self.feed = mode, args.feed
        self.data = {}
        for part, seed in SEEDS.items():
            rows = self.sizes.get(part, 0) * batch_size
            if part == "predict":
                rows = self.sizes["predict_rows"]
            elif part.startswith("example"):
                rows = getattr(self.work, f"{part[8:]}_rows", 0)
            self.data[part] = self.work.data(rows, seed) if rows else None
        self.adapt = self.data[
            "example_train" if name == "featurespace" else "train"
        ][0]
        self.built = mode.build(self.work, self.adapt)

    def fresh(self):
        self.built = self.mode.build(self.work, self.adapt)
        return self

    def feeds(self, part, training=False):
        """`(x, kwargs)` of a call on `part`: a dataset, or arrays."""
        x, y = self.data[part]
        labelled = part != "predict"
        if self.feed == "dataset" or self.mode.kind in ("expert", "trunk"):
            seed = 0 if training else None
            return self.work.dataset(x, y if labelled else None, seed), {}
        kwargs = {"batch_size": self.work.batch_size}
        return x, ({"y": y, **kwargs} if labelled else kwargs)

    def call(self, method, part, validation=None, **kwargs):
        x, more = self.feeds(part, training=method == "fit")
        if validation is not None:
            val_x, val = self.feeds(validation)
            kwargs["validation_data"] = (val_x, val["y"]) if val else val_x
        self.built.call(method, x, **more, **kwargs)

    def repeat(self, method, part, calls):
        x, more = self.feeds(part, training=method == "fit")
        for _ in range(calls):
            self.built.call(method, x, **more)


def tuner_search(run, sizes):
    """keras-tuner's RandomSearch: a new model per trial, a learning rate
    drawn (the same draws in every mode)."""
    import keras_tuner

    x, more = run.feeds("tune", training=True)
    val_x, val = run.feeds("val")

    def model(hp):
        rate = hp.Float("learning_rate", 1e-4, 1e-2, sampling="log")
        return run.mode.build(run.work, run.adapt, rate).model

    trials, epochs = sizes["tuner_trials"], sizes["tuner_epochs"]
    more.update(validation_data=(val_x, val["y"]) if val else val_x, verbose=0)
    more.update({} if "y" in more else {"shuffle": False})  # a dataset
    if run.mode.staged:
        more["callbacks"] = [keras_stage.callbacks.PrefetchCallback()]
    with tempfile.TemporaryDirectory() as folder:
        tuner = keras_tuner.RandomSearch(
            model, "val_loss", trials, seed=0, directory=folder
        )
        tuner.search(x, epochs=epochs, **more)
    failed = [t for t in tuner.oracle.trials.values() if t.status == "FAILED"]
    if failed:  # keras-tuner logs a failed trial and goes on
        raise RuntimeError(f"tuner_search: {failed[0].message}")


class Regimes(Scenario):
    name = "regimes"
    rounds, quick_rounds = 5, 2

    def arguments(self, parser):
        parser.add_argument("--workloads", default="tabular,dense")
        parser.add_argument("--regimes", help="default: each workload's own")
        parser.add_argument(
            "--feed", choices=("arrays", "dataset"), default="arrays"
        )
        parser.add_argument("--determinism", action="store_true")
        parser.add_argument("--tiny", action="store_true", help="smoke sizes")

    def cases(self, args):
        if args.determinism:
            keras.utils.set_random_seed(0)
            tf.config.experimental.enable_op_determinism()
        return [
            f"{name}/{regime}"
            for name in args.workloads.split(",")
            for regime in (
                args.regimes.split(",") if args.regimes else WORKLOADS[name][0]
            )
        ]

    def setup(self, case, mode, args):
        return Run(case, mode, args)

    def warmups(self, case):
        return 0 if case.split("/")[1] in COLD else 1

    def trial(self, run):
        REGIMES[run.regime](run, run.sizes)


SCENARIO = Regimes()
