"""Runnable examples of keras_stage (`python -m examples.demo`)."""
