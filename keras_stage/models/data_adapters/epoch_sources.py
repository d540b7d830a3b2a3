"""`EpochSource`: one epoch of a call's data, as its input type gives it.

Each input type's adapter (`arrays`, `datasets`, `python_sources`) makes
one; `stage_data` stages it, its epochs on one iterator where
`keras_stage.data.source_passes` allows.
"""


class EpochSource:
    """One epoch of a call's data, from its input type's `epoch_source`.

    Args:
        dataset: One epoch as Keras would iterate it, or its row-index
            batches where `gather` (an `ArrayBatches`) is given.
        arrays: `(x, y, sample_weight)` of in-memory arrays, else None.
        keeps: Whether the model may keep its stage for later calls.
        long_lived: Whether its epochs may run on one iterator.
    """

    def __init__(
        self, dataset, arrays=None, gather=None, keeps=False, long_lived=True
    ):
        self.dataset = dataset
        self.arrays = arrays
        self.gather = gather
        self.keeps = keeps
        self.long_lived = long_lived
