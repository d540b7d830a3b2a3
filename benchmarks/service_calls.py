"""Repeated calls on one dataset object, staged on the tf.data service.

`python -m benchmarks.service_calls [--method evaluate|fit] [--calls N]
[--name NAME]` starts a local tf.data service (a dispatcher and one worker
in this process, `LocalService`) and calls `evaluate` (or `fit(epochs=1)`)
N times on the same `tf.data.Dataset` object of 20 batches, for a plain
`keras.Model` and a `keras_stage.Model` whose
`StagedInput(service=..., adaptive=False)` stages every call on the
service, with `smart_stage=True`, alternating call by call. The model is
`benchmarks.strategy_calls`'s. Whole calls (`time.perf_counter`); medians
leave the first two calls of each mode out; the paired ratio is the median
of staged/plain within a call. Results:
`benchmarks/results/service_calls/<name>.json`.
"""

import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.strategy_calls import _build, main_of, time_calls  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "service_calls"


def run(method, calls, log=print):
    """`{"plain": [s...], "staged": [s...], "summary": {...}}`."""
    from keras_stage.data.service import LocalService

    with LocalService(num_workers=1) as service:
        models = {
            "plain": _build(False),
            "staged": _build(True, service=service.target),
        }
        return time_calls(
            models, method, calls, "staged on a local tf.data service", log
        )


def main(argv=None):
    return main_of(__doc__, run, RESULTS, argv)


if __name__ == "__main__":
    sys.exit(main())
