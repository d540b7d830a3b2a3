"""What a call's data needs to be staged on the tf.data service."""

import logging
import weakref

import tensorflow as tf

from keras_stage.data.service import DISTRIBUTED_EPOCH

logger = logging.getLogger("keras_stage")

_WARNED_ONE_SPLIT = weakref.WeakSet()


def _warn_one_split(layer, mode):
    """Warns, once per layer, that arrays give the service one split.

    Keras's dataset of arrays starts from `Dataset.range(1)`: in
    `"distributed_epoch"` mode one worker computes the whole epoch.
    """
    if mode != DISTRIBUTED_EPOCH or layer in _WARNED_ONE_SPLIT:
        return
    _WARNED_ONE_SPLIT.add(layer)
    logger.warning(
        "StagedInput '%s': with arrays, Keras's dataset is one tf.data "
        "service split per epoch, so in 'distributed_epoch' mode a single "
        "worker computes each whole epoch. To share an epoch among the "
        "workers, pass a tf.data.Dataset that starts from "
        "from_tensor_slices and shuffles after it, e.g. "
        "tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024).batch(32) "
        "(each worker shuffles its share in a buffer of 1024).",
        layer.name,
    )


def phase_overrides(layer, phase, python_source):
    """How a phase uses the tf.data service `layer` names: the stage
    options it changes.

    `predict` stages in this process (the service's order is the workers');
    evaluation reads each example once whatever the training mode.
    """
    options = layer.stage_options
    if options.service is None:
        return {}
    if phase == "predict":
        logger.info(
            "StagedInput '%s': predict stages in this process, not on the "
            "tf.data service at %s, so that predictions keep the order of "
            "the inputs.",
            layer.name,
            options.service,
        )
        return {"service": None}
    if python_source:
        raise ValueError(
            f"StagedInput '{layer.name}' stages on the tf.data service at "
            f"{options.service}, whose workers cannot run this process's "
            "Python: a generator or keras.utils.PyDataset cannot be sent "
            "there. Pass a tf.data.Dataset (e.g. built with "
            "tf.data.Dataset.from_tensor_slices or list_files) or arrays, "
            "or remove `service` from the StagedInput."
        )
    if phase != "train":
        return {"processing_mode": DISTRIBUTED_EPOCH}
    return {}


def batch_size(adapter, dataset):
    """The batch size to restore after the service, or None if unknown.

    Each service worker batches its own share of an epoch, so the batch
    count varies between epochs, while Keras takes every epoch's count from
    the first: the trainer re-forms full batches (`Dataset.rebatch`).
    """
    size = adapter.batch_size
    if size is None:
        # Without a static batch size, the source's first batch says.
        for element in dataset.take(1):
            size = tf.nest.flatten(element)[0].shape[0]
    return None if size is None else int(size)


def note_data(request, overrides, adapter, dataset, arrays, num_batches):
    """Adds what the service needs of the call's data to `overrides`;
    `arrays`: the `EpochSource`'s arrays, or None."""
    options = request.layer.stage_options
    mode = overrides.get("processing_mode", options.processing_mode)
    # Before `split.number`, whose ordinals a peek would consume.
    overrides["rebatch"] = batch_size(adapter, dataset)
    if arrays is not None:
        if request.steps is None:
            # The examples of one pass, for the epoch's count of lost ones.
            overrides["per_copy"] = int(tf.nest.flatten(arrays[0])[0].shape[0])
        _warn_one_split(request.layer, mode)
    if (
        mode == DISTRIBUTED_EPOCH
        and num_batches is not None
        and not options.ignored_exception_types
    ):
        # Split among the workers, an epoch's batch count is unknown.
        overrides["cardinality"] = num_batches
