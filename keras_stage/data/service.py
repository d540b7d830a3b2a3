"""The tf.data service: staged work on other machines' CPUs.

The protocol has no authentication or encryption, and TensorFlow's servers
listen on every interface: keep them on a private network or behind a
firewall.
"""

import ipaddress
import logging
import socket
import urllib.parse

import tensorflow as tf

from keras_stage import _compat

logger = logging.getLogger("keras_stage")

__all__ = [
    "DISTRIBUTED_EPOCH",
    "PARALLEL_EPOCHS",
    "LocalService",
    "check_dispatcher",
]

# Each element once per epoch, split across the workers (the default).
DISTRIBUTED_EPOCH = "distributed_epoch"
# Every worker runs the whole dataset: each element once per worker.
PARALLEL_EPOCHS = "parallel_epochs"
PROCESSING_MODES = (DISTRIBUTED_EPOCH, PARALLEL_EPOCHS)

_PROTOCOL = "grpc"


def validate_service_argument(service):
    """`service` if it has the form `"grpc://host:port"` (or is None);
    `check_dispatcher` checks that it answers, when a stage is built."""
    if service is None:
        return None
    host, port = _split(service) if isinstance(service, str) else (None, None)
    if host is None or port is None:
        raise ValueError(
            "Invalid value for argument `service`. Expected the address of "
            'a tf.data service dispatcher, "grpc://host:port" (e.g. '
            "LocalService().target), or None. "
            f"Received: service={service!r}"
        )
    return service


def validate_processing_mode(processing_mode):
    """`processing_mode` if it is one the tf.data service knows."""
    if processing_mode not in PROCESSING_MODES:
        raise ValueError(
            "Invalid value for argument `processing_mode`. Expected "
            f'"{DISTRIBUTED_EPOCH}" (each element once per epoch, split '
            f'across the workers) or "{PARALLEL_EPOCHS}" (every worker runs '
            f"the whole dataset). Received: processing_mode={processing_mode!r}"
        )
    return processing_mode


def _split(service):
    parsed = urllib.parse.urlsplit(service)
    if parsed.scheme != _PROTOCOL or parsed.path not in ("", "/"):
        return None, None
    try:
        port = parsed.port
    except ValueError:
        return None, None
    return parsed.hostname, port


def check_dispatcher(address, timeout=5.0):
    """Raises `ConnectionError` unless something listens at `address`.

    The tf.data service client retries an unreachable dispatcher for an
    hour before it reports anything; this TCP connect fails at once.

    Args:
        address: The dispatcher, `"grpc://host:port"`.
        timeout: Seconds to wait for the connection. Defaults to `5.0`.

    Raises:
        ConnectionError: Nothing accepts connections at `address`.

    Example:

    >>> from keras_stage.data.service import LocalService, check_dispatcher
    >>> with LocalService(num_workers=1) as service:
    ...     check_dispatcher(service.target)
    """
    host, port = _split(validate_service_argument(address))
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as error:
        raise ConnectionError(
            f"Cannot reach the tf.data service dispatcher at {address!r} "
            f"({error}). Start a dispatcher there (for development: "
            "keras_stage.data.service.LocalService(num_workers=2), whose "
            "`.target` is the address to pass), or fix the `service` "
            "argument of the stage."
        ) from error


def distribute(dataset, service, processing_mode):
    """`dataset` run by the service's workers (each iteration: a new job)."""
    check_dispatcher(service)
    return dataset.apply(
        tf.data.experimental.service.distribute(
            processing_mode=processing_mode,
            service=service,
        )
    )


def _is_loopback(host):
    """Whether `host` names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class LocalService:
    """A tf.data service dispatcher and workers in this process.

    For development and tests (the workers share this process's CPUs); in
    production run `tf.data.experimental.service.DispatchServer` and a
    `WorkerServer` per machine. Its servers listen on every interface,
    whatever `host` says, without authentication: any machine reaching the
    ports it logs can read the data and run dataset graphs in this process.
    Confine them with a firewall or a private network.

    Args:
        num_workers: Workers to start. Defaults to `2`.
        host: The address the servers announce to clients (not where they
            listen: that is every interface). Defaults to `"localhost"`.
        port: The dispatcher's port; `0` picks a free one. Defaults to `0`.
        heartbeat_ms: How often workers report to the dispatcher. Defaults
            to `500` (TensorFlow's default is 30 s).
        allow_remote: Whether `host` may be an address other machines use
            (not loopback). Defaults to `False`.

    Example:

    >>> import tensorflow as tf
    >>> from keras_stage.data import stage
    >>> from keras_stage.data.service import LocalService
    >>> with LocalService(num_workers=2) as service:
    ...     numbers = tf.data.Dataset.range(6)
    ...     staged = stage(numbers, lambda x: x * 10, service=service.target)
    ...     sorted(int(x) for x in staged)
    [0, 10, 20, 30, 40, 50]
    """

    def __init__(
        self,
        num_workers=2,
        host="localhost",
        port=0,
        heartbeat_ms=500,
        allow_remote=False,
    ):
        if not (
            isinstance(num_workers, int)
            and not isinstance(num_workers, bool)
            and num_workers >= 0
        ):
            raise ValueError(
                "Invalid value for argument `num_workers`. Expected a "
                f"non-negative int. Received: num_workers={num_workers!r}"
            )
        if not allow_remote and not _is_loopback(host):
            raise ValueError(
                f"Invalid value for argument `host`: {host!r} is not a "
                "loopback address, so other machines would be told to "
                "connect to this LocalService, which has no authentication "
                "(it listens on every interface in any case). Pass "
                "allow_remote=True to serve other machines deliberately, "
                "behind a firewall or on a private network, or use "
                f"host='localhost'. Received: host={host!r}"
            )
        service = tf.data.experimental.service
        self._host = host
        self._heartbeat_ms = heartbeat_ms
        self._dispatcher = service.DispatchServer(
            service.DispatcherConfig(
                port=port,
                protocol=_PROTOCOL,
                worker_timeout_ms=4 * heartbeat_ms,
            )
        )
        port = int(self._dispatcher.target.rsplit(":", 1)[1])
        self._address = f"{host}:{port}"
        self.workers = []
        self._ports = [port]
        self._started = False
        for _ in range(num_workers):
            self.add_worker()
        self._warn_open_ports(self._ports)
        self._started = True

    @property
    def ports(self):
        """The ports its dispatcher and workers listen on, in that order."""
        return list(self._ports)

    def _warn_open_ports(self, ports):
        logger.warning(
            "LocalService at %s: ports %s (dispatcher %s) listen on every "
            "network interface, and the tf.data service has no "
            "authentication: any host that can reach them can read the "
            "data and run dataset graphs in this process. Confine them with "
            "a firewall or a private network (keras_stage docs: "
            "Distributed, Security).",
            self.target,
            ", ".join(str(p) for p in ports),
            self._ports[0],
        )

    @property
    def target(self):
        """The dispatcher's address, `"grpc://host:port"` (the `service`)."""
        return f"{_PROTOCOL}://{self._address}"

    @property
    def num_workers(self):
        """Workers started and not stopped."""
        return sum(worker is not None for worker in self.workers)

    def add_worker(self):
        """Starts one more worker; returns its index."""
        service = tf.data.experimental.service
        worker = service.WorkerServer(
            service.WorkerConfig(
                dispatcher_address=self._address,
                worker_address=f"{self._host}:%port%",
                protocol=_PROTOCOL,
                heartbeat_interval_ms=self._heartbeat_ms,
            )
        )
        self.workers.append(worker)
        port = _compat.service_server_port(worker)
        self._ports.append(port)
        if self._started:
            self._warn_open_ports([port])  # a worker added later
        return len(self.workers) - 1

    def stop_worker(self, index):
        """Stops worker `index` (as if its machine went away)."""
        worker = self.workers[index]
        if worker is None:
            raise ValueError(
                f"Invalid value for argument `index`: worker {index} is "
                f"already stopped. Received: index={index!r}"
            )
        self.workers[index] = None
        worker.stop()

    def close(self):
        """Stops the workers (each ends its tasks), then the dispatcher."""
        for index, worker in enumerate(self.workers):
            if worker is not None:
                self.workers[index] = None
                worker.stop()
        self._dispatcher.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return (
            f"LocalService(target={self.target!r}, "
            f"num_workers={self.num_workers})"
        )
