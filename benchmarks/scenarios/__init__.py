"""The benchmark families, each a short `runner.Scenario`.

Imported by name on demand (`scenario(name)`): a JAX scenario's module is
only imported where JAX is.
"""

import importlib

# name: (module, what it measures).
SCENARIOS = {
    "bench": (
        "bench",
        "the speed table: one warm fit epoch per round, per workload",
    ),
    "regimes": ("regimes", "short sequences of whole calls, set-up included"),
    "calls": ("calls", "many calls on one dataset object: a kept stage's cost"),
    "determinism": (
        "determinism",
        "the stage's verdict under op determinism against its clock's",
    ),
    "floor": ("floor", "the IO floor and how far overlap can go"),
    "fits": ("fits", "warm whole fits with string inputs on any backend"),
    "scale": ("scale", "whole fits on JAX: 1 device, 2 devices, 2 processes"),
    "scripts": ("scripts", "user scripts run once, each in a fresh process"),
}


def scenario(name):
    """The `Scenario` instance of `name`."""
    if name not in SCENARIOS:
        raise SystemExit(
            f"Unknown benchmark {name!r}: expected one of {sorted(SCENARIOS)}."
        )
    module = importlib.import_module(
        f"benchmarks.scenarios.{SCENARIOS[name][0]}"
    )
    return module.SCENARIO
