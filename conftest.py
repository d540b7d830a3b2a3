"""pytest's collection across the repository (`testpaths`: tests and the
package's doctests)."""

import importlib.util

# `torch_batches` imports torch, which only the torch environment has; there
# `make test-torch` runs its doctests.
collect_ignore = (
    []
    if importlib.util.find_spec("torch")
    else ["keras_stage/models/backends/torch_batches.py"]
)
