"""A stage's figures read on the host from tf.data's own model of its iterator.

`tf.data.experimental.get_model_proto` (TF 2.17+) reads the autotuner's model
of an iterator between steps with no op in the pipeline, for op determinism
(`StageStats.count_nothing`). The wait is the consumer's time not spent
between fetches; the busy time, the staged map's processing time.
"""

import collections
import statistics
import time
import weakref

import tensorflow as tf

# tf.data's reader of an iterator's model; TensorFlow 2.16 has none.
_get_model_proto = getattr(tf.data.experimental, "get_model_proto", None)
AVAILABLE = _get_model_proto is not None

# The fetch gaps tf.data keeps (`Model::RecordIteratorGapTime`).
GAP_WINDOW = 100
# How many fetches apart a consumer samples, at most (within the window).
SAMPLE_FETCHES = 10
# The recent samples of a ready buffer whose fetch time is the baseline.
READY_SAMPLES = 20

# The node of the stage's buffer (`Dataset.prefetch`), and those of a map.
_BUFFER = "Prefetch"
_MAPS = ("ParallelMapV2", "ParallelMap", "Map", "MapDataset")


def read_model(iterator):
    """tf.data's model of `iterator` (a `ModelProto`), or None."""
    if not AVAILABLE:
        return None
    try:
        model = _get_model_proto(iterator)
    except (tf.errors.OpError, TypeError, ValueError):
        return None
    return model if model.nodes else None


def _chain(model):
    """The model's nodes from the consumer's end, first inputs down."""
    nodes, key = [], model.output
    while key in model.nodes and len(nodes) < 64:
        node = model.nodes[key]
        nodes.append(node)
        if not node.inputs:
            break
        key = node.inputs[0]
    return nodes


def stage_nodes(model, maps_above):
    """The stage's buffer node (the first `Prefetch` from the consumer's
    end) and its map's, `maps_above` maps below it (None: not found)."""
    chain = _chain(model)
    for i, node in enumerate(chain):
        if node.name == _BUFFER:
            below = chain[i + 1 :]
            if len(below) > maps_above and all(
                n.name in _MAPS for n in below[: maps_above + 1]
            ):
                return node, below[maps_above]
            return node, None
    return None, None


class PipelineModel:
    """Running totals of a stage's figures, sampled from tf.data's model
    (`maps_above`: maps between the stage's buffer and its own map; None:
    the stage has no map, so its busy time is 0)."""

    def __init__(self, maps_above=0):
        self.maps_above = maps_above
        self._iterator = None  # a weak reference: never keep it running
        self._last = None  # (fetches, map ns, held) at the last sample
        self._sampled = None  # when the last sample ran
        self._tail = 0.0  # from the last fetch to the last sample, estimated
        # Per-fetch time outside the gaps of recent samples (`_add_wait`).
        self._ready = collections.deque(maxlen=READY_SAMPLES)
        self._fetching = collections.deque(maxlen=READY_SAMPLES)
        self.fetches = 0
        self.gap_seconds = 0.0
        self.wait_seconds = 0.0
        self.busy_seconds = 0.0
        self.buffered_sum = 0.0
        self.buffered_peak = 0
        self.measures = AVAILABLE  # False once no model of the stage is found

    def watch(self, iterator):
        """Samples `iterator` from now on (the consumer's newest)."""
        self.sample(boundary=True)  # what the one it replaces fetched
        try:
            self._iterator = weakref.ref(iterator)
        except TypeError:
            self._iterator = None
        self._last = None
        self._tail = 0.0  # a first fetch has no gap to hold the last tail

    def sample(self, boundary=False):
        """Adds what the watched iterator did since the last sample
        (`boundary`: at an epoch's end or a new iterator's start)."""
        iterator = None if self._iterator is None else self._iterator()
        if iterator is None:
            return
        now = time.time()
        model = read_model(iterator)
        buffer, stage_map = (None, None)
        if model is not None:
            buffer, stage_map = stage_nodes(model, self.maps_above or 0)
        if self.maps_above is None:
            stage_map = None  # nothing of the stage's own to time
        elif buffer is not None and stage_map is None:
            buffer = None  # not the stage's pipeline as built
        if buffer is None:
            self.measures = False
            return
        fetches = model.nodes[model.output].num_elements
        map_ns = stage_map.processing_time if stage_map is not None else 0
        held = buffer.buffered_elements
        last_fetches, last_ns, last_held = self._last or (0, 0, held)
        new = fetches - last_fetches
        self._last = (fetches, map_ns, held)
        since, self._sampled = self._sampled, now
        if new <= 0:
            return
        gaps = list(model.gap_times)[-new:]
        gap = sum(gaps) / 1e6
        # An iterator's first fetch has no gap; more missing ones are past
        # the fetches tf.data keeps: as long as those it kept.
        if gaps and len(gaps) < new - 1:
            gap *= new / len(gaps)
        tail = self._tail
        self._tail = statistics.median(gaps) / 1e6 if gaps else 0.0
        if since is not None:
            # A gap that began before the last sample counts from there.
            gap = min(gap, now - since)
            self._add_wait(
                now - since, gap, tail, new, boundary, last_held, held
            )
        self.fetches += new
        self.gap_seconds += gap
        self.busy_seconds += (map_ns - last_ns) / 1e9
        # The fetches since the last sample saw the buffer as it was then
        # (at the data's end, one now sees it emptied).
        self.buffered_sum += last_held * new
        self.buffered_peak = max(self.buffered_peak, held, last_held)

    def _add_wait(self, interval, gap, tail, new, boundary, last_held, held):
        """Adds the wait of `new` fetches made in `interval` seconds."""
        # The rest of the interval was spent in fetches, but for the time
        # since the last fetch, plus the last interval's.
        fetching = max(0.0, interval - gap + tail - self._tail)
        if boundary and self._fetching:
            # The fetches took what recent ones did; the rest is the tail.
            rest = fetching + self._tail
            fetching = min(rest, new * statistics.median(self._fetching))
            self._tail = rest - fetching
        elif not boundary:
            self._fetching.append(fetching / new)
            if last_held > 0 and held > 0:
                self._ready.append(fetching / new)
        # A ready fetch's own time is no wait: a baseline learnt from the
        # samples whose buffer held elements at both ends.
        ready = statistics.median(self._ready) if self._ready else 0.0
        self.wait_seconds += max(0.0, fetching - new * ready)
