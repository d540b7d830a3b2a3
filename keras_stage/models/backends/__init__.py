"""The backend's steps: what a staged call does on each Keras backend.

- `backend`: which backend runs the steps, and JAX's step.
- `tensorflow_steps`: Keras's compiled TensorFlow steps, guarded and
  recorded.
"""
