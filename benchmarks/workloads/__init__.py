"""The one workload registry: every benchmark's models and data, by name.

`workload(name, **overrides)` returns a fresh `Workload` (see `base`), an
attribute such as `batch_size` or `steps` overridden for a scenario.
"""

from benchmarks.workloads import criteo, images, recommenders, tables, text
from benchmarks.workloads.base import Workload

WORKLOADS = {
    cls.name: cls
    for cls in (
        text.Seed,
        criteo.Criteo,
        text.Remote,
        images.Images,
        tables.NoneWorkload,
        tables.Dense,
        tables.Tabular,
        tables.FeatureSpaceWorkload,
        criteo.CriteoColumns,
        tables.DCN,
        *recommenders.WORKLOADS.values(),
    )
}


def workload(name, **overrides):
    """A fresh workload `name` of `WORKLOADS`, `overrides` set on it."""
    if name not in WORKLOADS:
        raise ValueError(
            f"Unknown workload {name!r}: expected one of {list(WORKLOADS)}."
        )
    out = WORKLOADS[name]()
    for key, value in overrides.items():
        if not hasattr(out, key):
            raise ValueError(f"Workload {name!r} has no attribute {key!r}.")
        setattr(out, key, value)
    return out


__all__ = ["WORKLOADS", "Workload", "workload"]
