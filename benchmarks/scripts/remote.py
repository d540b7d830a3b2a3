"""The `remote` workload as a script: one `fit(epochs=1)` over its dataset.

`benchmarks.workloads.remote`'s model (a 20 ms emulated remote read per
batch, then CSV parsing and hashing, a small trunk) and its dataset of
100 batches of 256, built and compiled as `benchmarks.modes` builds its
plain and staged modes.
"""

import keras_stage
from benchmarks.scripts import is_staged
from benchmarks.workloads.remote import RemoteWorkload


def run(mode, timer, tiny=False):
    """The script in `mode` (see `benchmarks.scripts`)."""
    staged = is_staged(mode)
    workload = RemoteWorkload(steps=2 if tiny else RemoteWorkload.default_steps)
    workload.raw_data()
    dataset = workload.raw_dataset()

    timer.start()
    if staged:
        model = workload.whole_model(
            keras_stage.Model, keras_stage.layers.StagedInput()
        )
        model.compile(**workload.compile_kwargs(), smart_stage=True)
    else:
        model = workload.whole_model()
        model.compile(**workload.compile_kwargs())
    with timer.measure("fit"):
        model.fit(dataset, epochs=1, verbose=0)
