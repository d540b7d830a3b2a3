"""DeepRec's `tf.staged` and SmartStage example, ported to keras_stage.

DeepRec documents `tf.staged` and SmartStage with one small TF1 graph: text
lines are read from "1.txt", batched by two, parsed with `decode_csv`,
staged, hashed into 10 buckets and looked up in a [100, 3] variable, and a
string `target` is printed five times from a `MonitoredTrainingSession`
with `tf.make_prefetch_hook()`. This file ports it twice; every line that
replaces a DeepRec line says so in a `# DeepRec:` comment.

1. Line by line with the engine, `keras_stage.data.stage`, in eager TF2:
   the reader and `tf.train.batch` become a `tf.data` pipeline, the
   parse is the staged computation, and a plain loop replaces the session
   and its prefetch hook. It prints the same five targets.
2. As a Keras model with SmartStage: the stage boundary is a
   `StagedInput` on the raw lines, `compile(smart_stage=True)` replaces
   `do_smart_stage = True` and finds by itself that `decode_csv` and the
   hashing can run in the stage while the lookup in `var` (a trainable
   embedding) cannot, and a `PrefetchCallback` replaces the prefetch hook.
   The seed graph trains nothing; here the second CSV field is a score and
   the model learns it.

Run with `python -m examples.deeprec_seed` (`--tiny` for a smoke run).
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_stage  # noqa: E402
from keras_stage.data import stage  # noqa: E402
from keras_stage.layers import StagedInput  # noqa: E402


def write_seed_file(path, count):
    """Writes the seed's input file: two CSV fields a line, "user_3,0.3"."""
    with open(path, "w") as f:
        for i in range(count):
            f.write(f"user_{i % 7},{(i % 7) / 10:.1f}\n")


# -- 1. tf.staged, line by line ----------------------------------------------


def seed_with_the_engine(path):
    # DeepRec: filename_queue = tf.train.string_input_producer(['1.txt'])
    # DeepRec: reader = tf.TextLineReader()
    # DeepRec: k, v = reader.read(filename_queue)
    v = tf.data.TextLineDataset([path])

    # DeepRec: var = tf.get_variable("var", shape=[100, 3],
    # DeepRec:                       initializer=tf.ones_initializer())
    var = tf.Variable(tf.ones([100, 3]), name="var")

    # DeepRec: v = tf.train.batch([v], batch_size=2, capacity=20 * 3)
    v = v.batch(2)  # no queue to size: the stage's capacity is the buffer

    def parse(v):
        # DeepRec: v0, v1 = tf.decode_csv(v, record_defaults=[[''], ['']],
        # DeepRec:                        field_delim=',')
        v0, v1 = tf.io.decode_csv(
            v, record_defaults=[[""], [""]], field_delim=","
        )
        return v0, v1

    # DeepRec: xx = tf.staged([v0, v1])
    # The parse is the staged computation; the defaults below are
    # tf.staged's (capacity=1, num_threads=1).
    staged = stage(v, parse, capacity=1, num_threads=1, name="xx")

    # DeepRec: tf.train.mark_target_node([target])
    # DeepRec: with tf.train.MonitoredTrainingSession(
    # DeepRec:         hooks=[tf.make_prefetch_hook()]) as sess:
    # DeepRec:     for i in range(5):
    # DeepRec:         print(sess.run([target]))
    # Eager TF2 runs what the loop asks for: no target node, no session,
    # no hook; iterating the staged dataset runs the stage.
    iterator = iter(staged)
    for i in range(5):
        xx = list(next(iterator))
        # DeepRec: xx[0]=tf.string_to_hash_bucket(xx[0],num_buckets=10)
        xx[0] = tf.strings.to_hash_bucket(xx[0], num_buckets=10)
        # DeepRec: xx[0] = tf.nn.embedding_lookup(var, xx[0])
        xx[0] = tf.nn.embedding_lookup(var, xx[0])
        # DeepRec: xx[1]=tf.concat([xx[1], ['xxx']], axis = 0)
        xx[1] = tf.concat([xx[1], ["xxx"]], axis=0)
        # DeepRec: target = tf.concat([tf.as_string(xx[0]),
        # DeepRec:                     [xx[1], xx[1]]], 0)
        target = tf.concat([tf.as_string(xx[0]), [xx[1], xx[1]]], 0)
        print(f"run {i}: target =")
        for row in target.numpy().tolist():
            print("  " + " ".join(f"{s.decode():>10}" for s in row))
    # The stage stops at the end of the data, or now:
    print(f"staged.close() -> {staged.close()}")


# -- 2. SmartStage, as a Keras model -----------------------------------------


@keras.saving.register_keras_serializable(package="keras_stage_examples")
class DecodeCsv(keras.layers.Layer):
    """`tf.io.decode_csv` of "user,score" lines into two string fields."""

    def call(self, v):
        v0, v1 = tf.io.decode_csv(
            v, record_defaults=[[""], [""]], field_delim=","
        )
        return [v0, v1]

    def compute_output_spec(self, v):
        # Keras cannot trace string outputs; say what they are.
        return [keras.KerasTensor(v.shape, "string") for _ in range(2)]


def seed_with_smart_stage(path, epochs):
    with open(path) as f:
        lines = np.array(f.read().splitlines(), dtype=object)
    scores = np.array([float(s.split(",")[1]) for s in lines], "float32")

    line = keras.Input(shape=(), dtype="string", name="line")
    # DeepRec: xx = tf.staged([v0, v1])
    # The boundary is at the model's input; SmartStage moves the layers
    # after it into the stage for as long as training changes nothing.
    xx = StagedInput(capacity=1, num_threads=1, name="xx")(line)
    # DeepRec: v0, v1 = tf.decode_csv(v, record_defaults=[[''], ['']], ...)
    v0, _ = DecodeCsv(name="decode_csv")(xx)
    # DeepRec: xx[0]=tf.string_to_hash_bucket(xx[0],num_buckets=10)
    # (Keras's Hashing layer: the same bucketing with tf's fast hash.)
    ids = keras.layers.Hashing(num_bins=10, name="string_to_hash_bucket")(v0)
    # DeepRec: var = tf.get_variable("var", shape=[100, 3],
    # DeepRec:                       initializer=tf.ones_initializer())
    # DeepRec: xx[0] = tf.nn.embedding_lookup(var, xx[0])
    xx0 = keras.layers.Embedding(
        100, 3, embeddings_initializer="ones", name="var"
    )(ids)
    score = keras.layers.Dense(1, name="score")(xx0)
    model = keras_stage.Model(line, score, name="seed")

    # DeepRec: config.graph_options.optimizer_options.do_smart_stage = True
    # (do_smart_stage_gpu needs no flag: on a GPU machine the default
    # device="auto" keeps the staged work on host threads and the finished
    # batches on the GPU.)
    model.compile(
        optimizer=keras.optimizers.Adam(0.05), loss="mse", smart_stage=True
    )
    model.stage_summary(line_length=79)

    # DeepRec: with tf.train.MonitoredTrainingSession(
    # DeepRec:         config=config, hooks=[tf.make_prefetch_hook()]) ...
    # The PrefetchCallback runs the stages of the call, like the hook, and
    # reports on them (keras_stage adds one when it is left out).
    history = model.fit(
        lines,
        scores,
        batch_size=32,
        epochs=epochs,
        callbacks=[keras_stage.callbacks.PrefetchCallback(verbose=1)],
        verbose=0,
    )
    print(
        "loss per epoch: "
        + ", ".join(f"{v:.4f}" for v in history.history["loss"])
    )
    predicted = model.predict(lines[:3], verbose=0)[:, 0]
    for text, value in zip(lines[:3], predicted, strict=True):
        print(f"  predict({text!r}) -> {value:.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    count, epochs = (544, 2) if args.tiny else (7000, 4)
    keras.utils.set_random_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "1.txt")
        write_seed_file(path, count)
        print("1. tf.staged, line by line (keras_stage.data.stage):")
        seed_with_the_engine(path)
        print("\n2. SmartStage (a Keras model, compile(smart_stage=True)):")
        seed_with_smart_stage(path, epochs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
