"""The criteo-like script with a second `evaluate`, on a holdout set.

`benchmarks.scripts.criteo` as it is (fit 3 epochs with validation,
`evaluate` on 20 batches), then `evaluate` on 20 batches of other rows (a
test set and a holdout set, or two days), then `predict` on 8: a second
call on new data after a staged fit.
"""

from benchmarks.scripts import criteo


def run(mode, timer, tiny=False):
    """The script in `mode` (see `benchmarks.scripts`)."""
    criteo.script(mode, timer, tiny, holdout=True)
