"""`tabular_split` on the Criteo-like model of `benchmarks.jax_backend`."""

from benchmarks.scripts import tabular_split


def run(mode, timer, tiny=False):
    """The script in `mode` (see `benchmarks.scripts`)."""
    tabular_split.script("criteo", mode, timer, tiny)
