"""The iterators Keras gets from a staged call, and those kept alive.

- `kept_iterators`: `KeptIterator`, the one interface, and what stands
  behind it (epoch views of `data.epochs`, kept stages per role).
"""
