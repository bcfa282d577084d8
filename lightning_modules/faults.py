"""How a run of several processes ends when one of them stops, so that no process is left waiting in a collective.

Every process of a DDP run takes part in each step's collectives (the gradients' all-reduce, the divergence check's
gather, the checkpoint's gather of every rank's state). A process that stops on its own leaves the others in their
next collective: with gloo a traceback about a reset connection, with NCCL a wait until the process group's timeout.
So each way of ending is made a decision every rank knows:

- **A signal** (SIGINT, SIGTERM) noted on any rank: each rank's note travels with its loss in the divergence check's
  gather (:class:`lightning_modules.divergence.DivergenceGuard`, read a step later), so every rank
  learns at the same step that some rank was signalled; all of them write the same ``last.ckpt`` there and stop
  (:class:`checkpoints.ckpt_write.LastCheckpoint`).
- **An exception on one rank**: before it leaves, the rank writes what stopped it into the run's rendezvous store
  (:func:`report_stop`), which every rank reaches; the others' next collective then fails, and :func:`peer_lost` turns
  that failure into one line naming the rank and its error.
- **A rank that is killed** (SIGKILL, the OOM killer) says nothing: :func:`peer_lost` finds, among the ranks of this
  machine, the process that is gone (each rank writes its host and process id into the store at the start,
  :func:`watch_peers`). A rank on another machine cannot be looked up there: each rank counts a heartbeat in the
  store every :data:`HEARTBEAT_SECONDS`, and the rank whose count has stopped is the one named.

- **A rank process this one started** (Lightning's launcher starts the other ranks of a machine from rank 0) is
  watched by :func:`watch_rank_processes`, in place of Lightning's observer, which killed rank 0 within 5 s of any
  rank's nonzero exit: before its line, even while it wrote the checkpoint of a stop every rank agreed on. Rank 0 now
  has :data:`CHILD_GRACE_SECONDS` to stop on its own; one stuck past that (a collective that waits for the lost rank)
  is killed with the others, after one line.

The process group's timeout bounds what no failure report reaches (a peer that hangs rather than exits: a stuck
NCCL kernel, a process stopped by SIGSTOP): :data:`DEFAULT_PROCESS_GROUP_TIMEOUT`, a recorded setting of ``lm-zoo fit``
(``--process_group_timeout``). When it runs out, a rank of this machine found stopped is named as frozen.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from zoo.errors import PeerLost, clip

# Seconds a collective may wait for the other ranks before the run fails: PyTorch's default is 30 minutes of silence.
# Long enough for rank 0 to write a large model's checkpoint while the others wait at the next collective (GBW's
# 4 x 2048 model writes some 13 GB), short enough that a hung peer does not hold a GPU node for half an hour.
DEFAULT_PROCESS_GROUP_TIMEOUT = 600
_PREFIX = "lm-zoo/"  # this module's keys in the rendezvous store, apart from torch's own
# A killed process's sockets are closed (so the others' collective fails) before the kernel makes it a zombie: on a
# loaded machine a rank can look for it in between and find it still running. It looks again for this long (seconds)
# before saying that no rank of this machine is gone.
_GONE_WAIT, _GONE_POLL = 2.0, 0.05
#: Seconds between two beats of a rank's heartbeat in the store (a thread's one small write); a rank whose count has not
#: moved over three of them is no longer there.
HEARTBEAT_SECONDS = 1.0
#: Seconds between two looks at the rank processes this one started; and how long, once one of them has ended with a
#: nonzero status, this process has to stop on its own (naming it: :func:`peer_lost`) before it is killed with them.
#: Its own stop takes up to ``_GONE_WAIT`` and three heartbeats to name the rank, then its teardown.
CHILD_POLL_SECONDS, CHILD_GRACE_SECONDS = 1.0, 20.0
# A rank's exit statuses that end the run as every rank agreed: done, or the stop at a signal (lm-zoo's exit 130 or
# 143, zoo.errors.Interrupted), which rank 0 makes at the same step, whatever it still has to write.
_AGREED_ENDS = (0, 128 + signal.SIGINT, 128 + signal.SIGTERM)


@dataclass
class _Peers:
    store: Any  # the process group's store (a TCPStore's client), under our prefix
    rank: int
    world_size: int
    stop_beating: threading.Event | None = None


def _beat(store: Any, rank: int, stop: threading.Event) -> None:
    """Count this rank's heartbeat in the store until the run is over or the store is gone (rank 0's process)."""
    while not stop.wait(HEARTBEAT_SECONDS):
        try:
            store.add(f"beat/{rank}", 1)
        except Exception:  # noqa: BLE001 - the store went with rank 0: nothing is left to tell
            return


_peers: _Peers | None = None  # the multi-process run this process takes part in, once watch_peers has run
# The rank processes this one started, by process id: reaped only through their Popen (Popen.poll), so that whoever
# looks first, the watch or _fate, the exit status stays there for the other.
_children: dict[int, subprocess.Popen] = {}


def watch_peers(rank: int, world_size: int) -> None:
    """Record this rank's host and process id in the run's rendezvous store, for :func:`peer_lost` on the others.

    Called on every rank once the process group is up (a no-op without one, or with one process).
    """
    global _peers
    if world_size < 2 or not dist.is_available() or not dist.is_initialized():
        return
    # torch exposes the default group's store only privately; a store of our own would need an address and a port
    # that every launcher (Lightning's, torchrun, SLURM) sets up differently, while this one they all share.
    store = dist.PrefixStore(_PREFIX, dist.distributed_c10d._get_default_store())
    store.set(f"process/{rank}", f"{socket.gethostname()} {os.getpid()}")
    forget_peers()  # a fit run again in this process: the earlier run's heartbeat stops
    stop = threading.Event()
    threading.Thread(target=_beat, args=(store, rank, stop), name="lm-zoo heartbeat", daemon=True).start()
    _peers = _Peers(store, rank, world_size, stop)


def forget_peers() -> None:
    """The run is over: this process no longer speaks for a rank, and its heartbeat stops."""
    global _peers
    if _peers is not None and _peers.stop_beating is not None:
        _peers.stop_beating.set()
    _peers = None


def watch_rank_processes(children: list[subprocess.Popen]) -> None:
    """Watch the rank processes this one started, in a thread, until every one has ended as the ranks agreed (status
    0, or the stop at a signal); if one exits otherwise and this process has not stopped :data:`CHILD_GRACE_SECONDS`
    later, say so in one line and kill them all, this process too (what Lightning's observer does at once: a
    collective waiting for a lost rank, NCCL's above all, returns only at the process group's timeout).

    Lightning's launcher calls it with the processes it started
    (:func:`lightning_modules.lightning_private.watch_rank_processes_with`).
    """
    _children.update((child.pid, child) for child in children)
    watch = threading.Thread(
        target=_watch, args=(children, os.getpid(), CHILD_GRACE_SECONDS), name="lm-zoo rank watch", daemon=True
    )
    watch.start()


def _watch(children: list[subprocess.Popen], main_pid: int, grace: float) -> None:
    failed_at: float | None = None
    while True:
        time.sleep(CHILD_POLL_SECONDS)
        codes = [child.poll() for child in children]
        if all(code in _AGREED_ENDS for code in codes):
            return
        if failed_at is None and any(code not in (None, *_AGREED_ENDS) for code in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at >= grace:
            break
    own = _peers.rank if _peers is not None else 0  # the launching process is its machine's first rank
    ended = "; ".join(
        f"rank {own + i} (process {child.pid}) {_ended(child.returncode)}"
        for i, child in enumerate(children, start=1)
        if child.returncode not in (None, *_AGREED_ENDS)
    )
    # Printed here, not raised: the main thread is the one waiting in the collective, and SIGKILL is what ends that.
    print(
        f"lm-zoo: error: {ended}, and rank {own} did not stop within {grace:.0f} s (a collective waits for it), so "
        "every process of the run is killed; the last checkpoint on disk is whole: once the cause is fixed, the same "
        "command with --ckpt_path last resumes the run",
        file=sys.stderr,
        flush=True,
    )
    for child in children:
        if child.poll() is None:
            child.kill()
    os.kill(main_pid, signal.SIGKILL)


def report_stop(error: BaseException) -> None:
    """Write into the store that this rank stops, and why, before it leaves the run (best effort: a store that cannot
    be reached any more changes nothing)."""
    if _peers is None:
        return
    try:
        _peers.store.set(f"stopped/{_peers.rank}", f"{type(error).__name__}: {clip(str(error))}")
    except Exception:  # noqa: BLE001 - the store went with rank 0's machine: the others learn it from their own error
        pass


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is a collective that failed because another process of the run
    went away or stopped answering: torch's distributed errors, and gloo's reset or closed connections, which reach
    Python as a plain ``RuntimeError``."""
    current: BaseException | None = error
    seen = 0
    while current is not None and seen < 10:
        if isinstance(current, dist.DistError):
            return True
        text = str(current)
        if isinstance(current, RuntimeError) and "gloo" in text and ("by peer" in text or "Timed out" in text):
            return True
        current, seen = current.__cause__ or current.__context__, seen + 1
    return False


def peer_lost(error: BaseException) -> PeerLost | None:
    """The one line for a collective that failed because another rank stopped, naming that rank and what happened;
    ``None`` when ``error`` is something else, or this process is in no multi-process run. Once it is such a failure,
    this process ignores SIGTERM from then on: it is on its way out, and the line goes first."""
    if _peers is None or not is_peer_failure(error):
        return None
    # From here this process only says why it stops and leaves, so a SIGTERM no longer ends it first: torchrun's agent
    # SIGTERMs every surviving rank as soon as it sees one die, and with SIGTERM's default (Lightning's teardown puts
    # it back on the way here) that signal ended this rank while it looked for the lost one below, without its line
    # (tests/test_ddp.py, torchrun, SIGKILL). Ignored, not noted: the process is leaving anyway.
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return PeerLost(
        f"{_what_stopped(_peers)}, so rank {_peers.rank} stops too; the last checkpoint on disk is whole: once the "
        "cause is fixed, the same command with --ckpt_path last resumes the run"
    )


def _what_stopped(peers: _Peers) -> str:
    """What the store and this machine say about the other ranks: their own reports first, else those gone."""
    others = [rank for rank in range(peers.world_size) if rank != peers.rank]
    try:
        reported = [rank for rank in others if peers.store.check([f"stopped/{rank}"])]
        if reported:
            return "; ".join(f"rank {r} stopped ({peers.store.get(f'stopped/{r}').decode()})" for r in reported)
        places = {rank: peers.store.get(f"process/{rank}").decode().split() for rank in others}
    except Exception:  # noqa: BLE001 - the store is served from rank 0's process: it went with it
        return "rank 0 was lost (killed, or its machine went away), and the run's rendezvous store with it"
    host = socket.gethostname()
    here = [(rank, int(pid)) for rank, (where, pid) in places.items() if where == host]
    deadline = time.monotonic() + _GONE_WAIT
    while here:
        gone = [f"rank {rank} (process {pid}) {fate}" for rank, pid in here if (fate := _fate(pid)) is not None]
        if gone:
            return "; ".join(gone)
        if time.monotonic() >= deadline:
            break
        time.sleep(_GONE_POLL)
    silent = _silent_ranks(peers, others)
    if silent:
        return "; ".join(
            f"rank {rank} (process {places[rank][1]} on {places[rank][0]}) stopped answering (killed, frozen, or its "
            "machine lost)"
            for rank in silent
        )
    return "another rank stopped without a report (on another machine, or killed where this one cannot see it)"


def _silent_ranks(peers: _Peers, others: list[int]) -> list[int]:
    """The ranks among ``others`` whose heartbeat count does not move over three beats (every rank's thread counts
    one a beat, wherever it runs), or none if the store cannot say."""
    try:
        before = {rank: peers.store.add(f"beat/{rank}", 0) for rank in others}  # add 0: a read that needs no key
        time.sleep(3 * HEARTBEAT_SECONDS)
        return [rank for rank in others if peers.store.add(f"beat/{rank}", 0) == before[rank]]
    except Exception:  # noqa: BLE001 - the store is rank 0's: gone with it
        return []


def _fate(pid: int) -> str | None:
    """How process ``pid`` of this machine ended or froze, ``None`` while it runs.

    A rank this process started (:func:`watch_rank_processes`) is asked through its ``Popen``, which keeps its exit
    status whoever reaped it. Any other is looked up in /proc first: whether it runs, is stopped, or has ended; only an
    ended one is reaped, if it is a child of this process, for the exit status that names its signal. The other order
    raced with the child's end: a rank learns of a killed peer when its sockets close, before the kernel makes it a
    zombie, so a reap found it still running and the look at /proc just after found a zombie, named gone without its
    signal (tests/test_ddp.py failed so once in CI at 45d7c8f).
    """
    child = _children.get(pid)
    if child is not None and child.poll() is not None:  # a rank this process started (watch_rank_processes)
        return _ended(child.returncode)
    state = _process_state(pid)
    if state in ("T", "t"):  # a stopped process: SIGSTOP, or a debugger's stop; it never reaches the collective
        return "is frozen (stopped, by SIGSTOP or a debugger: neither running nor gone)"
    if child is not None or state not in (None, "Z", "X"):
        return None  # running, or still on its way out: the caller looks again
    try:
        reaped, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not this process's child, or reaped already (Lightning's own observer polls them)
        reaped, status = 0, 0
    if reaped:
        return _ended(os.waitstatus_to_exitcode(status))
    return "is gone (killed: SIGKILL or the OOM killer leave no word)"


def _ended(exit_code: int) -> str:
    """How a process ended, from its exit code as ``Popen.returncode`` gives it (minus the signal that killed it)."""
    return f"was killed by {_signal_name(-exit_code)}" if exit_code < 0 else f"exited with status {exit_code}"


def _process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter in /proc (``R``, ``S``, ``T``, ``Z`` zombie, ...), ``None`` if it has none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
