"""The modes: the ways one workload is built and fed.

A `Mode` is a name and a `kind`; `build(workload, adapt)` returns a `Built`:
a compiled `model` and `feed(dataset)`, what it is given for raw batches.

- `plain`: the whole model as a `keras.Model`, fed the raw batches.
- `staged`: keras_stage's three lines: `StagedInput(**options)` first,
  `keras_stage.Model`, `compile(..., smart_stage=True)`, a
  `PrefetchCallback` in `fit`; fed the raw batches.
- `expert`: the hand split a skilled user writes: the preprocessing in
  `dataset.map(num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)`, a
  `keras.Model` of the trunk. Off TensorFlow, where plain Keras cannot take
  strings, it is the reference.
- `trunk`: the trunk alone on batches preprocessed once and kept in memory:
  the bound when input costs nothing.

Two modes of one kind are the control: `plain_again` (or `expert_again`
where the hand split is the reference) measures the noise of a ratio.
"""

import dataclasses
import time

import keras
import tensorflow as tf

import keras_stage

KINDS = ("plain", "staged", "expert", "trunk")
# The tear-down seconds of every `Built.call` (`runner.timed` reads them).
TEARDOWN = []


@dataclasses.dataclass(frozen=True)
class Mode:
    """A named way of building and feeding a workload: `name` in records,
    `kind` of `KINDS`, `options` of a `staged` mode's `StagedInput`."""

    name: str
    kind: str
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(
                f"Mode {self.name!r}: kind {self.kind!r} is not one of {KINDS}."
            )

    @property
    def staged(self):
        return self.kind == "staged"

    def build(self, workload, adapt, learning_rate=1e-3, seed=0):
        """The compiled model of this mode and how it is fed."""
        compile_kwargs = workload.compile_kwargs(learning_rate)
        preprocess = staged_input = None
        if self.staged:
            staged_input = keras_stage.layers.StagedInput(**self.options)
            compile_kwargs["smart_stage"] = True
        if self.kind in ("plain", "staged"):
            base = keras_stage.Model if self.staged else keras.Model
            model = workload.whole(base, adapt, staged_input, seed=seed)
        else:
            preprocess, model = workload.split(adapt, seed=seed)
        model.compile(**compile_kwargs)
        return Built(model, self.kind, preprocess)


MODES = {
    mode.name: mode
    for mode in (
        Mode("plain", "plain"),
        Mode("staged", "staged"),
        Mode("expert", "expert"),
        Mode("plain_again", "plain"),
        Mode("expert_again", "expert"),
        Mode("staged_always", "staged", {"adaptive": False}),
        Mode("compute_bound", "trunk"),
    )
}


class Built:
    """A built mode: its compiled `model`, its `kind` and, for the hand
    split, `preprocess`, the map of a raw `x`."""

    def __init__(self, model, kind, preprocess=None):
        self.model = model
        self.kind = kind
        self.preprocess = preprocess
        self.prefetch = None  # the last staged fit's PrefetchCallback
        self._kept = {}  # the pipeline made of each dataset fed

    def feed(self, dataset):
        """What this mode's model is given for `dataset` of raw batches."""
        if self.kind in ("plain", "staged"):
            return dataset
        if id(dataset) not in self._kept:
            # One pipeline per dataset, as a user builds it once for every
            # call (a map made per call would trace it per call).
            fed, preprocess = dataset, self.preprocess
            if preprocess is not None:  # unlabelled: a 1-tuple, not (x, y)
                fed = fed.map(
                    lambda x, *y: (preprocess(x), *y),
                    num_parallel_calls=tf.data.AUTOTUNE,
                )
            if self.kind == "trunk":
                fed = fed.cache()
                for _ in fed:  # preprocessed once, then read from memory
                    pass
            self._kept[id(dataset)] = (dataset, fed.prefetch(tf.data.AUTOTUNE))
        return self._kept[id(dataset)][1]

    def call(self, method, data, callbacks=(), **kwargs):
        """`model.<method>(feed(data), ...)`, quiet; a staged `fit` gets a
        `PrefetchCallback`."""
        callbacks = list(callbacks)
        if method == "fit":
            if isinstance(data, tf.data.Dataset):  # it shuffles itself
                kwargs.setdefault("shuffle", False)
            if self.kind == "staged":
                self.prefetch = keras_stage.callbacks.PrefetchCallback()
                callbacks.append(self.prefetch)
            if kwargs.get("validation_data") is not None:
                kwargs["validation_data"] = self.feed(kwargs["validation_data"])
        ended = []  # when the call ran its last callback
        mark = lambda logs=None: ended.append(time.perf_counter())  # noqa: E731
        hooks = {f"on_{m}_end": mark for m in ("train", "test", "predict")}
        callbacks.append(keras.callbacks.LambdaCallback(**hooks))
        out = getattr(self.model, method)(
            self.feed(data), callbacks=callbacks, verbose=0, **kwargs
        )
        # What Keras did after its last callback: for a plain fit, the
        # iterator's tear-down (docs/benchmarks.md, "What a call's time is").
        TEARDOWN.append(time.perf_counter() - ended[-1])
        return out
