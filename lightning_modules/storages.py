"""The Optuna storages that ``lm-zoo tune`` and ``lm-zoo search`` share: opening a ``--storage`` URL, the gRPC storage
server that workers on other machines reach over the network, and the liveness of trials where Optuna has no
heartbeat.

One search or study over many machines is Optuna's gRPC storage proxy (``lm-zoo search serve``) in front of a
database: the workers need only the server's address (``grpc://HOST:PORT``) and pip packages, no database driver
and no shared file. Optuna's heartbeat (``RDBStorage(heartbeat_interval=...)``, which fails the trial of a killed
worker) exists only for a database opened directly: ``GrpcStorageProxy`` and ``JournalStorage`` are not
``BaseHeartbeat`` storages, and the proxy has no call that records one. So a worker on such a storage writes a
counter into its running trial's system attributes (:func:`beating`), and :class:`SilentTrials` fails a running trial
whose counter has not moved for ``GRACE_BEATS`` of its intervals. The watcher compares the values it reads at times
of its own clock, never the clocks of two machines: the server runs it continuously, and every worker runs it too
whenever it reads the store, so a killed worker's evaluation is failed whether or not a server is there.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import optuna  # the tune and search extras (pip install "lm-zoo[search]")

from zoo.errors import ConfigError, DataError

GRPC = "grpc://"
DEFAULT_PORT = 13000  # Optuna's own default for the proxy
BEAT = "lm-zoo:heartbeat"  # a trial system attribute: [beats so far, seconds between beats]
GRACE_BEATS = 4  # a trial whose heartbeat has not moved for this many of its intervals is failed
READY_SECONDS = 5.0  # how long opening a grpc:// storage waits for the server to answer


def grpc_address(url: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``grpc://HOST[:PORT]`` storage URL (``[::1]`` for IPv6), ``None`` for another URL.

    Raises:
        ConfigError: a ``grpc://`` URL without a host, with a port that is no port, or with a path.
    """
    if not url.startswith(GRPC):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigError(
            f"--storage {url}: the port must be a number from 1 to 65535, e.g. grpc://HOST:13000"
        ) from None
    if not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"--storage {url}: write grpc://HOST:PORT, the address lm-zoo search serve listens on")
    return parts.hostname, DEFAULT_PORT if port is None else port


def host_port(host: str, port: int) -> str:
    """``HOST:PORT`` as gRPC and URLs write it: an IPv6 address in brackets (``[::1]:13000``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback only (``127.0.0.1``, ``::1``, ``localhost``): a server listening
    there cannot be reached from another machine."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def open_storage(url: str, heartbeat: int | None = None) -> optuna.storages.BaseStorage:
    """The Optuna storage a ``--storage`` URL names.

    Args:
        url: ``grpc://HOST:PORT`` (an ``lm-zoo search serve``), a journal file ending in ``.log``, or an SQLAlchemy
            URL (``sqlite:///FILE.db``, ``postgresql://USER@HOST/DB``, ...).
        heartbeat: for a database opened directly, Optuna's heartbeat interval in seconds (a running trial silent
            for ``GRACE_BEATS`` of them is failed); ``None``: no heartbeat. The other storages have none
            (:func:`beating` stands in for it).

    Raises:
        ConfigError: a malformed ``grpc://`` URL.
        DataError: no server answers at a ``grpc://`` address within ``READY_SECONDS``.
    """
    address = grpc_address(url)
    if address is not None:
        host, port = address
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # the proxy is "experimental"
            # The proxy writes f"{host}:{port}" for gRPC: an IPv6 address (urlsplit took its brackets off) needs them.
            proxy = optuna.storages.GrpcStorageProxy(host=f"[{host}]" if ":" in host else host, port=port)
        try:
            proxy.wait_server_ready(timeout=READY_SECONDS)
        except ConnectionError:
            proxy.close()
            raise DataError(
                f"--storage {url}: no storage server answers there within {READY_SECONDS:g}s: start one with "
                "lm-zoo search serve --storage sqlite:///FILE.db --port PORT, and check the host, port and firewall"
            ) from None
        return proxy
    if url.endswith(".log"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url))
    if heartbeat is None:
        return optuna.storages.get_storage(url)  # Optuna's in-process cache in front of the database
    with warnings.catch_warnings():
        # Heartbeats and failing stale trials are "experimental" in Optuna (since 2.9): what the search relies on.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat, grace_period=GRACE_BEATS * heartbeat)


def has_optuna_heartbeat(storage: optuna.storages.BaseStorage) -> bool:
    """Whether Optuna's own heartbeat keeps this storage's trials (a database opened with a heartbeat interval)."""
    # Optuna exports no test for it (``is_heartbeat_enabled`` is private); only RDBStorage takes an interval.
    return isinstance(storage, optuna.storages.RDBStorage) and storage.heartbeat_interval is not None


# ------------------------------------------------------------------------------------------------- liveness
@contextlib.contextmanager
def beating(storage: optuna.storages.BaseStorage, trial_id: int, interval: float) -> Iterator[None]:
    """While the block runs, the trial's heartbeat (:data:`BEAT`) is written every ``interval`` seconds: the first
    before the block starts, the others by a daemon thread.

    A beat that the storage refuses because the trial has finished (a watcher failed it) ends the thread; one that
    cannot reach the server is tried again at the next beat, so a server restarted within the grace period loses
    nothing.
    """
    stop = threading.Event()
    count = itertools.count(1)

    def beat() -> bool:
        """One beat; ``False`` once the storage says the trial has finished."""
        try:
            storage.set_trial_system_attr(trial_id, BEAT, [next(count), interval])
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        except Exception:  # noqa: BLE001 - the network: the next beat tries again, the trial's own calls report
            pass
        return True

    def beats() -> None:
        while not stop.wait(interval) and beat():
            pass

    # The first beat here, before the block runs, not when the thread first gets to run: a worker killed before any
    # beat would leave a trial that no watcher can tell from a live one, running (and holding its claim) for good.
    thread = threading.Thread(target=beats, name=f"lm-zoo heartbeat of trial {trial_id}", daemon=True)
    if beat():
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()


@dataclass
class SilentTrials:
    """Fails the running trials of a study whose heartbeat (:func:`beating`) has not moved for ``GRACE_BEATS`` of
    their intervals, as seen by this watcher's own clock between its calls.

    Trials without the attribute are left alone: their workers use Optuna's heartbeat (a database opened directly)
    or were killed before their first beat, a window of one storage call.
    """

    study_name: str
    seen: dict[int, tuple[Any, float]] = field(default_factory=dict)  # trial id -> (its heartbeat, when it changed)

    def check(self, storage: optuna.storages.BaseStorage, now: float | None = None) -> list[int]:
        """One look at the study's running trials; returns the numbers of those it failed."""
        now = time.monotonic() if now is None else now
        try:
            study_id = storage.get_study_id_from_name(self.study_name)
        except KeyError:  # no worker has created the study yet
            return []
        running = storage.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        failed = []
        for trial in running:
            beat = trial.system_attrs.get(BEAT)
            if beat is None:
                continue
            last = self.seen.get(trial._trial_id)
            if last is None or last[0] != beat:
                self.seen[trial._trial_id] = (beat, now)
                continue
            if now - last[1] > GRACE_BEATS * float(beat[1]):
                try:
                    if storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL):
                        failed.append(trial.number)
                except optuna.exceptions.UpdateFinishedTrialError:  # its worker finished it, or another watcher
                    pass
        alive = {trial._trial_id for trial in running}
        self.seen = {key: value for key, value in self.seen.items() if key in alive}
        return failed


# --------------------------------------------------------------------------------------------------- server
def check_bindable(host: str, port: int) -> None:
    """Refuse an address this process cannot listen on, naming why (taken, not this machine's, no such host).

    Raises:
        DataError: the reason, in one line.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a port in TIME_WAIT is free
            probe.bind(address)
    except OSError as error:
        reason = error.strerror or str(error)
        raise DataError(f"--host {host} --port {port}: cannot listen there ({reason.lower()})") from None


class StorageServer:
    """Optuna's gRPC storage proxy in front of a database, with a :class:`SilentTrials` watcher in a thread.

    Built here rather than with ``optuna.storages.run_grpc_proxy_server`` for two things that function does not
    offer: a port that is taken is refused (gRPC binds with ``SO_REUSEPORT`` by default, so a second server on the
    same port starts without complaint and the workers are shared out between two stores), and the bound port is
    known when ``port`` is 0.

    Args:
        url: the database (an SQLAlchemy URL); Optuna's proxy serves no journal file.
        host: the address to listen on (``127.0.0.1``: this machine only; ``0.0.0.0`` or ``::``: every interface).
        port: the port (0: one the system picks, then in :attr:`port`).
        watch: the study whose silent trials the server fails (``None``: none).
        poll: seconds between two looks of the watcher.

    Raises:
        ConfigError: a journal file or a ``grpc://`` URL.
        DataError: the address cannot be bound (taken, or not this machine's).
    """

    def __init__(self, url: str, host: str, port: int, watch: str | None = None, poll: float = 1.0) -> None:
        import grpc  # the search extra, with optuna
        from optuna.storages._grpc.auto_generated.api_pb2_grpc import add_StorageServiceServicer_to_server
        from optuna.storages._grpc.servicer import OptunaStorageProxyService

        if url.startswith(GRPC):
            raise ConfigError(f"--storage {url}: the server needs the database itself, e.g. sqlite:///search.db")
        if url.endswith(".log"):
            raise ConfigError(
                f"--storage {url}: Optuna's gRPC proxy serves a database, not a journal file: use sqlite:///FILE.db"
            )
        check_bindable(host, port)  # gRPC's own refusal is a log line of its C core, then a bare RuntimeError
        self.storage = open_storage(url)
        # Ten threads, as Optuna's own server: a worker's calls are short; a heartbeat is one call.
        self.server = grpc.server(ThreadPoolExecutor(max_workers=10), options=[("grpc.so_reuseport", 0)])
        add_StorageServiceServicer_to_server(OptunaStorageProxyService(self.storage), self.server)
        try:
            self.port = self.server.add_insecure_port(host_port(host, port))
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise DataError(
                f"{host}:{port}: cannot listen there (the port is taken, or the host is not this machine's)"
            )
        self.watcher = SilentTrials(watch) if watch else None
        self.failed: list[int] = []
        self._stop = threading.Event()
        self._poll = poll
        self._thread = threading.Thread(target=self._watch, name="lm-zoo silent-trial watcher", daemon=True)

    def start(self) -> StorageServer:
        self.server.start()
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self._poll):
            if self.watcher is not None:
                try:
                    self.failed += self.watcher.check(self.storage)
                except Exception:  # noqa: BLE001 - a database hiccup: the next look tries again
                    pass

    def wait(self) -> None:
        """Block until :meth:`stop` (or Ctrl-C in the calling thread)."""
        # Short sleeps, not grpc's wait_for_termination: a Ctrl-C that landed while its Condition.wait took its lock
        # back left the lock half released, and the server died of "RuntimeError: release unlocked lock" instead of
        # stopping (tests/test_search_network.py, once, beside another test worker). A sleep is interrupted cleanly.
        while not self._stop.is_set():
            time.sleep(0.2)

    def stop(self, grace: float = 1.0) -> None:
        """Stop listening (calls under way get ``grace`` seconds) and stop the watcher."""
        self._stop.set()
        self.server.stop(grace).wait()
