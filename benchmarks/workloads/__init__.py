"""The benchmark workloads, by name.

Each module holds one workload (its data generator, its preprocessing
layers, its trunk); this package maps the names used on the command line to
their classes.
"""

from benchmarks.workloads.base import TRUNK_SCALES, Workload, trunk_scale
from benchmarks.workloads.criteo import CriteoWorkload
from benchmarks.workloads.images import ImagesWorkload
from benchmarks.workloads.none import NoneWorkload
from benchmarks.workloads.remote import RemoteWorkload
from benchmarks.workloads.seed import SeedWorkload

# In the order `make bench` runs them.
WORKLOADS = {
    cls.name: cls
    for cls in (
        SeedWorkload,
        CriteoWorkload,
        RemoteWorkload,
        ImagesWorkload,
        NoneWorkload,
    )
}

__all__ = ["TRUNK_SCALES", "WORKLOADS", "Workload", "trunk_scale"]
