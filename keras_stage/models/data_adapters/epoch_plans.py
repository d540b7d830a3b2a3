"""Whether a call's epochs run on one iterator, and how (`plan`).

Keras makes an iterator of its dataset every epoch; a stage over that
iterator would be built, filled and drained each epoch. Where it keeps plain
Keras's batches and orders, the stage runs all the call's epochs (or every
call's, when kept across calls) on one iterator of a source spanning them
(`LongLivedEpochs`); otherwise the refusal says why not.
"""

import functools

import keras
import tensorflow as tf

from keras_stage.data import source_passes
from keras_stage.data.epochs import FedSource, LongLivedEpochs
from keras_stage.data.stats import op_determinism_enabled
from keras_stage.models.backends.tensorflow import default_strategy
from keras_stage.models.iterators.kept_iterators import switched_data

_SHARED_DRAWS = (
    "the call also reads another dataset built on the same datasets (their "
    "draws must keep their order)"
)


def strategy_refusal(strategy, dataset=None):
    """Why Keras's iterators under `strategy` cannot be views of one.

    None under the default strategy, and under several replicas unless
    `dataset` (the stage's source, if known) draws from a seed per iterator
    (Keras's peek at each call's start would take a draw).
    """
    if default_strategy(strategy):
        return None
    if strategy.num_replicas_in_sync < 2:
        return (
            "Keras distributes the data with a tf.distribute strategy of one "
            "replica"
        )
    if not isinstance(dataset, tf.data.Dataset):
        return None
    facts = source_passes.inspect_source(dataset)
    if facts.iterator_draws and not facts.free_passes:
        return (
            "under a tf.distribute strategy Keras makes one more iterator a "
            "call, which takes one of the dataset's seeded draws (its "
            "shuffle's orders follow the iterators made)"
        )
    return None


def epochs_refusal(
    layer,
    phase,
    num_batches,
    steps,
    epochs,
    steps_per_execution,
    served,
    spans_calls=False,
    strategy=None,
    dataset=None,
):
    """Why Keras's reads of the call's epochs cannot share one iterator.

    None when Keras reads exactly `num_batches` batches from each iterator,
    in whole calls of the compiled step, and `strategy` lets them be views
    of one (`strategy_refusal`, on `dataset`). `spans_calls`: whether the
    iterator may outlive the call (then one epoch is enough).
    """
    options = layer.stage_options
    if epochs < 2 and not spans_calls:
        return "the call reads one epoch"
    if phase == "predict" and not spans_calls:
        return "predict reads one epoch"
    if num_batches is None:
        return "the batch count of an epoch is not known"
    if served:
        return "the stage runs on the tf.data service"
    if options.ignored_exception_types:
        return "the stage can skip batches (ignored_exception_types)"
    if tuple(options.closed_exception_types) != (tf.errors.OutOfRangeError,):
        return "an error can end an epoch early (closed_exception_types)"
    if keras.config.max_steps_per_epoch():
        return "keras.config.max_steps_per_epoch caps the epochs"
    if num_batches % steps_per_execution:
        return (
            f"steps_per_execution={steps_per_execution} does not divide the "
            f"{num_batches} batches of an epoch"
        )
    if phase != "train" and steps is not None and steps < num_batches:
        return "each evaluation reads only part of the data (steps)"
    return strategy_refusal(strategy, dataset)


def plan(request, epoch, dataset, num_batches, spans_calls):
    """`(LongLivedEpochs, None)` for the call's epochs, or `(None, why not)`;
    `epoch`: its `EpochSource`, `dataset` one epoch of it, `spans_calls` as
    for `epochs_refusal`."""
    r = request
    refusal = epochs_refusal(
        r.layer,
        r.phase,
        num_batches,
        r.steps,
        int(r.epochs),
        int(r.steps_per_execution),
        r.served,
        spans_calls=spans_calls,
        strategy=r.strategy,
        dataset=dataset,
    )
    # A resized pool runs only in a new iterator, and a drawing dataset's
    # epochs cannot start one at any epoch: its first epoch reads an
    # iterator of its own and the rest one more, on the pool sized after
    # it. Only a training stage's pool is resized.
    first_alone = (
        refusal is None
        and r.phase == "train"
        and r.split is not None
        and r.layer.stage_options.adaptive_pool
        and epoch.arrays is None
        and _draws_per_iterator(dataset, spans_calls)
    )
    if first_alone and op_determinism_enabled():
        refusal = (
            "the stage's adaptive pool is resized between epochs, and "
            "under op determinism this dataset's epochs cannot move to "
            "a new pool mid-call (it draws from a seed generator per "
            "iterator)"
        )
    if refusal is not None:
        return None, refusal
    # Fed across calls (`FedSource`) once a call of the role came on another
    # dataset object, and a fit's validation from its first call; not a
    # numbered split (its count runs per pipeline), nor under op
    # determinism (a stateful dequeue would make tf.data run the pipeline
    # one element at a time).
    feeds = (
        spans_calls
        and r.feedable
        and (r.role == "val" or switched_data(r.kept, r.role, r.x))
        and not r.served
        and not r.distributed
        and not (r.split is not None and r.split.numbers(r.phase == "train"))
        and not op_determinism_enabled()
    )
    return _long_lived_epochs(
        r, epoch, dataset, num_batches, spans_calls, first_alone, feeds
    )


def _draws_per_iterator(dataset, spans_calls):
    """Whether a new iterator of `dataset` cannot start at any epoch."""
    facts = source_passes.inspect_source(dataset)
    return facts.iterator_draws and not (spans_calls and facts.free_passes)


def _long_lived_epochs(
    request, epoch, dataset, num_batches, spans_calls, first_alone, fed
):
    """`plan`'s answer for a stage that passed its refusals. `first_alone`:
    whether the first epoch reads an iterator of its own (a drawing dataset
    on an adaptive pool); `fed`: whether the source is fed each call's
    passes (`FedSource`)."""
    if not epoch.long_lived:
        return None, "the data is not in-memory arrays or a tf.data.Dataset"
    arrays = epoch.arrays
    epochs = int(request.epochs)
    steps_per_execution = int(request.steps_per_execution)
    facts = source_passes.inspect_source(dataset)
    if facts.refusal is not None:
        return None, f"its source cannot be read ahead: {facts.refusal}"
    if spans_calls and fed and not facts.kernel_seeded:
        return _fed_epochs(request, dataset, facts, num_batches)
    if spans_calls and facts.free_passes:
        # Any pass stands for a fresh iterator's.
        return LongLivedEpochs(
            None,
            num_batches,
            steps_per_execution,
            None,
            functools.partial(source_passes.long_lived_source, dataset, None),
        ), None
    if epochs < 2:
        return None, "the call reads one epoch"
    replay = False
    if facts.kernel_seeded:
        if arrays is None:
            return None, (
                "its source has a seeded stateful random op, which draws "
                "the same in every new iterator"
            )
        size = source_passes.nbytes(arrays)
        if size is None or size > source_passes.REPLAY_LIMIT_BYTES:
            return None, (
                "a seeded shuffle of arrays replays its first epoch, kept in "
                f"memory, and these arrays are over "
                f"{source_passes.REPLAY_LIMIT_BYTES // 2**20} MiB"
            )
        replay = True
    if arrays is None and _shares_a_dataset(facts, request.alongside):
        return None, _SHARED_DRAWS
    start = stop = None
    independent = arrays is not None or not facts.iterator_draws
    # Epochs that depend on no earlier iterator: one can start at any. Not
    # under op determinism: a variable read in the pipeline would make
    # tf.data run all of it one element at a time.
    starts_anywhere = independent and not op_determinism_enabled()
    if starts_anywhere or first_alone:
        with tf.init_scope(), tf.device("/CPU:0"):
            start = tf.Variable(0, dtype=tf.int64, trainable=False)
            if not starts_anywhere:
                stop = tf.Variable(1, dtype=tf.int64, trainable=False)
    opens = request.backend.unread_opens
    if independent or (request.phase == "train" and request.steps):
        opens = 0
    source = functools.partial(
        source_passes.long_lived_source,
        dataset,
        epochs,
        replay=replay,
        opens=opens,
        start=start,
        stop=stop,
    )
    return LongLivedEpochs(
        epochs,
        num_batches,
        steps_per_execution,
        start,
        source,
        stop=stop,
        opens=opens,
    ), None


def _shares_a_dataset(facts, alongside):
    """Whether `facts`' source shares a dataset with one of `alongside`."""
    return any(
        isinstance(other, tf.data.Dataset)
        and facts.objects & source_passes.inspect_source(other).objects
        for other in alongside
    )


def _fed_epochs(request, dataset, facts, num_batches):
    """`_long_lived_epochs`'s plan of a `FedSource`."""
    opens = 0
    if not facts.free_passes:
        if _shares_a_dataset(facts, request.alongside):
            return None, _SHARED_DRAWS
        opens = request.backend.unread_opens  # spans_calls: no steps

    def fed_source():
        fed.fed = FedSource(dataset.element_spec, dataset.options())
        return fed.fed.dataset

    fed = LongLivedEpochs(
        None,
        num_batches,
        int(request.steps_per_execution),
        None,
        fed_source,
        opens=opens,
        feeds=True,
    )
    return fed, None
