"""`Backend`: what a staged call asks of the Keras backend it runs on.

One subclass per Keras backend keras_stage stages on, in a file of its own
(`tensorflow.py`, `jax.py`), picked once per model (`backends.for_model`)
as Keras picks its trainer class: nobody else asks which backend runs.
This base is the backend of the others (torch, numpy, openvino), which
refuses staged calls with what works instead.
"""

import keras

from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.model_state import FUNCTIONS


class Backend:
    """What a staged call does on one Keras backend.

    A new backend is one file in this folder, a subclass added to
    `backends.BACKENDS`, and its tests. It sets or overrides:

    - Its refusals: `check_supported(model, layer)` (a staged call: this
      base refuses every one), `check_strategy(model)` (a fit's
      tf.distribute strategy), `check_exportable(model)` (an export).
    - The steps: `step(model, phase, keras_step, *args)` (the body of the
      model's train/test/predict step), `make_function(model, phase,
      make)` (Keras's compiled train/test step, as a staged call runs it),
      `may_run_unstaged` (whether a call or an epoch may skip its stage)
      and `jit_by_default` (what `jit_compile="auto"` means for a trunk).
    - The feed: `reads_in_graph(phase)` (whether Keras's step reads the
      phase's batches in its graph, or in Python), `host_arrays(data)`,
      `feed(data, phase)` (what Keras iterates for a `StagedData`),
      `build(model, data, phase)` (what Keras would build from a first
      batch, built from the stage's specs), `shard_batches(dataset)` (a
      process's batch count where Keras shards per process) and
      `unread_opens` (the iterators Keras opens after an epoch and never
      reads).
    - The stage's buffer and pool: `uses_device_buffer`,
      `pool_start(options)` and `pool_shrinks`.
    - What runs in tf.data for it, asked by the planner (which is handed
      the backend: `plan_model(backend=...)`): `native_tf`,
      `narrows_int64()` and `variable_reader(variables)`.

    This base gives what a backend meets before a staged call refuses or
    runs (the steps Keras makes, the plan): the planner's answers for
    tensors that are not TensorFlow's, a step that runs the SmartStage
    trunk, Keras's compiled functions as Keras makes them.

    Args:
        name: Keras's name of the backend (`keras.backend.backend()`).
    """

    # Whether Keras's tensors and variables are TensorFlow's: any layer
    # then runs in tf.data, on the model's own variables. Otherwise only
    # Keras's preprocessing layers (their fixed state read into the trace)
    # and layers of TensorFlow ops can.
    native_tf = False

    def __init__(self, name):
        self.name = name

    def check_supported(self, model, layer):
        """Raises a clear error for a staged call this backend cannot run.

        Args:
            model: The keras_stage model called.
            layer: Its `StagedInput` (or the default one of a SmartStage
                model).
        """
        raise NotImplementedError(
            f"keras_stage stages fit/evaluate/predict on the TensorFlow and "
            f"JAX backends; model '{model.name}' runs on the '{self.name}' "
            "backend. Set KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow "
            "before importing Keras, or use a plain keras.Model (or remove "
            "the StagedInput and smart_stage) on this backend."
        )

    def check_strategy(self, model):
        """Raises a clear error for a fit under a strategy it cannot train."""

    def check_exportable(self, model):
        """Raises a clear error for an export this backend cannot make.

        Keras exports a model of another backend than TensorFlow through
        jax2tf, which takes numeric arrays only: a model with string inputs
        fails deep inside it.
        """
        strings = [
            t.name
            for t in keras.tree.flatten(getattr(model, "inputs", None) or [])
            if t.dtype == "string"
        ]
        if strings:
            raise ValueError(
                f"Model '{model.name}' has string inputs ({strings}), which "
                f"Keras cannot export on the {self.name} backend "
                "(jax2tf takes numeric arrays only). Save it with "
                "`model.save('model.keras')`, load it with "
                "KERAS_BACKEND=tensorflow (`keras.saving.load_model`) and "
                "call `export` there: the exported model then serves raw "
                "strings."
            )

    def step(self, model, phase, keras_step, *args):
        """Keras's `phase` step (`keras_step(*args)`), running the trunk.

        A step traced with the model's `call` redirected to the SmartStage
        trunk (see `StagingMixin.call`): the data holds the cut tensors.
        """
        with tensorflow_steps.calling_trunk(model, phase):
            return keras_step(*args)

    def make_function(self, model, phase, make):
        """`make()`s `phase`'s compiled step and returns it, as Keras does."""
        make()
        return getattr(model, FUNCTIONS[phase])

    def narrows_int64(self):
        """Whether the trunk takes int64 cut tensors as int32."""
        return False

    def variable_reader(self, variables):
        """A function returning `variables`' values as NumPy arrays."""
        return lambda: tuple(keras.ops.convert_to_numpy(v) for v in variables)
