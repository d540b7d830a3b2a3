"""`benchmarks.jax_backend` on Keras's PyTorch backend.

`KERAS_BACKEND=torch python -m benchmarks.torch_backend [--rounds N]
[--quick] [--out PATH]` (in `.venv-torch`): the same module times either
backend, whichever the process runs on; this name only reads right on
torch. Results: `benchmarks/results/torch_backend.json`.
"""

import sys

import keras

from benchmarks.jax_backend import main

if __name__ == "__main__":
    if keras.backend.backend() != "torch":
        sys.exit("Run with KERAS_BACKEND=torch (in .venv-torch).")
    sys.exit(main())
