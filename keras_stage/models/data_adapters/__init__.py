"""The data path: from what users pass to fit/evaluate/predict to a stage.

- `staged_data`: `stage_data`, which dispatches on the input type.
- `arrays`: in-memory arrays, in Keras's batches and order.
- `epoch_sources`: `EpochSource`, one epoch of a call's data.
- `python_sources`: generators and `keras.utils.PyDataset`.
"""
