"""The private thread pool of an `"auto"` stage, resized between epochs.

How many threads a stage needs depends on what its computation does, which
is only known once it has run. A stage that waits (reads from remote
storage) needs many more threads than cores, so that many reads wait at
once (the `remote` benchmark). A stage that computes (JPEG decoding) on a
machine whose cores the training step already keeps busy only loses to
extra threads, which take those cores from the step (the `images`
benchmark; `python -m benchmarks.thread_pool` compares pool sizes).

A tf.data pool is fixed when its pipeline is built, so a stage with a
`StagePool` has a pipeline per size (`pipelines`), built when an iterator
first needs it: at `largest` (where it starts) the staged work is
autotuned on a private pool of that size; at any other size it runs that
many elements at once on a private pool of that size. Each eager iterator
(each epoch of a Keras `fit`) is made from the pipeline of the size
current then. `adapt` sets the next epoch's size from the epoch that
ended: `PrefetchCallback` calls it with each training epoch's verdict. A
stage that kept the step waiting while the cores had time to spare (it
waits on IO) grows past `largest`, up to `most`, to the threads its
verdict asks for (as the `remote` benchmark's does with slower reads,
`--remote-latency-ms 80`).

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
    """The resizable private thread pool of one stage.

    Args:
        name: The stage's name (names the variable).
        largest: The size it starts with, and the most `adapt` gives a
            stage unless it waits on IO: the pool `"auto"` sizes from the
            machine (`StageOptions.resolved_pool_size`).
        smallest: The fewest threads `adapt` leaves: the machine's cores,
            what tf.data's shared pool has.
        most: The most threads `adapt` gives a stage that waits on IO
            (`StageOptions.most_pool_size`). Defaults to `largest`.
        start: The size the first iterator's pool gets. Defaults to
            `largest`.
    """

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
        # Read only in Python, when an iterator is made: no graph needs it.
        self._size = int(start)
        # The fewest threads `adapt` gives (see there).
        self._fewest = 1

    @property
    def size(self):
        """Threads the next iterator's pool gets."""
        return self._size

    def resize(self, threads):
        """Gives iterators made from now on a pool of `threads`.

        Iterators already running keep theirs (a tf.data pool is fixed).

        Returns:
            The new size.
        """
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
        """Sizes the next epoch's pool from the epoch that ended.

        An input-bound epoch gets at least `largest` back: a stage that
        keeps the step waiting may be waiting on IO, which more threads
        overlap. If the cores had time to spare in that epoch
        (`cores_busy=False`: the stage waited, it did not compute), it gets
        the threads the verdict asks for, up to `most`; on busy cores more
        threads would only share them. An input-bound epoch never shrinks
        the pool. An epoch that kept up with the step and needed no more
        threads than `smallest` (`needed_threads`, the verdict's
        `suggested_num_threads`: per-batch staged time over training time,
        with headroom) gets the threads it needs: more could only contend
        for the cores the step uses. Never fewer than a size that once kept
        the step waiting, plus one. Any other epoch leaves the size as it
        is. Shrinking to an in-between size is what a stage that waits on
        IO must not get: its threads cost no CPU, and the suggestion moves
        with every epoch's step time (on the `remote` benchmark it ranged
        over 7-14, and pools sized from it kept the step waiting). With
        `shrink=False` the pool only grows: an epoch that kept up leaves
        it as it is.

        Args:
            input_bound: Whether the epoch kept the step waiting.
            needed_threads: The verdict's `suggested_num_threads`.
            cores_busy: Whether the process kept the machine's cores busy
                over the epoch. Defaults to True (no growth past
                `largest`).
            shrink: Whether an epoch that kept up may shrink the pool.
                Defaults to True.

        Returns:
            The new size.
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
        """The stage's pipelines, each iterator's on a pool of the size then.

        A tf.data pool is fixed when its pipeline is built, so the stage
        has one pipeline per size, built the first time an iterator needs
        it: `build(size)` returns the `(lean, measured)` pipelines on a
        pool of `size`. The datasets returned make their eager iterators
        (a Keras epoch's, a loop's `iter`) from the pipeline of the size
        current then. Used as a dataset otherwise (transformed further,
        iterated inside a `tf.function`, distributed by a strategy), each
        is the pipeline of the size current when the stage was built.

        Args:
            build: `build(size)` -> `(lean, measured)`.

        Returns:
            `(lean, measured)`, resized per iterator.
        """
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
    """A stage pipeline whose eager iterators run on the pool's current size.

    A dataset of its own (not a wrapper op): the earlier design, a
    one-element `flat_map` that picked the pipeline per iterator, put one
    more op on every element's path and cost the `images` benchmark as
    much as an oversized pool (see docs/engine.md, the adaptive pool).
    """

    def __init__(self, base, pipeline, which, pool):
        self._pipeline = pipeline
        self._which = which
        self._pool = pool
        super().__init__(base)

    def eager_iter(self):
        return iter(self._pipeline(self._pool.size, self._which))
