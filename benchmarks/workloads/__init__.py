"""The workload registry: every benchmark's models and data, by name."""

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
    """A fresh workload `name` of `WORKLOADS`, `overrides` (such as
    `batch_size`) set on it."""
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
