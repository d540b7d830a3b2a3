"""A staged call's lifetime, from the model API's entry to its return.

- `staged_call`: `StagedCall`, one fit/evaluate/predict call and its end.
- `facts`: what the call's decision to stage is decided from.
- `measure`: what the call measures for the policy.
"""
