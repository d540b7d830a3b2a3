"""`DataBackup`: exactly-once resume for `keras.callbacks.BackupAndRestore`.

With each `BackupAndRestore` save it checkpoints the step's tf.data iterator,
the epoch's metrics and the seed generators, so a resumed epoch continues
after the last saved batch; `recover()` keeps one save's weights and position
when a kill cuts a backup. `keras_stage.Model.fit` adds one to staged runs.
"""

import hashlib
import json
import logging
import os
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_stage import _compat
from keras_stage.planner.state_access import seed_states

logger = logging.getLogger("keras_stage")

SUBDIR = "keras_stage_data"  # ours, in the BackupAndRestore's backup_dir
_JOURNAL = "position.json"
# Iterator checkpoints kept: the journal's, and one written after it.
_KEPT = 2


def _write_text(path, text):
    # Written aside and renamed: a kill mid-write leaves the old file.
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_json(path, value):
    _write_text(path, json.dumps(value))


def _copy(source, target):
    """Copies `source` to `target` atomically; returns its sha256."""
    digest = hashlib.sha256()
    tmp = f"{target}.tmp"
    with open(source, "rb") as src, open(tmp, "wb") as dst:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            digest.update(chunk)
            dst.write(chunk)
    os.replace(tmp, target)
    return digest.hexdigest()


def _values(variables):
    return [np.asarray(v).tolist() for v in variables]


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _read_text(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def _with_epoch(metadata, epoch):
    """Keras's metadata file, made to name `epoch`; returns its text
    (BackupAndRestore learns the epoch only as it ends)."""
    text = _read_text(metadata)
    if text is None:
        return None
    values = json.loads(text)
    if values.get("epoch") == epoch:
        return text
    values["epoch"] = epoch
    text = json.dumps(values)
    _write_text(metadata, text)
    return text


class TornBackupError(RuntimeError):
    """The backup folder holds no save whose parts belong together."""


class DataBackup(keras.callbacks.Callback):
    """Saves and restores the training data's position beside a backup.

    Args:
        backup: The run's `keras.callbacks.BackupAndRestore`, which this
            callback follows right after.
        current_iterator: Returns the iterator the step read last, or None.
        restore_next: Called as the epoch begins with a function restoring
            the iterator's position (run before the next step), the epoch's
            steps left after it (None if unknown), and the epoch.
        build_metrics: Builds the metrics before a resumed epoch's get
            their saved values.
        stage_state: Returns a dict of the `tf.Variable`s the stage's
            pipeline uses, saved with the iterator and restored before it.
        stage_restored: Called with that dict once it is restored.
        ordered: Whether the stage keeps the data's order; if not, the
            first save warns that a resumed run's weights will differ.

    Each save is one position in `backup_dir/keras_stage_data/`: the
    iterator checkpoint, a copy of Keras's weights and metadata, and a
    journal naming them, written last and atomically.
    """

    def __init__(
        self,
        backup,
        current_iterator,
        restore_next,
        build_metrics=None,
        stage_state=None,
        ordered=True,
        stage_restored=None,
    ):
        super().__init__()
        self._stage_restored = stage_restored
        self._ordered = ordered
        self._build_metrics = build_metrics
        self._stage_state = stage_state or (lambda: {})
        self.backup = backup
        self.save_freq = backup.save_freq
        self.directory = os.path.join(backup.backup_dir, SUBDIR)
        self._current_iterator = current_iterator
        self._restore_next = restore_next
        # BackupAndRestore's own schedule, counted the same way.
        self._last_batch_seen = 0
        self._since_save = 0
        self._epoch = 0
        self._offset = 0
        self._stepped = False
        self._untrained = None
        self._saves = 0
        self._pending = None
        self._saver = None  # (weakref to an iterator, its manager)
        self._warned = set()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._offset = 0
        self._stepped = False
        self._untrained = None
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == epoch:
            self._restore_next(pending[1], pending[2], epoch)
            self._restore_values(pending[3])
            # Keras numbers the resumed epoch's batches from 0 again.
            self._offset = pending[3]["batch"] + 1

    def on_train_batch_end(self, batch, logs=None):
        self._stepped = True
        if self.save_freq == "epoch":
            return
        if batch <= self._last_batch_seen:  # a new epoch
            self._since_save += batch + 1
        else:
            self._since_save += batch - self._last_batch_seen
        self._last_batch_seen = batch
        if self._since_save >= self.save_freq:
            self._since_save = 0
            self._save(self._epoch, batch + self._offset)

    def on_test_begin(self, logs=None):
        self._note_untrained_results()

    def _note_untrained_results(self):
        # A resumed epoch saved after its last batch runs no step: its logs
        # get the restored metrics, noted before validation resets them.
        if self._offset and not self._stepped and self._untrained is None:
            self._untrained = {
                key: float(np.asarray(value))
                for key, value in self.model.get_metrics_result().items()
            }

    def on_epoch_end(self, epoch, logs=None):
        self._last_batch_seen = 0
        self._note_untrained_results()
        if self._untrained and logs is not None:
            for key, value in self._untrained.items():
                logs.setdefault(key, value)
        if self.save_freq == "epoch":
            # BackupAndRestore saved at the epoch's end.
            self._journal(epoch + 1, -1, None, None)

    def _save(self, epoch, batch):
        if not self._ordered:
            self._warn_once(
                "unordered",
                "BackupAndRestore: this stage has deterministic=False, so a "
                "run resumed from this backup trains every example of the "
                "interrupted epoch once, but not in the order of a run "
                "never stopped: its weights will differ from that run's. "
                "Set deterministic=True on the StagedInput for a resume "
                "identical to never stopping.",
            )
        iterator = self._current_iterator()
        path = None
        if iterator is not None:
            try:
                # Numbered by the optimizer's step: one position, one name.
                path = self._manager(iterator).save(
                    checkpoint_number=self._step()
                )
            except (tf.errors.OpError, TypeError, ValueError) as e:
                self._warn_once(
                    "unsaveable",
                    "BackupAndRestore: the training data's position cannot "
                    "be saved, so a run restarted mid-epoch trains that "
                    "epoch's first batches again (as plain Keras does). The "
                    "data pipeline must be one tf.data can checkpoint: a "
                    "Python generator or PyDataset is not (use a tf.data "
                    "source), nor is a stage on the tf.data service (its "
                    "workers hold the position). TensorFlow said: "
                    f"{str(e).splitlines()[0]}",
                )
        self._journal(
            epoch,
            batch,
            path,
            {
                "metrics": _values(self._metric_variables()),
                "seeds": _values(self._seed_variables()),
            },
        )

    def _manager(self, iterator):
        """The checkpoint manager of `iterator`, made once per iterator
        (a checkpoint object makes a variable)."""
        kept = self._saver
        if kept is not None and kept[0]() is iterator:
            return kept[1]
        checkpoint = tf.train.Checkpoint(
            iterator=iterator, **self._stage_state()
        )
        manager = tf.train.CheckpointManager(
            checkpoint,
            self.directory,
            max_to_keep=_KEPT,
            checkpoint_name="iterator",
        )
        try:
            self._saver = (weakref.ref(iterator), manager)
        except TypeError:  # not weakly referable: made again next time
            self._saver = None
        return manager

    def _step(self):
        self._saves += 1
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            return self._saves  # hooks called by hand, without a model
        return int(np.asarray(optimizer.iterations))

    def _journal(self, epoch, batch, iterator, values):
        """Writes the position with a copy of Keras's save, journal last."""
        os.makedirs(self.directory, exist_ok=True)
        weights, metadata = _compat.backup_files(self.backup)
        position = {"epoch": epoch, "batch": batch, "iterator": iterator}
        position.update(values or {})
        position["weights"] = None
        if os.path.exists(weights):
            previous = (self._read_journal() or {}).get("weights")
            # Two names in turn: the journal's copy stays whole meanwhile.
            name = (
                "weights-b.h5" if previous == "weights-a.h5" else "weights-a.h5"
            )
            position["weights"] = name
            position["weights_sha256"] = _copy(
                weights, os.path.join(self.directory, name)
            )
            position["keras_metadata"] = _with_epoch(metadata, epoch)
        _write_json(os.path.join(self.directory, _JOURNAL), position)

    def _metric_variables(self):
        model = self.model
        if model is None:
            return []
        return [v for metric in model.metrics for v in metric.variables]

    def _seed_variables(self):
        # The trunk's seed generators, which Keras's weights file leaves
        # out (staged random layers draw from the stage's own count).
        if self.model is None:
            return []
        return seed_states(self.model)

    def _restore_values(self, position):
        """Gives the epoch's metrics and seeds the values saved with it."""
        if position.get("metrics") is not None and self._build_metrics:
            self._build_metrics()
        for key, variables in (
            ("metrics", self._metric_variables()),
            ("seeds", self._seed_variables()),
        ):
            values = position.get(key)
            if values is None or len(values) != len(variables):
                logger.info(
                    "BackupAndRestore: the resumed epoch's %s start afresh "
                    "(%s saved values for %d variables).",
                    key,
                    "no" if values is None else len(values),
                    len(variables),
                )
                continue
            for variable, value in zip(variables, values, strict=True):
                variable.assign(np.asarray(value, dtype=variable.dtype))

    def _read_journal(self):
        path = os.path.join(self.directory, _JOURNAL)
        if not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                return json.load(f)
        except ValueError as e:
            raise TornBackupError(
                f"The data position journal {path} cannot be read ({e}). "
                "It is written aside and renamed, so this is not a kill "
                "mid-write: the file was changed or the disk lost it. "
                f"Delete {self.directory} to resume as plain Keras does "
                "(the interrupted epoch from its first batch), or the "
                f"whole {self.backup.backup_dir} to start over."
            ) from e

    def _warn_once(self, key, message):
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, stacklevel=2)
        logger.warning(message)

    def recover(self):
        """Makes Keras's backup files the ones the journal names (run before
        `BackupAndRestore` loads them, after a kill during a save).

        Raises:
            TornBackupError: if that copy is not whole either.
        """
        position = self._read_journal()
        if position is None or "weights" not in position:
            return
        weights, metadata = _compat.backup_files(self.backup)
        if position["weights"] is None:
            # Nothing saved: Keras's files are a first save cut before ours.
            if os.path.exists(weights):
                for path in (weights, metadata):
                    if os.path.exists(path):
                        os.remove(path)
                self._warn_once(
                    "first",
                    "BackupAndRestore: the first save in "
                    f"{self.backup.backup_dir} was interrupted before its "
                    "data position was written. The run starts again from "
                    "its first batch.",
                )
            return
        if (
            os.path.exists(weights)
            and _read_text(metadata) == position["keras_metadata"]
            and _sha256(weights) == position["weights_sha256"]
        ):
            return
        copy = os.path.join(self.directory, position["weights"])
        if not (
            os.path.exists(copy) and _sha256(copy) == position["weights_sha256"]
        ):
            raise TornBackupError(
                f"The backup in {self.backup.backup_dir} is torn: Keras's "
                f"weights ({weights}) are not those saved with the data "
                f"position, and the copy kept with it ({copy}) is missing "
                "or changed. Delete the folder to start over, or restore "
                "it from a copy."
            )
        _copy(copy, weights)
        if position["keras_metadata"] is None:
            if os.path.exists(metadata):
                os.remove(metadata)
        else:
            _write_text(metadata, position["keras_metadata"])
        message = (
            "BackupAndRestore: the last save in "
            f"{self.backup.backup_dir} was interrupted (its weights are not "
            "those saved with the data position). The run resumes from the "
            f"save before it: epoch {position['epoch']}"
            + (
                f" after its batch {position['batch']}."
                if position["batch"] >= 0
                else ", from its first batch."
            )
        )
        warnings.warn(message, stacklevel=2)
        logger.warning(message)

    def on_train_begin(self, logs=None):
        position = self._read_journal()
        weights, _ = _compat.backup_files(self.backup)
        if position is None and not os.path.exists(weights):
            # Marks a fresh run, to tell a cut first save from plain Keras's.
            os.makedirs(self.directory, exist_ok=True)
            _write_json(
                os.path.join(self.directory, _JOURNAL),
                {"epoch": 0, "batch": -1, "iterator": None, "weights": None},
            )
        if position is None or position["iterator"] is None:
            return
        path, batch = position["iterator"], position["batch"]
        stage_state, stage_restored = self._stage_state, self._stage_restored

        def restore(iterator):
            # The stage's state first: the iterator's threads start at once.
            state = stage_state()
            if state:
                tf.train.Checkpoint(**state).read(path).expect_partial()
                if stage_restored is not None:
                    stage_restored(state)
            tf.train.Checkpoint(iterator=iterator).read(path).expect_partial()
            logger.info(
                "BackupAndRestore: epoch %d resumes after its batch %d.",
                position["epoch"],
                batch,
            )

        # Keras still counts the whole epoch's steps.
        steps = (self.params or {}).get("steps")
        left = None if steps is None else max(int(steps) - (batch + 1), 0)
        self._pending = (position["epoch"], restore, left, position)
