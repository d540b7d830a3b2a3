"""Stage options: the DeepRec `tf.staged` knobs, validated once.

`StageOptions` owns argument checking for every public entry point
(`keras_stage.data.stage`, `StagedInput`), so a bad value gets the same
message wherever it is passed. It knows nothing of Keras.
"""

import os

import tensorflow as tf

from keras_stage.data.devices import validate_device_argument
from keras_stage.data.service import (
    DISTRIBUTED_EPOCH,
    validate_processing_mode,
    validate_service_argument,
)

AUTO = "auto"

# Upper bound for the private pool when `num_threads="auto"`: staged work is
# often waiting on IO, so concurrency may usefully exceed the core count.
_AUTO_POOL_MIN = 16
_AUTO_POOL_PER_CPU = 4
# How far past its starting size an adaptive pool grows for a stage that
# waits on IO (`StagePool.most`).
_AUTO_POOL_GROWTH = 4


def usable_cpus():
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _is_positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_auto_or_positive_int(name, value):
    if value == AUTO or _is_positive_int(value):
        return value
    raise ValueError(
        f"Invalid value for argument `{name}`. Expected a positive int or "
        f'"auto". Received: {name}={value!r}'
    )


def _check_exception_types(name, value):
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


class StageOptions:
    """Validated options of one stage.

    Args:
        capacity: Maximum number of finished elements waiting for the
            consumer: a positive int, or `"auto"` to let tf.data size the
            buffer. Defaults to `"auto"`.
        num_threads: Number of elements produced at once: a positive int,
            or `"auto"` (tf.data autotuning, allowed to grow past the core
            count for stages that wait on IO). Defaults to `"auto"`.
        closed_exception_types: Errors that end the data gracefully.
            Defaults to `(tf.errors.OutOfRangeError,)`.
        ignored_exception_types: Errors whose element is skipped, counted
            and reported; the run goes on. Defaults to `()`.
        timeout: Seconds the consumer may wait for one element before a
            `StageTimeoutError` names the stage; `None` waits forever.
            Defaults to `300.0` (DeepRec's 300000 ms).
        thread_pool_size: Size of the stage's private thread pool; `None`
            sizes it from `num_threads`. Defaults to `None`.
        deterministic: Keep element order. Defaults to `True`.
        name: Name of the stage in errors and logs. Defaults to `None`
            (generated).
        device: Where finished elements wait: `"auto"` (the first GPU if
            TensorFlow sees one, else the host), `"cpu"` (the host), or a
            device such as `"/GPU:1"`. The staged computation always runs
            on host threads; with a device, the buffer lives there and the
            copy overlaps the training step. Defaults to `"auto"`.
        stream: The stream (a logical device made by
            `keras_stage.configure_streams`) for staged work the user wants
            on the device, or `None` for the training step's own. Defaults
            to `None`.
        pack_transfer: Pack the element's leaves per dtype into one tensor
            each for the copy to the device buffer: `"auto"` (when it copies
            fewer tensors), `True` or `False`. Defaults to `"auto"`.
        service: The address of a tf.data service dispatcher,
            `"grpc://host:port"`: the dataset and the staged computation
            run on the service's workers and finished elements come back
            into this process's buffer. `None` stages in this process.
            Defaults to `None`.
        processing_mode: How the service's workers share an epoch:
            `"distributed_epoch"` (each element once per epoch) or
            `"parallel_epochs"` (every worker runs the whole dataset).
            Defaults to `"distributed_epoch"`.
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
    ):
        self.capacity = _check_auto_or_positive_int("capacity", capacity)
        self.num_threads = _check_auto_or_positive_int(
            "num_threads", num_threads
        )
        self.closed_exception_types = _check_exception_types(
            "closed_exception_types", closed_exception_types
        )
        self.ignored_exception_types = _check_exception_types(
            "ignored_exception_types", ignored_exception_types
        )
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
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)
            ):
                raise ValueError(
                    "Invalid value for argument `timeout`. Expected a "
                    "positive number of seconds or None. "
                    f"Received: timeout={timeout!r}"
                )
            if not timeout > 0:
                raise ValueError(
                    "Invalid value for argument `timeout`. Expected a "
                    "positive number of seconds or None. "
                    f"Received: timeout={timeout!r}"
                )
            timeout = float(timeout)
        self.timeout = timeout
        if thread_pool_size is not None and not _is_positive_int(
            thread_pool_size
        ):
            raise ValueError(
                "Invalid value for argument `thread_pool_size`. Expected a "
                "positive int or None. "
                f"Received: thread_pool_size={thread_pool_size!r}"
            )
        if (
            thread_pool_size is not None
            and _is_positive_int(self.num_threads)
            and thread_pool_size < self.num_threads
        ):
            raise ValueError(
                "Invalid value for argument `thread_pool_size`: a pool of "
                f"{thread_pool_size} threads cannot run num_threads="
                f"{self.num_threads} producers at once. Use thread_pool_size"
                f" >= {self.num_threads} or leave it None. "
                f"Received: thread_pool_size={thread_pool_size!r}"
            )
        self.thread_pool_size = thread_pool_size
        if not isinstance(deterministic, bool):
            raise ValueError(
                "Invalid value for argument `deterministic`. Expected True "
                f"or False. Received: deterministic={deterministic!r}"
            )
        self.deterministic = deterministic
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(
                "Invalid value for argument `name`. Expected a non-empty "
                f"string or None. Received: name={name!r}"
            )
        if name is not None and not name.isidentifier():
            raise ValueError(
                "Invalid value for argument `name`. Expected letters, digits "
                "and underscores, not starting with a digit (tf.data names "
                "the stage's transformations after it). "
                f"Received: name={name!r}"
            )
        self.name = name
        # Only the form here: which devices exist is known once TensorFlow
        # has initialised them (see `devices.resolve_device`).
        self.device = validate_device_argument(device)
        if stream is not None and not (
            isinstance(stream, int)
            and not isinstance(stream, bool)
            and stream >= 0
        ):
            raise ValueError(
                "Invalid value for argument `stream`. Expected None or a "
                "non-negative int (a stream made by "
                f"keras_stage.configure_streams). Received: stream={stream!r}"
            )
        self.stream = stream
        if pack_transfer not in (AUTO, True, False) or (
            pack_transfer in (0, 1) and not isinstance(pack_transfer, bool)
        ):
            raise ValueError(
                "Invalid value for argument `pack_transfer`. Expected "
                f'"auto", True or False. Received: pack_transfer='
                f"{pack_transfer!r}"
            )
        self.pack_transfer = pack_transfer
        # Only the form: whether a dispatcher answers is checked when a
        # stage is built (a saved model may name a service not running).
        self.service = validate_service_argument(service)
        self.processing_mode = validate_processing_mode(processing_mode)

    @property
    def adaptive_pool(self):
        """Whether the pool is resized between epochs (`data.pool`).

        It is when both `num_threads` and the pool are left to keras_stage
        and the stage runs in this process.
        """
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
        # A stage that waits on IO needs N real threads even on 2 cores.
        return max(self.num_threads, cpus)

    def get_config(self):
        return {
            "capacity": self.capacity,
            "num_threads": self.num_threads,
            "closed_exception_types": self.closed_exception_types,
            "ignored_exception_types": self.ignored_exception_types,
            "timeout": self.timeout,
            "thread_pool_size": self.thread_pool_size,
            "deterministic": self.deterministic,
            "name": self.name,
            "device": self.device,
            "stream": self.stream,
            "pack_transfer": self.pack_transfer,
            "service": self.service,
            "processing_mode": self.processing_mode,
        }

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"StageOptions({args})"
