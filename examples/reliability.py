"""Reliability: bad records skipped, and exactly-once resume after a crash.

Both parts count, per example, how many training steps used it: a
`TrainingCounter` layer in the model adds one per example id to a
non-trainable weight in every training step. Being a weight, the count is
saved and restored with the model, exactly like the training it counts.

1. Bad records. Some lines of a CSV source are corrupt, so
   `tf.io.decode_csv` fails on their batches. With
   `StagedInput(ignored_exception_types=(tf.errors.InvalidArgumentError,))`
   those batches are skipped, `stage_skipped` in the history reports how
   many per epoch, a warning on the `keras_stage` logger quotes the errors,
   and training goes on: every other example is trained once per epoch.
2. Exactly-once resume. A run with `keras.callbacks.BackupAndRestore(...,
   save_freq=5)` is interrupted in the middle of an epoch (a callback
   raises at a batch, three batches after a save, while the stage's buffer
   holds batches not yet trained). A new model is built and `fit` runs
   again, as a restarted process would: keras_stage restores the data's
   position with the weights, so every example of every epoch is trained
   exactly once. The same interruption with a plain `keras.Model` trains
   the resumed epoch's first batches twice.

Run with `python -m examples.reliability` (`--tiny` for a smoke run).
See docs/reliability.md.
"""

import argparse
import collections
import logging
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402

SEED = 0
BATCH_SIZE = 4
SAVE_FREQ = 5
INTERRUPT_AT = (1, 13)  # (epoch, batch): three batches after the save at 10


@keras.saving.register_keras_serializable(package="keras_stage_examples")
class TrainingCounter(keras.layers.Layer):
    """Passes `features` through; counts the training uses of each id."""

    def __init__(self, num_ids, **kwargs):
        super().__init__(**kwargs)
        self.num_ids = num_ids
        self.counts = self.add_weight(
            shape=(num_ids,),
            initializer="zeros",
            dtype="int32",
            trainable=False,
            name="counts",
        )

    def call(self, inputs, training=False):
        features, ids = inputs
        if training:
            self.counts.assign_add(
                tf.math.bincount(
                    tf.cast(ids, "int32"),
                    minlength=self.num_ids,
                    maxlength=self.num_ids,
                )
            )
        return features

    def get_config(self):
        return {**super().get_config(), "num_ids": self.num_ids}


def build_model(num_ids, staged_input=None):
    """x -> Dense, with the id counted; staged when given a StagedInput."""
    inputs = {
        "id": keras.Input(shape=(), dtype="int64", name="id"),
        "x": keras.Input(shape=(1,), name="x"),
    }
    x = inputs if staged_input is None else staged_input(inputs)
    h = keras.layers.Dense(4, name="hidden")(x["x"])
    h = TrainingCounter(num_ids, name="counter")([h, x["id"]])
    outputs = keras.layers.Dense(1, name="out")(h)
    model_class = keras.Model if staged_input is None else keras_stage.Model
    model = model_class(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def counts_of(model):
    return model.get_layer("counter").counts.numpy()


def histogram(counts):
    """{times trained: number of examples}, as text."""
    times = sorted(collections.Counter(counts.tolist()).items())
    return ", ".join(f"{n} example(s) {t}x" for t, n in times)


# -- 1. bad records --------------------------------------------------------


def parse(lines):
    ids, x, y = tf.io.decode_csv(lines, [[0], [0.0], [0.0]])
    return {"id": tf.cast(ids, "int64"), "x": x[:, None]}, y[:, None]


class PrintWarnings(logging.Handler):
    """Prints the first warning's summary and the errors' own words."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += 1
        if self.count > 1:
            return
        lines = record.getMessage().splitlines()
        print(f"  keras_stage warning: {lines[0]}")
        # Each error's own words are the line before TensorFlow's node
        # annotations ("\t [[{{node ...}}]]"), after any "Error in
        # user-defined function ...: " prefix (TF 2.21 adds it, 2.16 not).
        for before, line in zip(lines, lines[1:], strict=False):
            if line.startswith("\t [[") and not before.startswith("\t [["):
                print(f"    ...{before.rsplit(': ', 1)[-1]}")


def bad_records(num_batches, epochs):
    good = num_batches * BATCH_SIZE - 2
    lines = [f"{i},{i % 10 / 10},{i % 3}" for i in range(good)]
    # Two corrupt lines, in the third batch and the second-to-last one.
    lines.insert(2 * BATCH_SIZE + 1, "not,a,valid,record")
    lines.insert((num_batches - 2) * BATCH_SIZE, "truncated")
    bad = 2
    data = tf.data.Dataset.from_tensor_slices(lines).batch(BATCH_SIZE)
    data = data.map(parse)
    print(
        f"1. Bad records: {len(lines)} lines in {num_batches} batches of "
        f"{BATCH_SIZE}, {bad} of them corrupt"
    )
    staged_input = keras_stage.layers.StagedInput(
        capacity=4,
        num_threads=2,
        ignored_exception_types=(tf.errors.InvalidArgumentError,),
    )
    model = build_model(good, staged_input)
    handler = PrintWarnings()
    logging.getLogger("keras_stage").addHandler(handler)
    try:
        history = model.fit(data, epochs=epochs, shuffle=False, verbose=0)
    finally:
        logging.getLogger("keras_stage").removeHandler(handler)
    print(f"  ({handler.count} such warnings, one per epoch)")
    skipped = history.history["stage_skipped"]
    counts = counts_of(model)
    lost = int(np.sum(counts == 0))
    print(f"  stage_skipped per epoch: {skipped} (bad records: {bad})")
    print(
        f"  examples trained in every epoch: {good - lost} of {good}; never "
        f"trained: {lost}, the good records that shared a batch with a bad "
        "one"
    )
    print(f"  trained {epochs} epochs: {histogram(counts)}")
    return skipped, bad


# -- 2. exactly-once resume ------------------------------------------------


class Interrupt(keras.callbacks.Callback):
    """Raises at one batch, as a crash would."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == INTERRUPT_AT:
            raise RuntimeError(
                f"interrupted at epoch {self.epoch}, batch {batch}"
            )


def resumed_run(num_ids, epochs, backup_dir, staged):
    def dataset():
        ids = tf.data.Dataset.range(num_ids).shuffle(num_ids, seed=7)
        return ids.map(
            lambda i: (
                {"id": i, "x": tf.cast(i, "float32")[None] / num_ids},
                tf.cast(i % 3, "float32")[None],
            )
        ).batch(BATCH_SIZE)

    def new_model():
        keras.utils.set_random_seed(SEED)
        staged_input = None
        if staged:
            staged_input = keras_stage.layers.StagedInput(
                capacity=4, num_threads=2
            )
        return build_model(num_ids, staged_input)

    def fit(model, callbacks):
        backup = keras.callbacks.BackupAndRestore(
            backup_dir, save_freq=SAVE_FREQ
        )
        return model.fit(
            dataset(),
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[backup, *callbacks],
        )

    message = "not interrupted"
    try:
        fit(new_model(), [Interrupt()])
    except RuntimeError as e:
        message = str(e)
    model = new_model()  # a restarted process builds its model again
    history = fit(model, [])
    return message, len(history.history["loss"]), counts_of(model)


def resume(num_ids, epochs):
    print(
        f"\n2. Exactly-once resume: {num_ids} examples, batches of "
        f"{BATCH_SIZE}, {epochs} epochs, BackupAndRestore(save_freq="
        f"{SAVE_FREQ})"
    )
    results = {}
    for staged in (True, False):
        label = "keras_stage.Model" if staged else "plain keras.Model"
        with tempfile.TemporaryDirectory() as folder:
            message, resumed_epochs, counts = resumed_run(
                num_ids, epochs, os.path.join(folder, "backup"), staged
            )
        print(f"  {label}: {message}; fit again: {resumed_epochs} epoch(s)")
        print(f"    each example trained: {histogram(counts)}")
        results[label] = counts
    once = bool(np.all(results["keras_stage.Model"] == epochs))
    print(
        f"  keras_stage: every example trained exactly once per epoch: {once}"
    )
    return once


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    num_batches, epochs = (12, 2) if args.tiny else (250, 3)
    keras.utils.set_random_seed(SEED)
    skipped, bad = bad_records(num_batches, epochs)
    once = resume(num_ids=96, epochs=3)
    return 0 if once and skipped == [bad] * epochs else 1


if __name__ == "__main__":
    raise SystemExit(main())
