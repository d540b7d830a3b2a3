"""Python data sources that fail are named: which source, which batch, why.

A generator or `keras.utils.PyDataset` runs inside tf.data, which turns
whatever it raises into a TensorFlow error and casts a batch of another
dtype silently. `check_source` wraps such a source so that its errors name
it and the batch, and each batch is checked against the first ones.
"""

import functools
import types

import keras
import numpy as np
import tensorflow as tf

from keras_stage.models.data_adapters.staged_data import EpochSource, build

# Keras fixes the spec of a Python source from its first 2 batches
# (`NUM_BATCHES_FOR_TENSOR_SPEC` of its data adapters): an axis whose size
# differs between them is variable, every other one is fixed.
_SPEC_BATCHES = 2
# Names of the parts of a tuple batch, as Keras unpacks it.
_TUPLE_PARTS = ("x", "y", "sample_weight")


class SourceError(Exception):
    """A generator or PyDataset feeding a staged run failed.

    The errors of the source's own code are raised as a subclass of both
    `SourceError` and the original type (a `ValueError` becomes a
    `SourceValueError`), chained from the original; a batch that does not
    match the first ones, or a source with no batch, raises
    `SourceBatchError`. Inside a training step TensorFlow re-raises it as a
    `tf.errors.OpError` carrying its message, as in a plain Keras run.

    Attributes:
        source: The source, e.g. `"generator 'make_batches'"`.
        index: The batch (counting from 0; a PyDataset's `__getitem__`
            index), or None.
    """

    source = None
    index = None

    def __str__(self):
        # One message, as given: KeyError's own str would quote it.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()

    def __reduce__(self):
        # Keras's multiprocessing workers send errors pickled; the classes
        # made for the user's types are found again through the cache.
        base = type(self).__dict__.get("_wrapped_type")
        cls = None if base is not None else type(self)
        return _restore, (base, cls, self.args, dict(self.__dict__))


class SourceBatchError(SourceError, ValueError):
    """A source yielded a batch unlike its first ones, or no batch at all."""


def _restore(base, cls, args, state):
    error = (cls or _error_class(base))(*args)
    error.__dict__.update(state)
    return error


def _batch_error(message, source, index=None):
    error = SourceBatchError(message)
    error.source, error.index = source, index
    return error


# One combined class per user exception type (unpickling finds it again).
_error_classes = {}


def _error_class(base):
    """`SourceError` combined with `base`, so `except base:` still works."""
    cls = _error_classes.get(base)
    if cls is None:
        try:
            cls = type(
                f"Source{base.__name__}",
                (SourceError, base),
                {"__module__": __name__, "_wrapped_type": base},
            )
        except Exception:  # a base that cannot be combined (layout, ...)
            cls = SourceError
        _error_classes[base] = cls
    return cls


def _dtype_name(dtype):
    try:
        return _hashable_dtype_name(dtype)
    except TypeError:  # unhashable
        return str(dtype)


@functools.cache  # numpy builds `dtype.name` anew at each call
def _hashable_dtype_name(dtype):
    if isinstance(dtype, np.dtype):
        # Text arrays change dtype with their longest string; TensorFlow
        # makes all of them (and objects) strings.
        return "string" if dtype.kind in "USO" else dtype.name
    if isinstance(dtype, tf.DType):
        return dtype.name
    try:
        return keras.backend.standardize_dtype(dtype)
    except (TypeError, ValueError):
        return str(dtype)


def _leaf_spec(leaf):
    """`(dtype, shape)` of one leaf of a batch, `(None, None)` for None."""
    if leaf is None:
        return None, None
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        leaf = np.asarray(leaf)  # a list or a number, as Keras reads it
    return _dtype_name(leaf.dtype), tuple(leaf.shape)


def _part_name(path, is_tuple):
    """A leaf's name in a batch: `x`, `y['b']`, `sample_weight`..."""
    if is_tuple and path:
        head, rest = path[0], path[1:]
        name = _TUPLE_PARTS[head] if head < len(_TUPLE_PARTS) else f"[{head}]"
    else:
        name, rest = "x", path
    return name + "".join(f"[{key!r}]" for key in rest)


class _BatchCheck:
    """Checks a source's batches against its first ones and names errors.

    The first batch fixes the structure and the dtypes, and the first
    `_SPEC_BATCHES` the shapes, as Keras's adapter does; the batch axis is
    always free. Keras reads those first batches alone, so no lock.
    """

    def __init__(self, source, where):
        self.source = source
        self._where = where  # e.g. " (`__getitem__({index})`)"
        self._seen = 0
        self._is_tuple = None
        self._paths = None
        self._specs = None

    def where(self, index):
        return self._where.format(index=index)

    def __call__(self, batch, index):
        if not isinstance(batch, (tuple, list, dict)):
            batch = (batch,)  # Keras reads a lone array as `(x,)`
        flat = keras.tree.flatten_with_path(batch)
        paths = tuple(path for path, _ in flat)
        specs = [_leaf_spec(leaf) for _, leaf in flat]
        if self._paths is None:
            self._is_tuple = isinstance(batch, (tuple, list))
            self._paths = paths
            # Batch axes are free; `_relax` frees the others that differ.
            self._specs = [
                (dtype, (None,) + shape[1:] if shape else shape)
                for dtype, shape in specs
            ]
            self._seen = 1
            return
        if paths != self._paths:
            self._raise_structure(batch, paths, index)
        learning = self._seen < _SPEC_BATCHES
        self._seen += 1
        for i, ((dtype, shape), (ref_dtype, ref_shape)) in enumerate(
            zip(specs, self._specs, strict=True)
        ):
            if dtype != ref_dtype:
                self._raise_dtype(i, dtype, ref_dtype, index)
            if shape is None or shape[1:] == ref_shape[1:]:
                continue
            if len(shape) != len(ref_shape):
                self._raise_rank(i, shape, ref_shape, index)
            if learning:
                self._relax(i, shape)
            elif any(
                r is not None and d != r
                for d, r in zip(shape, ref_shape, strict=True)
            ):
                self._raise_shape(i, shape, ref_shape, index)

    def _relax(self, i, shape):
        dtype, ref_shape = self._specs[i]
        merged = tuple(
            r if r == d else None for d, r in zip(shape, ref_shape, strict=True)
        )
        self._specs[i] = (dtype, merged)

    def _name(self, i):
        return _part_name(self._paths[i], self._is_tuple)

    def _bad_batch(self, index, detail, fix):
        return _batch_error(
            f"{self.source}, batch {index}{self.where(index)}, does not "
            f"match the first batches: {detail} {fix}",
            self.source,
            index,
        )

    def _raise_structure(self, batch, paths, index):
        is_tuple = isinstance(batch, (tuple, list))
        names = ", ".join(_part_name(p, is_tuple) for p in paths)
        first = ", ".join(_part_name(p, self._is_tuple) for p in self._paths)
        raise self._bad_batch(
            index,
            f"it holds [{names}] but the first batch held [{first}].",
            "Yield the same structure (tuple length, dict keys) for every "
            "batch.",
        )

    def _raise_dtype(self, i, dtype, ref_dtype, index):
        raise self._bad_batch(
            index,
            f"`{self._name(i)}` has dtype {dtype} but the first batch's has "
            f"{ref_dtype}.",
            "Keras fixes the dtypes from the first batch and would cast this "
            f"one silently, which can lose values. Yield {ref_dtype} for "
            f"every batch, e.g. `np.asarray(value, dtype='{ref_dtype}')`.",
        )

    def _raise_rank(self, i, shape, ref_shape, index):
        raise self._bad_batch(
            index,
            f"`{self._name(i)}` has rank {len(shape)} (shape {shape}) but "
            f"the first batch's has rank {len(ref_shape)}.",
            "Yield the same number of axes for every batch.",
        )

    def _raise_shape(self, i, shape, ref_shape, index):
        raise self._bad_batch(
            index,
            f"`{self._name(i)}` has shape {shape} but the first "
            f"batches fixed it to {ref_shape} (None: any size).",
            "Only the batch axis, and axes whose size already differs "
            "between the first two batches, may change. Yield the same "
            "shape for every batch, e.g. pad to one size.",
        )

    def raised(self, error, index=None, hook=None):
        """The error to raise, chained from `error`, for the user's code
        (`index`: the batch read, or None in the epoch `hook`)."""
        if hook is None:
            at = f"at batch {index}{self.where(index)}"
            fix = (
                "fix it there, or catch it inside the source to skip the batch."
            )
        else:
            at = f"in `{hook}`"
            fix = "fix it there."
        message = (
            f"{self.source} raised {type(error).__name__} {at}: {error}\n"
            "This error comes from the source's own code, not from "
            "keras_stage (the original traceback is chained as its cause): "
            f"{fix}"
        )
        try:
            wrapped = _error_class(type(error))(message)
        except Exception:  # a constructor that takes more than a message
            wrapped = SourceError(message)
        wrapped.source, wrapped.index = self.source, index
        return wrapped


def _checked_generator(generator, check):
    index = 0
    while True:
        try:
            batch = next(generator)
        except StopIteration:
            if index == 0:
                raise _batch_error(
                    f"{check.source} yielded no batches; fit, evaluate and "
                    "predict need at least one. A generator can be iterated "
                    "only once: create a new one for each call.",
                    check.source,
                ) from None
            return
        except Exception as e:
            raise check.raised(e, index) from e
        check(batch, index)
        yield batch
        index += 1


class _CheckedPyDataset(keras.utils.PyDataset):
    """`source`, each batch checked. No `super().__init__`: the length,
    workers and epoch hooks stay the source's own."""

    def __init__(self, source):
        self.source = source
        name = f"PyDataset '{type(source).__name__}'"
        self._check = _BatchCheck(name, " (`__getitem__({index})`)")
        try:
            empty = source.num_batches == 0
        except NotImplementedError:  # Keras reports it when it reads it
            empty = False
        if empty:
            raise _batch_error(
                f"{name} yielded no batches: its `__len__` returned 0. Make "
                "`__len__` return the number of batches (at least 1), e.g. "
                "`math.ceil(num_samples / batch_size)`.",
                name,
            )

    @property
    def workers(self):
        return self.source.workers

    @property
    def use_multiprocessing(self):
        return self.source.use_multiprocessing

    @property
    def max_queue_size(self):
        return self.source.max_queue_size

    @property
    def num_batches(self):
        return self.source.num_batches

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        try:
            batch = self.source[index]
        except Exception as e:
            raise self._check.raised(e, index) from e
        self._check(batch, index)
        return batch

    def _run_hook(self, hook):
        try:
            getattr(self.source, hook)()
        except Exception as e:
            raise self._check.raised(e, hook=hook) from e

    def on_epoch_begin(self):
        self._run_hook("on_epoch_begin")

    def on_epoch_end(self):
        self._run_hook("on_epoch_end")


def stage(request):
    """The `StagedData` of a call on a generator or PyDataset, as Keras
    iterates it (its Python runs as Keras reads each epoch: never read
    ahead), its failures named (`check_source`)."""
    adapter = request.keras_adapter(check_source(request.x))
    epoch = EpochSource(adapter.get_tf_dataset(), long_lived=False)
    return build(request, adapter, epoch)


def is_python_source(x):
    """Whether `x` is data made by Python code: a generator or a PyDataset."""
    return isinstance(x, (types.GeneratorType, keras.utils.PyDataset))


def check_source(x):
    """Wraps a generator or PyDataset so that its failures name it.

    Use it on the `x` of `fit`, `evaluate` or `predict` before Keras's data
    adapter reads it (a staged model does this itself). The batches pass
    through unchanged, in the same order; failures raise a `SourceError`.
    Any other `x`, or a source already wrapped, is returned as is.

    Raises:
        SourceBatchError: if `x` is a PyDataset of length 0.

    Example:

    >>> import numpy as np
    >>> def make_batches():
    ...     yield np.ones((2, 3), "float32"), np.ones((2, 1), "float32")
    ...     yield np.ones((2, 3), "float32"), np.ones((2, 1), "float32")
    ...     yield np.ones((2, 3), "float64"), np.ones((2, 1), "float32")
    >>> for batch in check_source(make_batches()):
    ...     pass
    Traceback (most recent call last):
        ...
    keras_stage.models.data_adapters.python_sources.SourceBatchError:
    generator 'make_batches',
    batch 2 (counting from 0), does not match the first batches: `x` has
    dtype float64 but the first batch's has float32. ...
    """
    if isinstance(x, types.GeneratorType):
        if x.gi_code is _checked_generator.__code__:
            return x
        check = _BatchCheck(f"generator '{x.__name__}'", " (counting from 0)")
        return _checked_generator(x, check)
    if isinstance(x, keras.utils.PyDataset) and not isinstance(
        x, _CheckedPyDataset
    ):
        return _CheckedPyDataset(x)
    return x
