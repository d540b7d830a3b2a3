"""`DataBackup`: exactly-once resume for `keras.callbacks.BackupAndRestore`.

Keras's `BackupAndRestore` saves the weights every `save_freq` batches, but
a run killed mid-epoch restarts that epoch from its first batch: the
batches trained before the kill are trained again, and a stage's buffer is
simply lost. `DataBackup` saves the position of the training data with
each of those saves: a checkpoint of the tf.data iterator the training
step reads (tf.data saves the shuffle buffers and the batches already in
the stage's buffer with it). On restart the resumed epoch continues from
the batch after the last save, so every example of every epoch is trained
on exactly once. The resumed epoch ends when those batches are read (not a
step later on the end of the data, which would count an optimizer
iteration) and its metrics go on from the values saved with the position:
the run goes on as one never stopped would (see docs/reliability.md).

`keras_stage.Model.fit` adds one, right after the `BackupAndRestore` in the
callbacks, whenever the run is staged; users do not create it.

What it needs from the data: a pipeline tf.data can checkpoint and replay.
`tf.data` sources with seeded shuffling (`shuffle(n, seed=...)`) and Keras's
NumPy arrays without shuffling qualify. Python generators and
`keras.utils.PyDataset` cannot be checkpointed (their state lives in
Python); with them the resumed epoch starts again from its first batch, as
with plain Keras, and a warning says so.
"""

import json
import logging
import os
import warnings

import keras
import numpy as np
import tensorflow as tf

logger = logging.getLogger("keras_stage")

# The folder inside the BackupAndRestore's backup_dir that holds ours.
SUBDIR = "keras_stage_data"
_JOURNAL = "position.json"


def _write_json(path, value):
    # Written aside and renamed: a kill mid-write leaves the old journal.
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


class DataBackup(keras.callbacks.Callback):
    """Saves and restores the training data's position beside a backup.

    Args:
        backup: The run's `keras.callbacks.BackupAndRestore`; this callback
            follows its `backup_dir` and `save_freq`, and must come right
            after it in the callbacks.
        current_iterator: Returns the iterator the training step read last
            (or None).
        restore_next: Called with a function of the iterator to run before
            the next training step, to restore its position, the count of
            the epoch's steps left after that position (None if Keras does
            not know the epoch's length), and the epoch, as it begins.
        build_metrics: Called (if given) before the resumed epoch's
            metrics get their saved values: builds them if Keras has not
            yet (without a strategy it builds them as it traces the first
            step, after the epoch began).
    """

    def __init__(
        self, backup, current_iterator, restore_next, build_metrics=None
    ):
        super().__init__()
        self._build_metrics = build_metrics
        self.backup = backup
        self.save_freq = backup.save_freq
        self.directory = os.path.join(backup.backup_dir, SUBDIR)
        self._current_iterator = current_iterator
        self._restore_next = restore_next
        # BackupAndRestore's own schedule, counted the same way.
        self._last_batch_seen = 0
        self._since_save = 0
        self._epoch = 0
        self._saves = 0
        self._pending = None
        self._warned = False

    # -- saving -------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == epoch:
            self._restore_next(pending[1], pending[2], epoch)
            self._restore_metrics(pending[3])

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        if batch <= self._last_batch_seen:  # a new epoch
            self._since_save += batch + 1
        else:
            self._since_save += batch - self._last_batch_seen
        self._last_batch_seen = batch
        if self._since_save >= self.save_freq:
            self._since_save = 0
            self._save(self._epoch, batch)

    def on_epoch_end(self, epoch, logs=None):
        self._last_batch_seen = 0
        if self.save_freq == "epoch":
            # BackupAndRestore saved at the epoch's end: the next epoch
            # starts from its first batch. (With a batch count it saves no
            # more at an epoch's end, and a run killed before the next
            # save resumes this epoch after its last saved batch.)
            self._journal({"epoch": epoch + 1, "batch": -1, "iterator": None})

    def _save(self, epoch, batch):
        iterator = self._current_iterator()
        path = None
        if iterator is not None:
            self._saves += 1
            prefix = os.path.join(self.directory, f"iterator-{self._saves}")
            try:
                path = tf.train.Checkpoint(iterator=iterator).write(prefix)
            except (tf.errors.OpError, TypeError, ValueError) as e:
                self._warn_unsaveable(e)
        self._journal(
            {
                "epoch": epoch,
                "batch": batch,
                "iterator": path,
                "metrics": self._metric_values(),
            }
        )

    def _metric_variables(self):
        # The epoch's running metrics (the loss's mean and the compiled
        # metrics), whose values the epoch's History entry reports.
        model = self.model
        if model is None:
            return []
        return [v for metric in model.metrics for v in metric.variables]

    def _metric_values(self):
        return [np.asarray(v).tolist() for v in self._metric_variables()]

    def _restore_metrics(self, values):
        """Gives the epoch's metrics the values saved with its position.

        Keras resets them as every epoch begins: without this, a resumed
        epoch's History entry would average its batches after the saved
        one only, not the epoch's.
        """
        if values is not None and self._build_metrics is not None:
            self._build_metrics()
        variables = self._metric_variables()
        if values is None or len(values) != len(variables):
            logger.info(
                "BackupAndRestore: the resumed epoch's metrics start from "
                "zero (%s saved values for %d metric variables).",
                "no" if values is None else len(values),
                len(variables),
            )
            return
        for variable, value in zip(variables, values, strict=True):
            variable.assign(np.asarray(value, dtype=variable.dtype))

    def _journal(self, position):
        os.makedirs(self.directory, exist_ok=True)
        previous = self._read_journal() or {}
        _write_json(os.path.join(self.directory, _JOURNAL), position)
        # Keep the iterator checkpoint just written and the one before.
        keep = [
            p for p in (position["iterator"], previous.get("iterator")) if p
        ]
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.startswith("iterator-") and not any(
                path.startswith(f"{k}.") for k in keep
            ):
                os.remove(path)

    def _read_journal(self):
        path = os.path.join(self.directory, _JOURNAL)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def _warn_unsaveable(self, error):
        if self._warned:
            return
        self._warned = True
        message = (
            "BackupAndRestore: the training data's position cannot be "
            "saved, so a run restarted mid-epoch trains that epoch's first "
            "batches again (as plain Keras does). The data pipeline must "
            "be one tf.data can checkpoint: a Python generator or "
            "PyDataset is not (use a tf.data source), nor is a stage on the "
            "tf.data service (its workers hold the position). "
            f"TensorFlow said: {str(error).splitlines()[0]}"
        )
        warnings.warn(message, stacklevel=2)
        logger.warning(message)

    # -- restoring ----------------------------------------------------------

    def on_train_begin(self, logs=None):
        # BackupAndRestore (just before) restored the weights and the epoch
        # to resume; the journal says where in that epoch its last save was.
        position = self._read_journal()
        if position is None or position["iterator"] is None:
            return
        path, batch = position["iterator"], position["batch"]

        def restore(iterator):
            tf.train.Checkpoint(iterator=iterator).read(path).expect_partial()
            logger.info(
                "BackupAndRestore: epoch %d resumes after its batch %d.",
                position["epoch"],
                batch,
            )

        # Keras still counts the whole epoch's steps; those after the
        # position are what the restored iterator holds.
        steps = (self.params or {}).get("steps")
        left = None if steps is None else max(int(steps) - (batch + 1), 0)
        self._pending = (
            position["epoch"],
            restore,
            left,
            position.get("metrics"),
        )
