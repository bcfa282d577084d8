"""How ``lm-zoo fit`` writes checkpoints so that a killed run can always continue: atomically, and often.

- :class:`AtomicCheckpointIO` writes every checkpoint beside its destination, syncs it to disk and renames it into
  place, so a kill (or a power loss) during a write leaves the previous checkpoint whole.
- :class:`LastCheckpoint` refreshes ``last.ckpt`` during epochs (every N steps or every T of wall time, 30 minutes by
  default) and after every validation, so ``lm-zoo fit --config X --ckpt_path last`` loses little work; and on Ctrl-C
  (SIGINT) or SIGTERM it writes ``last.ckpt`` at the end of the step under way and stops, so nothing is lost.

The CLI installs both by default; in a config::

    last_checkpoint:
      every_n_train_steps: 1000        # or
      train_time_interval: "1:00:00"   # h:m:s; neither set: every 30 minutes; every_n_train_steps: 0 turns it off
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import IO, Any

import fsspec.utils
import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from checkpoints.ckpt_read import unreadable
from lightning_modules.divergence import divergence_guard
from lightning_modules.faults import is_peer_failure
from lightning_modules.lightning_private import (
    restore_lightnings_sigterm_broadcast,
    skip_lightnings_sigterm_broadcast,
    write_last_checkpoint,
    writes_checkpoints_now,
    wrote_at_this_step,
)
from zoo.errors import CheckpointError, ConfigError, Interrupted

DEFAULT_INTERVAL = timedelta(minutes=30)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write a checkpoint to a temporary file in its destination's directory, fsync it, then ``os.replace`` it there.

    Why not Lightning's own ``TorchCheckpointIO`` (2.6, ``lightning.fabric.utilities.cloud_io._atomic_save``): it
    serialises the whole checkpoint into memory (twice: a ``BytesIO`` and its ``getvalue()``), then writes it inside an
    fsspec transaction whose local temporary file comes from ``tempfile.mkstemp()``, i.e. the system temporary
    directory, and is moved into place with ``shutil.move``. When that directory is on another filesystem than the
    checkpoints (a tmpfs ``/tmp``, a container's overlay, a cluster's scratch disk), the move is a *copy into the
    destination*, which a kill cuts short: a truncated ``last.ckpt`` where a good one was. A kill also leaves the
    temporary file behind in ``/tmp``, and nothing is fsynced, so after a power loss the renamed file can be empty.

    Here the temporary file is ``.<name>.<host>.<pid>.tmp`` beside the destination (same filesystem, so the rename is
    atomic; hidden, and not ``*.ckpt``, so ``--ckpt_path last`` never picks it). Leftovers of killed writers on this
    host are removed by the next save to the same path. Remote paths (``s3://``...) go to Lightning's implementation.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path``; the file at ``path`` is, at every moment, the old one or the new one."""
        if storage_options is not None or fsspec.utils.get_protocol(str(path)) != "file":
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        temporary = temporary_path(path)
        try:
            with open(temporary, "wb") as file:  # the usual permissions (umask), unlike mkstemp's 0600
                self.write_to(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except OSError as error:  # a full disk, a quota, a permission taken away mid-run
            temporary.unlink(missing_ok=True)
            raise write_failed(path, error) from error
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(path.parent)  # the rename itself reaches the disk

    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's reader (``fit --ckpt_path``), with a missing, truncated or foreign local file said in one line
        instead of a traceback.

        Always ``weights_only=True``, whatever Lightning passes (it passes ``None``, and for a URL turns that into
        ``False``): an lm-zoo checkpoint holds tensors and plain values only (the resume state included, see
        :mod:`lightning_modules.resume`), so no global needs allowing, and nothing in a file is ever unpickled.
        """
        if fsspec.utils.get_protocol(str(path)) != "file":
            return super().load_checkpoint(path, map_location, weights_only=True)

        if not Path(path).is_file():
            raise CheckpointError(f"checkpoint {path} does not exist: check --ckpt_path (or use --ckpt_path last)")
        try:
            return super().load_checkpoint(path, map_location, weights_only=True)
        except Exception as err:
            raise unreadable(path, err) from None

    def write_to(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        """Serialise ``checkpoint`` into the open temporary file (streamed: no in-memory copy of the whole file)."""
        torch.save(checkpoint, file)


def write_failed(path: Path, error: OSError) -> CheckpointError:
    """The one line for a checkpoint the system refused to write: what failed, that the checkpoint already at
    ``path`` (if any) is whole, and what to do; a write error from inside ``torch.save`` carries no file name."""
    reason = (error.strerror or str(error)).lower()
    kept = f"the previous {path.name} there is whole" if path.is_file() else f"no {path.name} was there before"
    return CheckpointError(
        f"{path}: the checkpoint could not be written ({reason}); {kept}: free some space or fix the permissions, "
        "then resume with --ckpt_path last"
    )


def temporary_path(path: Path) -> Path:
    """The temporary file :class:`AtomicCheckpointIO` writes before renaming it to ``path``."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def remove_stale_temporaries(path: Path) -> None:
    """Delete temporary files of ``path`` left by writers on this host that were killed mid-write."""
    host = socket.gethostname()
    for leftover in path.parent.glob(f".{path.name}.{host}.*.tmp"):
        pid = leftover.name[len(f".{path.name}.{host}.") : -len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LastCheckpoint(ModelCheckpoint):
    """Keep ``last.ckpt`` fresh for resuming: during epochs, after every validation, and when training ends.

    A ``ModelCheckpoint`` that keeps no best-k checkpoints, only ``last.ckpt``, overwritten in place, in the same
    directory as the best checkpoint (the CLI links the two ``dirpath``). Lightning's ``ModelCheckpoint`` refreshes
    ``last.ckpt`` after a validation or at the end only when it also saves a top-k checkpoint there, and takes a step
    or a time trigger but not both with epochs; this subclass adds those two saves, so ``last.ckpt`` is never older
    than the latest validation, the last periodic save, or the end of the run.

    Args:
        dirpath: where ``last.ckpt`` goes (default: the logger's ``version_N/checkpoints``).
        every_n_train_steps: save every this many optimizer steps; ``0`` turns periodic saves off.
        train_time_interval: save when this much wall time has passed since the last save (``"h:m:s"`` in YAML);
            when neither this nor ``every_n_train_steps`` is set, every 30 minutes. Set one of the two, not both.
        verbose: log every save.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        verbose: bool = False,
    ) -> None:
        if every_n_train_steps is not None and train_time_interval is not None:
            raise ConfigError(
                f"last_checkpoint: set every_n_train_steps ({every_n_train_steps}) or train_time_interval "
                f"({train_time_interval}), not both"
            )
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ConfigError(f"last_checkpoint.every_n_train_steps must be >= 0, got {every_n_train_steps}")
        if every_n_train_steps is None and train_time_interval is None:
            train_time_interval = DEFAULT_INTERVAL
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            enable_version_counter=False,  # one last.ckpt, replaced, never last-v1.ckpt beside it
            verbose=verbose,
        )

    # ------------------------------------------------------------------------------------ SIGINT and SIGTERM
    # A signal is only noted when it arrives: a KeyboardInterrupt raised in the middle of a step could leave the
    # weights half updated, and a checkpoint written then would not resume exactly. Under DDP a signal reaches one
    # rank (a scheduler's SIGTERM to one worker) or every rank at a slightly different step (Ctrl-C): each rank's note
    # travels in the step's divergence gather, so every rank learns at the same step that some rank was signalled
    # (DivergenceGuard.agreed_stop, lightning_modules/faults.py). Then on_train_batch_end writes last.ckpt on every
    # rank together (the state a periodic save has, which resumes exactly) and raises Interrupted, which Lightning
    # passes on after its own shutdown and `lm-zoo` turns into one line and exit 130 / 143. Both signals are this
    # callback's during training: Lightning's own SIGTERM handler broadcasts from inside the handler, a collective the
    # other ranks are not in, and makes its rank leave alone. They are set at train start, after Lightning has set its
    # own (which would otherwise call ours and still do both). A second signal of the same kind stops at once.
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._signal: int | None = None
        # The ranks agree on a signal in the divergence guard's gather (faults.py), where the run has a guard.
        self._guard = divergence_guard(trainer)
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            self._previous = {signum: signal.signal(signum, self._note_signal) for signum in self.SIGNALS}
            if self._guard is not None:
                self._broadcast_skipped_on = trainer
                skip_lightnings_sigterm_broadcast(trainer)

    def _note_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum
        if self._guard is not None:
            self._guard.note_signal(signum)  # gathered with the next step's figures
        # The next one of the same kind is at once: Ctrl-C as Python's, SIGTERM as the system's default.
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        again = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        print(
            f"\nlm-zoo: interrupted ({signal.Signals(signum).name}): writing last.ckpt at the end of this step, then "
            f"stopping ({again} again: at once)",
            flush=True,
        )

    def _restore_signals(self) -> None:
        previous, self._previous = getattr(self, "_previous", {}), {}
        if previous and threading.current_thread() is threading.main_thread():
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        trainer = self.__dict__.pop("_broadcast_skipped_on", None)
        if trainer is not None:
            restore_lightnings_sigterm_broadcast(trainer)

    def _agreed_stop(self, trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[int | None, int] | None:
        """(the rank that was signalled, the signal) once every rank knows of it; a run without a divergence guard
        (a module not lm-zoo's) stops on its own rank's note alone."""
        guard = getattr(self, "_guard", None)
        if guard is not None:
            return guard.agreed_stop
        signum = getattr(self, "_signal", None)
        return None if signum is None else (trainer.global_rank, signum)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)  # the periodic save
        agreed = self._agreed_stop(trainer, pl_module)
        if agreed is None:
            return
        rank, signum = agreed
        if not wrote_at_this_step(self, trainer):
            write_last_checkpoint(self, trainer)
        self._restore_signals()
        path = self.last_model_path or None
        where = f" on rank {rank}" if trainer.world_size > 1 else ""
        raise Interrupted(
            f"{signal.Signals(signum).name}{where} at step {trainer.global_step} (epoch {trainer.current_epoch}); "
            + (f"{path} written, from which the run resumes exactly" if path else "no checkpoint written"),
            signum,
            path,
        )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Not when another rank was lost: under torchrun, the agent SIGTERMs the survivors as soon as it sees the loss,
        # while this process is still on its way to the one line that names the lost rank (faults.peer_lost, printed
        # by lm-zoo's error handler). With the handlers given back (a worker's SIGTERM default), that SIGTERM ended it
        # without the line (tests/test_ddp.py, torchrun); kept, the signal is only noted until Lightning's teardown
        # puts back what it found, and from there faults.peer_lost ignores it.
        if not is_peer_failure(exception):
            self._restore_signals()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Save after every validation (also right after a periodic save at the same step: that one predates the
        validation, and a resume from it would have to run the validation again)."""
        if trainer.state.fn == "fit" and not trainer.sanity_checking and not trainer.fast_dev_run:
            write_last_checkpoint(self, trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Save the final state, unless the last save was at this step already; give the signals back."""
        if writes_checkpoints_now(self, trainer):
            write_last_checkpoint(self, trainer)
        # Here, not at on_fit_end: Lightning puts back the handlers it found in its teardown, after training ends and
        # before on_fit_end, so ours go first and Lightning's after them. Put back at on_fit_end, Lightning's SIGTERM
        # handler outlived the fit, and a process that had trained in-process ignored SIGTERM: a multiprocessing
        # Pool's terminate() then waited forever for its workers (GBW's word counting, now and then in the suite).
        self._restore_signals()
