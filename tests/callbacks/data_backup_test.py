"""Tests for keras_stage/callbacks/data_backup.py, the callback on its own.

`DataBackup` saves the training data's position (a checkpoint of the
iterator the step read last, and a journal naming it) on the schedule of
its `BackupAndRestore`, and on the next run restores that position before
the resumed epoch's first step. Here its hooks are called by hand on
plain tf.data iterators; a real run killed mid-epoch and resumed is
tests/reliability/resume_test.py's.
"""

import copy
import json
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_stage.callbacks.data_backup import (
    SUBDIR,
    DataBackup,
    TornBackupError,
)

pytestmark = pytest.mark.timeout(60)


class _Run:
    """One training run's DataBackup, over one iterator of `range(20)`."""

    def __init__(self, folder, save_freq=2, iterator=True, ordered=True):
        self.backup = keras.callbacks.BackupAndRestore(
            str(folder), save_freq=save_freq
        )
        self.iterator = iter(tf.data.Dataset.range(20)) if iterator else None
        self.restores = []
        self.steps_left = []
        self.epochs = []
        self.callback = DataBackup(
            self.backup,
            lambda: self.iterator,
            self._restore_next,
            ordered=ordered,
        )

    def _restore_next(self, restore, left, epoch):
        self.restores.append(restore)
        self.steps_left.append(left)
        self.epochs.append(epoch)

    def train(self, epoch, batches):
        """The hooks of `batches` steps of `epoch`, each reading one element."""
        self.callback.on_epoch_begin(epoch)
        for batch in range(batches):
            next(self.iterator)
            self.callback.on_train_batch_end(batch)


def _resumed(folder, steps, epochs):
    """The next run's `_Run` (save_freq 2), resumed into its epoch 0.

    Keras gives the callbacks the epoch's step count, then begins the run
    (restored weights) and the epoch.
    """
    run = _Run(folder, save_freq=2)
    run.callback.set_params({"steps": steps, "epochs": epochs})
    run.callback.on_train_begin()
    run.callback.on_epoch_begin(0)
    return run


def _journal(folder):
    with open(os.path.join(folder, SUBDIR, "position.json")) as f:
        return json.load(f)


def _checkpoints(folder):
    names = os.listdir(os.path.join(folder, SUBDIR))
    return sorted({n.split(".")[0] for n in names if n.startswith("iterator-")})


def test_it_follows_its_backup_and_restore(tmp_path):
    run = _Run(tmp_path, save_freq=7, iterator=False)
    assert run.callback.save_freq == 7
    assert run.callback.directory == os.path.join(str(tmp_path), SUBDIR)
    assert run.callback.backup is run.backup


def test_it_saves_every_save_freq_batches_counted_across_epochs(tmp_path):
    run = _Run(tmp_path, save_freq=2)
    run.train(0, 3)  # saved after batch 1
    assert _journal(tmp_path)["batch"] == 1
    run.callback.on_epoch_end(0)
    run.train(1, 1)  # batch 2 of 0 and batch 0 of 1: saved again
    position = _journal(tmp_path)
    assert (position["epoch"], position["batch"]) == (1, 0)
    assert position["iterator"].startswith(
        os.path.join(str(tmp_path), SUBDIR, "iterator-2")
    )


def test_it_keeps_the_last_two_iterator_checkpoints(tmp_path):
    run = _Run(tmp_path, save_freq=1)
    run.train(0, 5)
    assert _checkpoints(tmp_path) == ["iterator-4", "iterator-5"]


def test_a_run_resumes_after_the_last_saved_batch(tmp_path):
    first = _Run(tmp_path, save_freq=2)
    first.train(0, 4)  # saved after its 4th element: 0..3 were read
    next(first.iterator)  # read after the save: lost with the kill

    second = _Run(tmp_path, save_freq=2)
    second.callback.on_train_begin()
    assert second.restores == []  # not before the resumed epoch begins
    second.callback.on_epoch_begin(0)
    assert len(second.restores) == 1
    second.restores[0](second.iterator)
    assert int(next(second.iterator)) == 4


def test_the_restore_says_how_many_of_the_epoch_s_steps_are_left(tmp_path):
    # Keras counts the resumed epoch's steps whole; the restored iterator
    # holds those after the saved batch only.
    first = _Run(tmp_path, save_freq=2)
    first.train(0, 4)  # saved after batch 3
    second = _resumed(tmp_path, 10, 2)
    assert second.steps_left == [6]
    unknown = _resumed(tmp_path, None, 2)  # a dataset of unknown length
    assert unknown.steps_left == [None]


def _saved_in_epoch_1(folder):
    first = _Run(folder, save_freq=2)
    first.train(0, 1)
    first.callback.on_epoch_end(0)
    first.train(1, 1)  # saved in epoch 1
    second = _Run(folder, save_freq=2)
    second.callback.on_train_begin()
    return second


def test_the_restore_runs_once_when_the_saved_epoch_begins(tmp_path):
    run = _saved_in_epoch_1(tmp_path)
    run.callback.on_epoch_begin(1)
    assert len(run.restores) == 1 and run.epochs == [1]
    run.callback.on_epoch_begin(2)
    assert len(run.restores) == 1


def test_a_run_that_resumes_another_epoch_restores_nothing(tmp_path):
    # BackupAndRestore resumes the epoch of its own last save: a journal
    # from another epoch is not that save's position.
    run = _saved_in_epoch_1(tmp_path)
    run.callback.on_epoch_begin(0)
    run.callback.on_epoch_begin(1)
    assert run.restores == []


def test_with_epoch_saves_the_next_epoch_starts_from_its_first_batch(
    tmp_path,
):
    run = _Run(tmp_path, save_freq="epoch")
    run.train(0, 5)
    assert not os.path.exists(os.path.join(tmp_path, SUBDIR))  # no batch save
    run.callback.on_epoch_end(0)
    assert _journal(tmp_path) == {
        "epoch": 1,
        "batch": -1,
        "iterator": None,
        "weights": None,  # no Keras files here
    }
    resumed = _Run(tmp_path, save_freq="epoch")
    resumed.callback.on_train_begin()
    resumed.callback.on_epoch_begin(1)
    assert resumed.restores == []


def test_a_fresh_run_restores_nothing(tmp_path):
    run = _Run(tmp_path)
    run.callback.on_train_begin()
    run.callback.on_epoch_begin(0)
    assert run.restores == []


def test_without_an_iterator_the_journal_names_none(tmp_path):
    run = _Run(tmp_path, save_freq=1, iterator=False)
    run.callback.on_epoch_begin(0)
    run.callback.on_train_batch_end(0)
    assert _journal(tmp_path) == {
        "epoch": 0,
        "batch": 0,
        "iterator": None,
        "metrics": [],  # no model: no metrics
        "seeds": [],  # nor seed generators
        "weights": None,  # no Keras files here
    }
    assert _checkpoints(tmp_path) == []


def test_an_iterator_tf_data_cannot_save_warns_once(tmp_path, caplog):
    def numbers():
        yield from range(20)

    run = _Run(tmp_path, save_freq=1)
    run.iterator = iter(
        tf.data.Dataset.from_generator(
            numbers, output_signature=tf.TensorSpec((), tf.int64)
        )
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(0, 3)
    ours = [w for w in caught if "position cannot be" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is UserWarning
    message = str(ours[0].message)
    assert "use a tf.data source" in message
    assert "TensorFlow said: " in message
    assert _journal(tmp_path)["iterator"] is None
    assert "position cannot be saved" in caplog.text  # logged too


def test_it_can_be_deep_copied_before_training(tmp_path):
    # keras-tuner deep-copies callbacks: nothing uncopyable is made early.
    run = _Run(tmp_path, iterator=False)
    clone = copy.deepcopy(run.callback)
    assert clone.directory == run.callback.directory
    assert clone.save_freq == 2


def test_the_resumed_epoch_s_metrics_continue_from_the_saved_values(tmp_path):
    # Keras resets the metrics as each epoch begins; the resumed epoch's
    # History entry must still average the whole epoch.
    def model():
        inputs = keras.Input((1,))
        built = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        built.compile("sgd", "mse", metrics=["mae"])
        built.fit(tf.ones((4, 1)), tf.ones((4, 1)), verbose=0)  # builds
        return built

    first = _Run(tmp_path, save_freq=2)
    first.callback.set_model(model())
    variables = first.callback._metric_variables()
    assert len(variables) >= 3  # the loss's total and count, mae's
    for i, variable in enumerate(variables):
        variable.assign(np.full(variable.shape, i + 0.5, variable.dtype))
    first.train(0, 2)  # saved after batch 1, with those values
    second = _Run(tmp_path, save_freq=2)
    second.callback.set_model(model())
    second.callback.on_train_begin()
    for variable in second.callback._metric_variables():
        variable.assign(np.zeros(variable.shape, variable.dtype))  # reset
    second.callback.on_epoch_begin(0)
    restored = [np.asarray(v) for v in second.callback._metric_variables()]
    assert [float(v) for v in restored] == [
        i + 0.5 for i in range(len(restored))
    ]


def _compiled_model(metrics=("mae",), dropout=False):
    inputs = keras.Input((1,))
    x = keras.layers.Dropout(0.5, seed=1)(inputs) if dropout else inputs
    built = keras.Model(inputs, keras.layers.Dense(1)(x))
    built.compile("sgd", "mse", metrics=list(metrics))
    built.fit(tf.ones((4, 1)), tf.ones((4, 1)), verbose=0)  # builds
    return built


def test_a_resumed_epoch_with_no_step_left_logs_its_restored_metrics(
    tmp_path,
):
    # Saved after the epoch's last batch: the resumed epoch runs no step,
    # and Keras's epoch logs hold the validation's only.
    first = _Run(tmp_path, save_freq=2)
    first.callback.set_model(_compiled_model())
    for variable in first.callback._metric_variables():
        variable.assign(np.full(variable.shape, 2.0, variable.dtype))
    first.train(0, 2)  # saved after batch 1: mean loss 2 / 2 = 1
    second = _Run(tmp_path, save_freq=2)
    second.callback.set_model(_compiled_model())
    second.callback.on_train_begin()
    second.callback.on_epoch_begin(0)
    second.callback.on_test_begin()  # validation reuses the metrics...
    for variable in second.callback._metric_variables():
        variable.assign(np.zeros(variable.shape, variable.dtype))
    logs = {"val_loss": 0.5}
    second.callback.on_epoch_end(0, logs)
    assert logs == {"val_loss": 0.5, "loss": 1.0, "mae": 1.0}
    # An epoch that stepped keeps Keras's logs as they are.
    second.callback.on_epoch_begin(1)
    second.callback.on_train_batch_end(0)
    logs = {"loss": 3.0}
    second.callback.on_epoch_end(1, logs)
    assert logs == {"loss": 3.0}


def test_the_trunk_s_seed_generators_resume_where_they_were(tmp_path):
    # Keras's weights file leaves the seed generators out; Dropout draws
    # from its state at every step.
    first = _Run(tmp_path, save_freq=2)
    first.callback.set_model(_compiled_model(dropout=True))
    seeds = first.callback._seed_variables()
    assert seeds
    for variable in seeds:
        variable.assign(np.array([7, 11], variable.dtype))
    first.train(0, 2)
    second = _Run(tmp_path, save_freq=2)
    second.callback.set_model(_compiled_model(dropout=True))
    second.callback.on_train_begin()
    second.callback.on_epoch_begin(0)
    for variable in second.callback._seed_variables():
        assert np.asarray(variable).tolist() == [7, 11]


def test_the_metrics_are_built_before_they_get_their_saved_values(tmp_path):
    # Without a strategy Keras builds its compile metrics as it traces the
    # first step: a resumed epoch asks for them to be built first.
    first = _Run(tmp_path, save_freq=2)
    first.train(0, 2)
    calls = []
    second = _Run(tmp_path, save_freq=2)
    second.callback = DataBackup(
        second.backup,
        lambda: second.iterator,
        second._restore_next,
        lambda: calls.append("build"),
    )
    second.callback.on_train_begin()
    assert calls == []
    second.callback.on_epoch_begin(0)
    assert calls == ["build"] and len(second.restores) == 1


def _keras_save(folder, weights, batch):
    """What BackupAndRestore writes in place (epoch 0), before DataBackup."""
    with open(os.path.join(folder, "latest.weights.h5"), "wb") as f:
        f.write(weights)
    with open(os.path.join(folder, "training_metadata.json"), "w") as f:
        json.dump({"epoch": 0, "batch": batch}, f)


def _files(folder):
    with open(os.path.join(folder, "latest.weights.h5"), "rb") as f:
        weights = f.read()
    with open(os.path.join(folder, "training_metadata.json")) as f:
        return weights, f.read()


WEIGHTS = [bytes([i]) * 5000 for i in range(3)]


def _saved_twice(folder):
    """A run saved after batches 0 and 1 (Keras's files, then ours)."""
    run = _Run(folder, save_freq=1)
    run.callback.on_epoch_begin(0)
    for batch in range(2):
        next(run.iterator)
        _keras_save(folder, WEIGHTS[batch], batch)
        run.callback.on_train_batch_end(batch)
    return run


def test_each_position_keeps_a_copy_of_the_keras_save_it_goes_with(tmp_path):
    _saved_twice(tmp_path)
    position = _journal(tmp_path)
    with open(tmp_path / SUBDIR / position["weights"], "rb") as f:
        assert f.read() == WEIGHTS[1]
    assert json.loads(position["keras_metadata"]) == {"epoch": 0, "batch": 1}
    # Two names in turn: the journal's copy is never the one rewritten.
    with open(tmp_path / SUBDIR / "weights-a.h5", "rb") as f:
        assert f.read() == WEIGHTS[0]
    assert position["weights"] == "weights-b.h5"


def test_recover_leaves_a_whole_save_as_it_is(tmp_path):
    run = _saved_twice(tmp_path)
    before = _files(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.callback.recover()
    assert _files(tmp_path) == before


def _torn_weights(folder):
    # Killed while Keras wrote the weights of batch 2.
    _keras_save(folder, WEIGHTS[2][:1234], 1)


def _weights_ahead(folder):
    # Killed after Keras's write of batch 2, before DataBackup's.
    _keras_save(folder, WEIGHTS[2], 2)


def _torn_metadata(folder):
    # Killed while Keras wrote the metadata of batch 2.
    _keras_save(folder, WEIGHTS[2], 2)
    open(os.path.join(folder, "training_metadata.json"), "w").close()


def _metadata_missing(folder):
    # The same in a first save's metadata write.
    _keras_save(folder, WEIGHTS[2], 2)
    os.remove(os.path.join(folder, "training_metadata.json"))


@pytest.mark.parametrize(
    "interrupt",
    [_torn_weights, _weights_ahead, _torn_metadata, _metadata_missing],
)
def test_recover_goes_back_to_the_last_whole_save(tmp_path, interrupt):
    run = _saved_twice(tmp_path)
    next(run.iterator)  # batch 2 trained, then the kill during its save
    interrupt(tmp_path)

    resumed = _Run(tmp_path, save_freq=1)
    with pytest.warns(UserWarning, match="was interrupted") as caught:
        resumed.callback.recover()
    assert "epoch 0 after its batch 1" in str(caught[0].message)
    weights, metadata = _files(tmp_path)
    assert weights == WEIGHTS[1]
    assert json.loads(metadata) == {"epoch": 0, "batch": 1}
    # The data position is the same save's: batch 2 is read again.
    resumed.callback.on_train_begin()
    resumed.callback.on_epoch_begin(0)
    resumed.restores[0](resumed.iterator)
    assert int(next(resumed.iterator)) == 2


def test_a_backup_with_no_whole_save_is_an_error_naming_it(tmp_path):
    run = _saved_twice(tmp_path)
    _torn_weights(tmp_path)
    with open(tmp_path / SUBDIR / _journal(tmp_path)["weights"], "wb") as f:
        f.write(b"changed")
    with pytest.raises(TornBackupError, match="is torn") as raised:
        run.callback.recover()
    assert str(tmp_path) in str(raised.value)
    assert "Delete the folder" in str(raised.value)


def test_an_unreadable_journal_is_an_error_naming_it(tmp_path):
    run = _saved_twice(tmp_path)
    with open(tmp_path / SUBDIR / "position.json", "w") as f:
        f.write('{"epoch": 0, "ba')
    with pytest.raises(TornBackupError, match="position.json"):
        run.callback.recover()


def test_an_unordered_stage_warns_once_that_its_resume_differs(tmp_path):
    run = _Run(tmp_path, save_freq=1, ordered=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(0, 3)
    ours = [w for w in caught if "deterministic=False" in str(w.message)]
    assert len(ours) == 1
    assert "Set deterministic=True" in str(ours[0].message)
    assert _journal(tmp_path)["iterator"]  # the position is still saved
    ordered = _Run(tmp_path / "ordered", save_freq=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ordered.train(0, 3)


def test_a_second_resume_in_the_same_epoch_continues_where_the_first_saved(
    tmp_path,
):
    # Keras numbers a resumed epoch's batches from 0 again: the journal
    # keeps the epoch's own batch numbers.
    first = _Run(tmp_path, save_freq=2)
    first.train(0, 4)  # saved after batch 3
    second = _resumed(tmp_path, 10, 1)
    second.restores[0](second.iterator)
    for batch in range(2):  # Keras's batches 0 and 1: the epoch's 4 and 5
        next(second.iterator)
        second.callback.on_train_batch_end(batch)
    assert _journal(tmp_path)["batch"] == 5
    third = _resumed(tmp_path, 10, 1)
    assert third.steps_left == [4]
    third.restores[0](third.iterator)
    assert int(next(third.iterator)) == 6


def test_keras_s_metadata_names_the_epoch_the_save_was_made_in(tmp_path):
    # Keras 3.15 writes epoch 0 in the saves of a run resumed into a later
    # epoch until that epoch ends: killed again, it would go back to 0.
    run = _Run(tmp_path, save_freq=1)
    run.callback.on_epoch_begin(2)
    next(run.iterator)
    _keras_save(tmp_path, WEIGHTS[0], 0)  # {"epoch": 0, "batch": 0}
    run.callback.on_train_batch_end(0)
    _, metadata = _files(tmp_path)
    assert json.loads(metadata) == {"epoch": 2, "batch": 0}
    assert _journal(tmp_path)["keras_metadata"] == metadata
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _Run(tmp_path, save_freq=1).callback.recover()  # whole as it is


def test_a_first_save_cut_before_its_position_starts_the_run_again(tmp_path):
    run = _Run(tmp_path, save_freq=1)
    run.callback.on_train_begin()  # a fresh run: the folder says so
    _keras_save(tmp_path, WEIGHTS[0], 0)  # killed before DataBackup's save
    resumed = _Run(tmp_path, save_freq=1)
    with pytest.warns(UserWarning, match="first save .* was interrupted"):
        resumed.callback.recover()
    assert not os.path.exists(tmp_path / "latest.weights.h5")
    assert not os.path.exists(tmp_path / "training_metadata.json")


def test_a_plain_keras_backup_is_left_as_keras_wrote_it(tmp_path):
    # Keras's files and no journal: resumed as Keras resumes it.
    with open(tmp_path / "latest.weights.h5", "wb") as f:
        f.write(WEIGHTS[0])
    with open(tmp_path / "training_metadata.json", "w") as f:
        json.dump({"epoch": 3, "batch": 0}, f)
    run = _Run(tmp_path, save_freq=1)
    run.callback.recover()
    run.callback.on_train_begin()
    assert _files(tmp_path) == (WEIGHTS[0], '{"epoch": 3, "batch": 0}')
    assert not os.path.exists(tmp_path / SUBDIR / "position.json")
