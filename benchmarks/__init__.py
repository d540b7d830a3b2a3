"""keras_stage's benchmark suite: `python -m benchmarks SCENARIO [options]`.

A workload is a whole Keras model with its preprocessing as layers; a
scenario times it in several modes side by side (plain Keras, keras_stage,
a hand-tuned tf.data split, the trunk alone) as paired ratios. Modules:

- `workloads`: the models, their raw data and preprocessing;
- `modes`: the ways a workload is built and fed;
- `runner`: `Scenario` and the paired runner (rounds, rotation, processes);
- `records`: summaries, tables and result files;
- `history`: the history table (`python -m benchmarks.history`);
- `scenarios`: the benchmark families (`python -m benchmarks --list`);
- `scripts`: the user scripts the `scripts` scenario runs.
"""
