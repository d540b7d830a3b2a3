"""The benchmark suite of keras_stage.

Each workload is a whole Keras model whose preprocessing (parsing, hashing,
reading, decoding, augmentation) is part of the model as layers; the suite
trains it side by side in several modes (plain Keras, a hand-written
tf.data pipeline, keras_stage's SmartStage, and the two limits: the trunk
alone on materialised tensors and the staged pipeline alone) and reports
the speed of each as a ratio to plain Keras and to the limit.

Modules:

- `benchmarks.workloads`: the workloads (data, preprocessing, trunk).
- `benchmarks.modes`: the ways of training a workload.
- `benchmarks.timing`: what is timed, and the per-repetition statistics.
- `benchmarks.environment`: versions, CPUs and machine load.
- `benchmarks.harness`: warm-up, interleaved repetitions, results.
- `benchmarks.report`: the JSON file, the printed table, the PNG chart.
- `benchmarks.run`: the command line (`python -m benchmarks.run`).

Nothing here runs under `make test`;
`tests/benchmarks/benchmarks_test.py` checks the harness on a tiny size.
"""
