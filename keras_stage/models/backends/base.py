"""`Backend`: what a staged call asks of the Keras backend it runs on; the
base refuses the staged calls of the others (numpy, openvino)."""

import keras
import tensorflow as tf

from keras_stage.models.backends import tensorflow_steps
from keras_stage.models.model_state import FUNCTIONS


class Backend:
    """What a staged call does on one Keras backend.

    A new backend subclasses it here, named in `backends.BACKENDS`, with:

    - Refusals: `check_supported(model, layer)`, `check_strategy(model)`,
      `check_exportable(model)`.
    - Steps: `step(model, phase, keras_step, *args)`, `make_function(model,
      phase, make)`, `may_run_unstaged` (whether a call may skip its
      stage), `jit_by_default` (`jit_compile="auto"`).
    - Feed: `reads_in_graph(phase)` (Keras's step reads the batches in its
      graph), `host_arrays(data)`, `feed(data, phase)` (what Keras
      iterates for a `StagedData`), `build(model, data, phase)` (from the
      stage's specs), `shard_batches(dataset)` (a process's batches),
      `unread_opens` (iterators Keras opens per epoch, unread).
    - Buffer and pool: `uses_device_buffer`, `pool_start(options)`,
      `pool_shrinks`.
    - For the planner: `native_tf`, `narrows_int64()`,
      `variable_reader(variables)`.

    Args:
        name: Keras's name of the backend (`keras.backend.backend()`).
    """

    # Whether Keras's tensors and variables are TensorFlow's: any layer
    # then runs in tf.data; otherwise only fixed preprocessing layers and
    # layers of TensorFlow ops.
    native_tf = False
    # Why a model with string inputs cannot be exported on this backend.
    export_refusal = "jax2tf takes numeric arrays only"

    def __init__(self, name):
        self.name = name

    def check_supported(self, model, layer):
        """Raises a clear error for a staged call this backend cannot run."""
        raise NotImplementedError(
            f"keras_stage stages fit/evaluate/predict on the TensorFlow, "
            f"JAX and PyTorch backends; model '{model.name}' runs on the "
            f"'{self.name}' backend. Set KERAS_BACKEND=tensorflow, "
            "KERAS_BACKEND=jax or KERAS_BACKEND=torch before importing "
            "Keras, or use a plain keras.Model (or remove the StagedInput "
            "and smart_stage) on this backend."
        )

    def check_strategy(self, model):
        """Raises a clear error for a fit under a strategy it cannot train."""

    def check_plan(self, model, plan, input_specs=None):
        """Raises a clear error for a SmartStage plan whose trunk cannot run
        here: off TensorFlow, one that takes strings (`input_specs`: a
        subclass's, whose unplanned call takes its inputs as they are)."""
        if self.native_tf:
            return
        if plan.note and any(
            spec.dtype == tf.string for spec in keras.tree.flatten(input_specs)
        ):
            raise ValueError(
                f"Model '{model.name}' takes strings, which Keras's "
                f"{self.name} step cannot, and SmartStage cannot stage the "
                f"work on them: {plan.note} On this backend the string work "
                "must be staged: write a sub-model holding lookups as a "
                "keras_stage.Model (its call is then traced inline), not a "
                "keras.Model."
            )
        strings = [b.name for b in plan.boundary if b.dtype == "string"]
        if not strings:
            return
        trunk = [
            f"'{name}' ({plan.reasons[name]})"
            for name in plan.trunk_layers
            if name in plan.reasons
        ][:1]
        raise ValueError(
            f"Model '{model.name}': on the {self.name} backend its trunk "
            f"cannot take strings, and the stage hands it the string tensors "
            f"{strings}, which the trunk's first layers consume"
            + (f" ({', '.join(trunk)})" if trunk else "")
            + ". Stage the string work: put the lookups, hashing or parsing "
            "before any layer with trainable weights, and write a sub-model "
            "holding them as a keras_stage.Model (its call is then planned "
            "inline), not a keras.Model."
        )

    def check_exportable(self, model):
        """Raises a clear error for an export this backend cannot make: off
        TensorFlow, of a model with string inputs."""
        strings = [
            t.name
            for t in keras.tree.flatten(getattr(model, "inputs", None) or [])
            if t.dtype == "string"
        ]
        if strings:
            raise ValueError(
                f"Model '{model.name}' has string inputs ({strings}), which "
                f"Keras cannot export on the {self.name} backend "
                f"({self.export_refusal}). Save it with "
                "`model.save('model.keras')`, load it with "
                "KERAS_BACKEND=tensorflow (`keras.saving.load_model`) and "
                "call `export` there: the exported model then serves raw "
                "strings."
            )

    def step(self, model, phase, keras_step, *args):
        """Keras's `phase` step (`keras_step(*args)`), running the trunk."""
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
