"""The modes: the ways one workload is built and fed.

A `Mode` is a name and a `kind`; `build(workload, adapt)` returns a `Built`
whose `model` is compiled and whose `feed(dataset)` is what that model is
given for a dataset of raw batches. The kinds:

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

import keras
import tensorflow as tf

import keras_stage

KINDS = ("plain", "staged", "expert", "trunk")


@dataclasses.dataclass(frozen=True)
class Mode:
    """A named way of building and feeding a workload.

    Attributes:
        name: The mode's name in records and tables.
        kind: One of `KINDS`.
        options: `StagedInput` options of a `staged` mode.
    """

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
        if self.kind in ("plain", "staged"):
            staged_input = None
            if self.staged:
                staged_input = keras_stage.layers.StagedInput(**self.options)
                compile_kwargs["smart_stage"] = True
            base = keras_stage.Model if self.staged else keras.Model
            model = workload.whole(base, adapt, staged_input, seed=seed)
            model.compile(**compile_kwargs)
            return Built(model, self.kind)
        preprocess, model = workload.split(adapt, seed=seed)
        model.compile(**compile_kwargs)
        return Built(model, self.kind, preprocess)


# The usual modes, by name.
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


def modes(names):
    """`[Mode]` of comma-separated or listed `names` (see `MODES`)."""
    if isinstance(names, str):
        names = names.split(",")
    unknown = [name for name in names if name not in MODES]
    if unknown:
        raise ValueError(f"Unknown modes {unknown}: expected {list(MODES)}.")
    return [MODES[name] for name in names]


class Built:
    """A built mode: its compiled `model` and what it is fed.

    Args:
        model: The compiled model.
        kind: The mode's kind (see `KINDS`).
        preprocess: The hand split's map of a raw `x`, or None.
    """

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
        if id(dataset) in self._kept:
            return self._kept[id(dataset)][1]
        source = dataset
        if self.preprocess is not None:
            preprocess = self.preprocess
            labelled = isinstance(dataset.element_spec, tuple)
            dataset = dataset.map(
                # A 1-tuple: a tuple of features alone would read as (x, y).
                (lambda x, *y: (preprocess(x), *y))
                if labelled
                else (lambda x: (preprocess(x),)),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
        if self.kind == "trunk":
            dataset = dataset.cache()
            for _ in dataset:  # preprocessed once, then read from memory
                pass
        # One pipeline per dataset, as a user builds it once and passes it
        # to every call (a map made per call would trace it per call).
        self._kept[id(source)] = (source, dataset.prefetch(tf.data.AUTOTUNE))
        return self._kept[id(source)][1]

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
        return getattr(self.model, method)(
            self.feed(data), callbacks=callbacks, verbose=0, **kwargs
        )
