"""Whether a call, or an epoch of it, is staged.

- `calls`: whether a call can repay its stage, from measured costs.
- `epochs`: whether a staged fit's next epoch is staged, measured.
"""
