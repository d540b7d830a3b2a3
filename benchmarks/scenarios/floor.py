"""`floor`: the IO floor and how far overlap can go, per workload.

A round of a mode is one warm `fit(epochs=1)`, as in `bench`. The reference
is a hand-built tf.data pipeline, `pipeline_auto`: one autotuned `map` on a
private pool of 16 threads (the stage's at its largest), then
`prefetch(AUTOTUNE)`; run again, it is the control, with the noise of reads
and decoding that a control of the trunk alone lacks. The floor when input
costs nothing is a mode of each case: `compute_bound`, the trunk alone on
batches kept in memory. Each case adds its own:

- `remote` (the IO floor): the stage against other pipelines of the same
  reads and parsing on the same pool: 16 at once (`pipeline_16`), autotune
  told of 2 cores (`pipeline_2cpu`), reads 16 at once and one parse at a
  time beside the step (`pipeline_split`). If none beats the stage, its
  distance to the floor is the machine's.
- `images` (thread pools): expert on tf.data's shared pool; staged on its
  adaptive pool (metric `thread_pool_size`), on 16 and on 2 threads.
- `criteo` (the overlap bound): plain, expert, staged and `parsing_beside`,
  the trunk while another process parses a batch of the same lines per step
  on one thread: a stage with nothing of its own to pay, the bound of what
  staging the parsing buys; a round waits for the parsing to end (`lag`, ~0
  if it kept up).
"""

import functools
import os
import subprocess
import sys
import time
from subprocess import PIPE

import keras
import tensorflow as tf

from benchmarks.modes import MODES, Built, Mode
from benchmarks.runner import Scenario
from benchmarks.workloads import workload
from benchmarks.workloads.text import ParseCsvLines, Remote, RemoteRead

AUTO = tf.data.AUTOTUNE
CASES = {
    "remote": "compute_bound staged pipeline_16 pipeline_2cpu pipeline_split",
    "images": "compute_bound expert staged staged_pool16 staged_pool2",
    "criteo": "compute_bound plain expert staged parsing_beside",
}


def pipeline(preprocess, data, parallel=AUTO, cpu_budget=None, split=None):
    """`data` of raw `(x, y)` through a tf.data pipeline built by hand."""
    if split is None:
        data = data.map(lambda x, y: (preprocess(x), y), parallel)
    else:  # `remote`'s read, then its parsing, `split` at once
        read, parse = RemoteRead(Remote.read_seconds), ParseCsvLines()
        data = data.map(lambda x, y: (read(x), y), parallel)
        data = data.map(lambda x, y: (parse(x), y), split)
    options = tf.data.Options()
    options.threading.private_threadpool_size = 16
    # As in the stage: no prefetch injected besides the one below.
    options.experimental_optimization.inject_prefetch = False
    if cpu_budget is not None:
        options.autotune.cpu_budget = cpu_budget
    return data.prefetch(AUTO).with_options(options)


class Pipeline(Mode):
    """The hand split fed by `pipeline(**options)`."""

    def build(self, *args, **kwargs):
        built = super().build(*args, **kwargs)
        built.feed = functools.partial(
            pipeline, built.preprocess, **self.options
        )
        return built


class ParsedBeside(Built):
    """The trunk alone while a process parses a batch per step (`criteo`)."""

    def __init__(self, built, name, rows):
        super().__init__(built.model, built.kind, built.preprocess)
        code = "from benchmarks.scenarios.floor import parse; "
        code += f"parse({name!r}, {rows})"
        # Unbuffered: each request reaches the process at once.
        self.server = subprocess.Popen(
            [sys.executable, "-c", code], stdin=PIPE, stdout=PIPE, bufsize=0
        )
        self.server.stdout.read(1)  # b"r": ready

    def call(self, method, data, callbacks=(), **kwargs):
        ask = keras.callbacks.LambdaCallback(
            on_train_batch_begin=lambda *_, **__: self.server.stdin.write(b"p")
        )
        super().call(method, data, [*callbacks, ask], **kwargs)
        started = time.perf_counter()
        self.server.stdin.write(b"s")  # answered once all asked are parsed
        if self.server.stdout.read(1) != b"s":
            raise RuntimeError("The parsing process ended.")
        self.lag = time.perf_counter() - started

    def close(self):
        self.server.communicate(timeout=60)  # the end of its stdin ends it


def parse(name, rows):
    """The process of `ParsedBeside`: parses the next batch of `name`'s
    lines per `p` on stdin; answers `s` once those asked are parsed."""
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    work = workload(name)
    x, _ = work.data(rows)
    batches = iter(work.dataset(x).map(work.preprocessing(x)).repeat())
    next(batches)  # traced before it says it is ready
    os.write(1, b"r")
    while command := sys.stdin.buffer.read(1):
        if command == b"p":
            next(batches)
        else:
            os.write(1, b"s")


for _mode in (
    Mode("staged_pool16", "staged", {"thread_pool_size": 16}),
    Mode("staged_pool2", "staged", {"thread_pool_size": 2}),
    Pipeline("pipeline_auto", "expert"),
    Pipeline("pipeline_auto_again", "expert"),
    Pipeline("pipeline_16", "expert", {"parallel": 16}),
    Pipeline("pipeline_2cpu", "expert", {"cpu_budget": 2}),
    Pipeline("pipeline_split", "expert", {"parallel": 16, "split": 1}),
    Mode("parsing_beside", "trunk"),
):
    MODES[_mode.name] = _mode


class Floor(Scenario):
    name = "floor"
    reference, control = "pipeline_auto", "pipeline_auto_again"
    modes = (reference, *dict.fromkeys(" ".join(CASES.values()).split()))
    modes += (control,)
    # Two untimed rounds: a stage's second call on a dataset builds it anew.
    warm, rounds, quick_rounds = 2, 12, 3

    def arguments(self, parser):
        parser.add_argument("--cases", default=",".join(CASES))
        parser.add_argument("--steps", type=int, help="batches per epoch")

    def cases(self, args):
        return args.cases.split(",")

    def case_modes(self, case, args):
        chosen = (self.reference, *CASES[case].split(), self.control)
        return [mode for mode in chosen if mode in args.modes]

    def setup(self, case, mode, args):
        work = workload(case)
        steps = args.steps or (work.quick_steps if args.quick else work.steps)
        x, y = work.data(steps * work.batch_size)
        built = mode.build(work, x)
        if mode.name == "parsing_beside":
            built = ParsedBeside(built, case, len(x))
        data = work.dataset(x, y)
        built.feed(data)  # the trunk's batches preprocessed once, untimed
        return built, data

    def trial(self, state):
        built, data = state
        built.call("fit", data, epochs=1)
        if isinstance(built, ParsedBeside):
            return {"lag": built.lag}
        verdict = built.prefetch and built.prefetch.verdict
        pool = verdict and verdict["thread_pool_size"]
        return None if pool is None else {"thread_pool_size": pool}

    def close(self, state):
        if isinstance(state[0], ParsedBeside):
            state[0].close()


SCENARIO = Floor()
