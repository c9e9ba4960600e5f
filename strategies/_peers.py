"""A bounded wait for a cluster's peers, and SIGTERM that still ends the process meanwhile.

`MultiWorkerMirroredStrategy` blocks in C++ (`context.ensure_initialized`) until every
worker has joined; a peer that never starts held `tfscale-train` for 12+ minutes with no
output. So before TensorFlow's blocking init, each worker probes its peers' gRPC ports
(the way `tpu` probes its address) until all accept a connection, for at most
`cluster_timeout` seconds, then fails naming the tasks that never came up. Every worker
listens on its own port meanwhile (a plain socket, closed before TensorFlow binds the
port), so peers that all probe first do not wait for each other forever.

TensorFlow's coordination agent also installs a C++ SIGTERM handler (its preemption
notifier) that only records the signal: the process ignored SIGTERM for good.
`tfscale.compat.tf_sigterm` keeps the default action during TensorFlow's init, and it is
restored afterwards (tfscale's own backup callback installs its handler in `fit`).
"""

import socket
import struct
import threading
import time

from tfscale import _strategy_spec as _spec
from tfscale.compat.tf_sigterm import SigtermDefault
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._options import check

__all__ = ["DEFAULT_CLUSTER_TIMEOUT", "ClusterTimeoutError", "build_within", "check_cluster_timeout"]

DEFAULT_CLUSTER_TIMEOUT = _spec.DEFAULT_CLUSTER_TIMEOUT  # seconds (public: tfscale.strategies)
_PROBE_SECONDS = 0.5
_RETRY_SECONDS = 0.2
_COLLECTIVE_TASKS = ("chief", "worker")


class ClusterTimeoutError(StrategyError):
    """Peers of the cluster did not start within `cluster_timeout` (a failed run, exit 1).

    Attributes:
        missing: the ("type", index) of each task that never started.
    """

    exit_status = 1

    def __init__(self, message, missing=()):
        super().__init__(message)
        self.missing = tuple(missing)


def check_cluster_timeout(value):
    """`value` as float seconds if it is a positive finite number, else `StrategyError`."""
    return float(check("cluster_timeout", value))


def _split(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _reachable(address):
    try:
        socket.create_connection(_split(address), timeout=_PROBE_SECONDS).close()
        return True
    except (OSError, ValueError):
        return False


class _Listener:
    """Accepts (and drops) connections on this task's port until TensorFlow needs it."""

    def __init__(self, address):
        self._sock = None
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in _split(address)[0] else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", _split(address)[1]))
            sock.listen(64)
            self._sock = sock
            self._thread = threading.Thread(target=self._accept, name="tfscale-peer-listen", daemon=True)
            self._thread.start()
        except (OSError, ValueError):
            pass  # The port is taken or odd: TensorFlow reports that itself when it binds.

    def _accept(self):
        # Dropped with a reset (linger 0), not a FIN: a connection this side closes first
        # would sit in TIME_WAIT on this task's port, and a later bind of the port without
        # SO_REUSEADDR would fail (seen once in a full run, in the bind test).
        linger = struct.pack("ii", 1, 0)
        while True:
            try:
                connection = self._sock.accept()[0]
            except OSError:
                return  # Closed.
            try:
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            except OSError:
                pass
            connection.close()

    def close(self):
        if self._sock is None:
            return
        # close() alone leaves a listener blocked in accept() holding the port (Linux keeps
        # the socket open for the blocked call), and TensorFlow's bind then fails;
        # shutdown() wakes the accept first.
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


def wait_for_peers(cluster, cluster_timeout):
    """Returns once every other chief/worker task's port accepts connections.

    Raises:
        ClusterTimeoutError: after `cluster_timeout` seconds, naming the tasks still missing.
    """
    me = (cluster.task_type, cluster.task_index)
    pending = [(f"{t}:{i}", a) for t, i, a in cluster.tasks() if t in _COLLECTIVE_TASKS and (t, i) != me]
    listener = _Listener(cluster.task_address())
    deadline = time.monotonic() + cluster_timeout
    try:
        while True:
            pending = [(label, a) for label, a in pending if not _reachable(a)]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise ClusterTimeoutError(
                    f"Task {cluster.task_label} waited cluster_timeout={cluster_timeout:g} s for its "
                    f"peers: {', '.join(f'{label} ({a})' for label, a in pending)} never started. "
                    "Expected every task of the cluster running (raise --cluster_timeout for slow starts).",
                    missing=[tuple(label.split(":")) for label, _ in pending],
                )
            time.sleep(_RETRY_SECONDS)
    finally:
        listener.close()


def build_within(cluster, cluster_timeout, build):
    """Waits for the peers of `cluster` (at most `cluster_timeout` s), then returns `build()`.

    Raises:
        ClusterTimeoutError: the peers did not all start in time; names those missing.
    """
    if cluster.is_multi_worker:
        wait_for_peers(cluster, cluster_timeout)
    with SigtermDefault():
        return build()
