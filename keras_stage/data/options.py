"""Stage options: the DeepRec `tf.staged` knobs, defined and validated once.

`OPTIONS` is the one table of the options (name, default, check, doc):
`StageOptions` validates from it, the entry points draw their `Args:` from
it (`document_options`) and `StagedInput.get_config` its keys.
"""

import builtins
import importlib
import inspect
import os
import textwrap

import tensorflow as tf

from keras_stage.data.devices import validate_device_argument
from keras_stage.data.service import (
    DISTRIBUTED_EPOCH,
    validate_processing_mode,
    validate_service_argument,
)

AUTO = "auto"
"""The value of an option left to keras_stage (or tf.data's autotuning)."""

# The private pool when `num_threads="auto"`: above the cores, for IO.
_AUTO_POOL_MIN = 16
_AUTO_POOL_PER_CPU = 4
_AUTO_POOL_GROWTH = 4  # how far an adaptive pool grows on IO (`StagePool.most`)
IDLE_CAPACITY = 8  # the "auto" buffer of a host stage with nothing to compute


def usable_cpus():
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def exception_name(cls):
    """The name a saved config stores exception class `cls` under."""
    if getattr(tf.errors, cls.__name__, None) is cls:
        return f"tf.errors.{cls.__name__}"
    if getattr(builtins, cls.__name__, None) is cls:
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def exception_class(name, argument):
    """The exception class `name` names (as `exception_name` wrote it)."""
    if not isinstance(name, str):
        return name
    found = _find_exception(name)
    if found is None:
        raise ValueError(
            f"Invalid value for argument `{argument}`: cannot find the "
            f"exception class {name!r}. Use a class, or a name such as "
            '"tf.errors.DataLossError", "ValueError" or '
            '"my_package.errors.CorruptRecordError" (import the module that '
            f"defines it before loading). Received: {argument} containing "
            f"{name!r}"
        )
    return found


def _find_exception(name):
    if name.startswith("tf.errors."):
        return getattr(tf.errors, name[len("tf.errors.") :], None)
    if "." not in name:
        return getattr(builtins, name, None)
    # The module is the longest importable prefix, the rest a __qualname__.
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute, None)
            if found is None:
                return None
        return found
    return None


def _is_positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _auto_or_positive_int(name, value):
    if value == AUTO or _is_positive_int(value):
        return value
    raise ValueError(
        f"Invalid value for argument `{name}`. Expected a positive int or "
        f'"auto". Received: {name}={value!r}'
    )


def _exception_types(name, value):
    if isinstance(value, type):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"Invalid value for argument `{name}`. Expected a tuple of "
            "exception classes, e.g. (tf.errors.InvalidArgumentError,). "
            f"Received: {name}={value!r}"
        )
    for item in value:
        if not (isinstance(item, type) and issubclass(item, Exception)):
            raise TypeError(
                f"Invalid value for argument `{name}`. Every item must be an "
                "exception class such as tf.errors.DataLossError. "
                f"Received: {name}={value!r} (bad item: {item!r})"
            )
    return tuple(value)


def _seconds_or_none(name, value):
    if value is None:
        return None
    # `not value > 0` also rejects NaN.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
    ):
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected a positive "
            f"number of seconds or None. Received: {name}={value!r}"
        )
    return float(value)


def _positive_int_or_none(name, value):
    if value is None or _is_positive_int(value):
        return value
    raise ValueError(
        f"Invalid value for argument `{name}`. Expected a positive int or "
        f"None. Received: {name}={value!r}"
    )


def _bool(name, value):
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"Invalid value for argument `{name}`. Expected True or False. "
        f"Received: {name}={value!r}"
    )


def _stage_name(name, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected a non-empty "
            f"string or None. Received: {name}={value!r}"
        )
    if value is not None and not value.isidentifier():
        raise ValueError(
            f"Invalid value for argument `{name}`. Expected letters, digits "
            "and underscores, not starting with a digit (tf.data names the "
            f"stage's transformations after it). Received: {name}={value!r}"
        )
    return value


def _device(name, value):
    # Only the form: devices exist once TensorFlow initialised them.
    return validate_device_argument(value)


def _stream(name, value):
    if value is None or (
        isinstance(value, int) and not isinstance(value, bool) and value >= 0
    ):
        return value
    raise ValueError(
        f"Invalid value for argument `{name}`. Expected None or a "
        "non-negative int (a stream made by keras_stage.configure_streams). "
        f"Received: {name}={value!r}"
    )


def _auto_or_bool(name, value):
    if value == AUTO or isinstance(value, bool):
        return value
    raise ValueError(
        f'Invalid value for argument `{name}`. Expected "auto", True or '
        f"False. Received: {name}={value!r}"
    )


def _service(name, value):
    # Only the form: a dispatcher is reached when a stage is built.
    return validate_service_argument(value)


def _processing_mode(name, value):
    return validate_processing_mode(value)


class Option:
    """One stage option: `check(name, value)` returns the value normalised or
    raises naming the argument; `doc` is one paragraph ("Defaults to ..." is
    added); with `exception_classes`, a saved config stores the value's
    exception classes by name."""

    def __init__(self, name, default, check, doc, exception_classes=False):
        self.name = name
        self.default = default
        self._check = check
        self.doc = " ".join(doc.split())
        self.exception_classes = exception_classes

    def check(self, value):
        """`value` validated and normalised."""
        return self._check(self.name, value)

    def to_config(self, value):
        """`value` as a saved config holds it (exception classes by name)."""
        if self.exception_classes:
            return [exception_name(t) for t in value]
        return value

    def from_config(self, value):
        """`value` from a saved config, with exception class names resolved."""
        if self.exception_classes and isinstance(value, (list, tuple)):
            return tuple(exception_class(t, self.name) for t in value)
        return value

    @property
    def default_code(self):
        """The default as a user would write it in Python."""
        return _as_code(self.default)

    def docstring_entry(self, indent):
        """The option's `Args:` entry, wrapped at 80 columns."""
        return textwrap.fill(
            f"{self.name}: {self.doc} Defaults to `{self.default_code}`.",
            width=80,
            initial_indent=indent,
            subsequent_indent=indent + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        )

    def __repr__(self):
        return f"Option({self.name!r}, default={self.default!r})"


def _as_code(value):
    """`value` as a user would write it in Python."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        items = [
            exception_name(v) if isinstance(v, type) else repr(v) for v in value
        ]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    return repr(value)


# The stage options in signature order, named as DeepRec's where it has one.
OPTIONS = (
    Option(
        "capacity",
        AUTO,
        _auto_or_positive_int,
        f"""How many finished elements (batches, in a Keras model) may wait
        for the consumer: a positive int, or `"auto"` for tf.data to size the
        buffer ({IDLE_CAPACITY} for a host stage with nothing to compute).""",
    ),
    Option(
        "num_threads",
        AUTO,
        _auto_or_positive_int,
        """Elements produced at once: a positive int, or `"auto"` (tf.data
        autotuning, which may exceed the cores for a stage waiting on IO).""",
    ),
    Option(
        "closed_exception_types",
        (tf.errors.OutOfRangeError,),
        _exception_types,
        """Errors that end the data gracefully, as the dataset's end does.""",
        exception_classes=True,
    ),
    Option(
        "ignored_exception_types",
        (),
        _exception_types,
        """Errors whose element is skipped, counted and reported (per
        epoch, in a Keras model); the run goes on. A type cannot be both
        closed and ignored.""",
        exception_classes=True,
    ),
    Option(
        "timeout",
        300.0,
        _seconds_or_none,
        """Seconds the consumer may wait for one element before a
        `keras_stage.data.StageTimeoutError` names the stage (DeepRec's
        `timeout_millis`, in seconds); `None` waits forever.""",
    ),
    Option(
        "thread_pool_size",
        None,
        _positive_int_or_none,
        f"""Size of the stage's private thread pool, at least `num_threads`;
        `None` sizes it from `num_threads`. With `num_threads="auto"` it is
        resized between epochs (`StagedDataset.thread_pool`): up to
        {_AUTO_POOL_PER_CPU} threads per core (at least {_AUTO_POOL_MIN})
        while the consumer waits, one per core once an epoch kept up.""",
    ),
    Option(
        "deterministic",
        True,
        _bool,
        """Keep the element order, so a staged run trains exactly like an
        unstaged one.""",
    ),
    Option(
        "name",
        None,
        _stage_name,
        """Name of the stage in errors and logs: letters, digits and
        underscores (tf.data names the stage's transformations after it);
        `None` generates one.""",
    ),
    Option(
        "device",
        AUTO,
        _device,
        """Where finished elements wait: `"auto"` (the first GPU if
        TensorFlow sees one, else the host), `"cpu"` (the host), or a
        device such as `"/GPU:1"`. The staged computation runs on host
        threads; the copy to the device overlaps the consumer's step.""",
    ),
    Option(
        "stream",
        None,
        _stream,
        """Stream `k` made by `keras_stage.configure_streams`: the copies
        into the device buffer run on that logical device's streams, beside
        the consumer's step. `None` uses the step's device. Without a GPU
        it warns once and does nothing.""",
    ),
    Option(
        "pack_transfer",
        AUTO,
        _auto_or_bool,
        """Pack an element's many small tensors into a few, so the copy to
        `device` is a few large copies: `"auto"` (for a consumer that
        unpacks in its own step, as a Keras model does), `True` or `False`.
        `StagedDataset.unpack` restores packed elements.""",
    ),
    Option(
        "service",
        None,
        _service,
        """A tf.data service dispatcher, `"grpc://host:port"` (see
        `keras_stage.data.service`), whose workers run the dataset (a tf.data
        source, not a generator) and the staged computation for this
        process's buffer. `None` stages in this process.""",
    ),
    Option(
        "processing_mode",
        DISTRIBUTED_EPOCH,
        _processing_mode,
        """How the service's workers share an epoch: `"distributed_epoch"`
        (each element once per epoch, split across the workers; the dataset
        must start from a splittable source such as `from_tensor_slices`,
        `range` or `list_files`) or `"parallel_epochs"` (every worker runs
        the whole dataset).""",
    ),
    Option(
        "worker_timeout",
        10.0,
        _seconds_or_none,
        """With a `service`: seconds the consumer may wait for the next
        element, in an epoch that has already delivered, before the stage
        takes a worker as lost and ends the epoch with what arrived (what
        was lost is reported). Set it above your slowest element's time.
        `None` never ends an epoch early (then `timeout` raises).""",
    ),
)

# The line of an `Args:` section that `document_options` replaces.
OPTIONS_MARKER = "{stage_options}"


def options_docstring(docstring, parameters):
    """`docstring` with its `OPTIONS_MARKER` line replaced by the `Args:`
    entries of the options in `parameters` (also used by `docs/hooks/`)."""
    lines = []
    for line in docstring.split("\n"):
        if line.strip() != OPTIONS_MARKER:
            lines.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        lines.extend(
            option.docstring_entry(indent)
            for option in OPTIONS
            if option.name in parameters
        )
    return "\n".join(lines)


def document_options(obj):
    """Decorator: fills in the `{stage_options}` line of `obj`'s `Args:`."""
    if obj.__doc__ is not None:  # docstrings are gone under `python -OO`
        parameters = inspect.signature(obj).parameters
        obj.__doc__ = options_docstring(obj.__doc__, parameters)
    return obj


@document_options
class StageOptions:
    """Validated options of one stage.

    `keras_stage.data.stage` and `keras_stage.layers.StagedInput` check
    their options here; make one directly to check options ahead of time.

    Args:
        {stage_options}

    Example:

    >>> from keras_stage.data import StageOptions
    >>> StageOptions(capacity=4, num_threads=2).capacity
    4
    """

    def __init__(
        self,
        capacity=AUTO,
        num_threads=AUTO,
        closed_exception_types=(tf.errors.OutOfRangeError,),
        ignored_exception_types=(),
        timeout=300.0,
        thread_pool_size=None,
        deterministic=True,
        name=None,
        device=AUTO,
        stream=None,
        pack_transfer=AUTO,
        service=None,
        processing_mode=DISTRIBUTED_EPOCH,
        worker_timeout=10.0,
    ):
        # The arguments by name (`locals()` holds only them and `self`).
        given = locals()
        for option in OPTIONS:
            setattr(self, option.name, option.check(given[option.name]))
        self._check_combination()

    def _check_combination(self):
        both = set(self.closed_exception_types) & set(
            self.ignored_exception_types
        )
        if both:
            names = sorted(t.__name__ for t in both)
            raise ValueError(
                "An exception type cannot be both closed and ignored. "
                f"Remove {names} from `closed_exception_types` or from "
                "`ignored_exception_types`."
            )
        pool, threads = self.thread_pool_size, self.num_threads
        if pool is not None and _is_positive_int(threads) and pool < threads:
            raise ValueError(
                "Invalid value for argument `thread_pool_size`: a pool of "
                f"{pool} threads cannot run num_threads={threads} producers "
                f"at once. Use thread_pool_size >= {threads} or leave it "
                f"None. Received: thread_pool_size={pool!r}"
            )

    @property
    def adaptive_pool(self):
        """Whether the pool is resized between epochs (`data.pool`)."""
        return (
            self.num_threads == AUTO
            and self.thread_pool_size is None
            and self.service is None
        )

    def smallest_pool_size(self):
        """The fewest threads an adaptive pool is given: the cores."""
        return min(usable_cpus(), self.resolved_pool_size())

    def most_pool_size(self):
        """The most threads an adaptive pool grows to for a stage on IO."""
        return _AUTO_POOL_GROWTH * self.resolved_pool_size()

    def resolved_pool_size(self):
        """Threads in the stage's private pool (an adaptive one's largest)."""
        if self.thread_pool_size is not None:
            return self.thread_pool_size
        cpus = usable_cpus()
        if self.num_threads == AUTO:
            return max(_AUTO_POOL_MIN, _AUTO_POOL_PER_CPU * cpus)
        # A stage that waits on IO needs N real threads, however few cores.
        return max(self.num_threads, cpus)

    def get_config(self):
        """Every option by name, as passed to `StageOptions(**config)`."""
        return {option.name: getattr(self, option.name) for option in OPTIONS}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"StageOptions({args})"
