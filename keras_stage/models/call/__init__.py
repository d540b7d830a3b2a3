"""A staged call's lifetime, from the model API's entry to its return.

- `staged_call`: `StagedCall`, one fit/evaluate/predict call and its end.
"""
