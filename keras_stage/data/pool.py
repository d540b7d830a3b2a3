"""The private thread pool of an `"auto"` stage, resized between epochs.

A stage waiting on IO needs more threads than cores; one computing on busy
cores loses to extra threads. A tf.data pool is fixed when its pipeline is
built, so a `StagePool` keeps a pipeline per size for eager iterators, and
`PrefetchCallback` calls `adapt` to size the next epoch's from the last.

Example:

>>> import tensorflow as tf
>>> from keras_stage.data import stage
>>> staged = stage(tf.data.Dataset.range(4), lambda x: x * 2)
>>> pool = staged.thread_pool
>>> pool.resize(3)
3
>>> [int(x) for x in staged]
[0, 2, 4, 6]
>>> staged.close()
True
"""

from keras_stage.data.eager_iterated import EagerIterated


class StagePool:
    """The resizable private thread pool of stage `name`: `adapt` keeps it
    between `smallest` (the cores) and `largest`, or up to `most` (default
    `largest`) for a stage waiting on IO. The first iterator gets `start`
    (default `largest`)."""

    def __init__(self, name, largest, smallest, most=None, start=None):
        most = largest if most is None else most
        start = largest if start is None else start
        if not 1 <= smallest <= largest <= most:
            raise ValueError(
                f"Invalid pool bounds for stage '{name}': expected "
                f"1 <= smallest <= largest <= most. Received: "
                f"smallest={smallest}, largest={largest}, most={most}"
            )
        if not 1 <= start <= most:
            raise ValueError(
                f"Invalid starting pool size for stage '{name}': expected 1 "
                f"to {most}. Received: start={start}"
            )
        self.name = name
        self.largest = int(largest)
        self.smallest = int(smallest)
        self.most = int(most)
        self._size = int(start)
        self._fewest = 1  # the fewest threads `adapt` gives

    @property
    def size(self):
        """Threads the next iterator's pool gets."""
        return self._size

    def resize(self, threads):
        """Gives iterators made from now on a pool of `threads`; returns it
        (running ones keep theirs: a tf.data pool is fixed)."""
        if isinstance(threads, bool) or not isinstance(threads, int):
            raise TypeError(
                f"Invalid pool size for stage '{self.name}': expected a "
                f"positive int. Received: threads={threads!r}"
            )
        if not 1 <= threads <= self.most:
            raise ValueError(
                f"Invalid pool size for stage '{self.name}': expected 1 to "
                f"{self.most} (for more, build the stage with "
                f"thread_pool_size, a fixed pool). Received: "
                f"threads={threads}"
            )
        self._size = threads
        return threads

    def adapt(self, input_bound, needed_threads, cores_busy=True, shrink=True):
        """Sizes the next epoch's pool from the verdict of the last; returns it.

        An `input_bound` epoch gets at least `largest` back, and unless
        `cores_busy` the `needed_threads`, up to `most`. With `shrink`, an
        epoch that kept up needing no more than `smallest` threads gets what
        it needs, never a size that once kept the step waiting. Any other
        epoch keeps the size.
        """
        if input_bound:
            if self.size < self.largest:
                # Too few: never shrink to this size again.
                self._fewest = max(self._fewest, self.size + 1)
            wanted = self.largest if cores_busy else int(needed_threads)
            threads = min(self.most, max(self.size, self.largest, wanted))
        elif shrink and int(needed_threads) <= self.smallest:
            wanted = max(1, int(needed_threads), self._fewest)
            threads = min(self.smallest, wanted)
        else:
            threads = self.size
        return self.resize(threads)

    def pipelines(self, build):
        """`(lean, measured)` from `build(size)`, eager iterators on a pool of
        the size then (used as a dataset otherwise: the size when built)."""
        built = {}

        def pipeline(size, which):
            if size not in built:
                built[size] = build(size)
            return built[size][which]

        size = self.size
        return tuple(
            _Resized(pipeline(size, which), pipeline, which, self)
            for which in range(2)
        )


class _Resized(EagerIterated):
    """A stage pipeline whose eager iterators run on the pool's current size
    (not a wrapper op, which would sit on every element's path)."""

    def __init__(self, base, pipeline, which, pool):
        self._pipeline = pipeline
        self._which = which
        self._pool = pool
        super().__init__(base)

    def eager_iter(self):
        return iter(self._pipeline(self._pool.size, self._which))
