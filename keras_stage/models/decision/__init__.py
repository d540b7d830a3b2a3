"""Whether a call is staged.

- `calls`: the policy: a call's `Decision`, from its facts and costs.
- `learned`: what a model's calls taught the policy.
"""
