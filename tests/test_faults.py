"""Checkpoints that survive faults: a write killed half-way leaves the previous checkpoint usable, a diverging run
stops naming the step and leaves only finite checkpoints, and the ``last_checkpoint`` options."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import lightning as L
import pytest
import torch
import yaml

import checkpoints
import cli
from checkpoints.ckpt_write import AtomicCheckpointIO, temporary_path
from tests.conftest import one_line_error, quiet_trainer, write_tiny_recipe, write_word_corpus
from zoo.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(workdir: Path) -> Path:
    """The test's folder (conftest's), holding the corpus the recipe reads."""
    write_word_corpus(workdir / "corpus", "faults")
    return workdir


def _recipe(workdir: Path, callbacks: str = "[]", clip: float | None = None) -> Path:
    """The tiny fit with dropout, no logger and a ``last.ckpt`` every 2 steps; ``callbacks`` a YAML list."""
    trainer = {"logger": False, "callbacks": yaml.safe_load(callbacks), "gradient_clip_val": clip}
    return write_tiny_recipe(
        workdir / "recipe.yaml",
        workdir / "corpus",
        workdir / "run",
        trainer=trainer,
        model={"init_args": {"dropout": 0.1}},
        last_checkpoint={"every_n_train_steps": 2},
    )


def _finite(ckpt: dict[str, Any]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ckpt["state_dict"].values() if t.is_floating_point())


# ----------------------------------------------------------------------------------------------- atomic writes
# Run in a child process: the first half of a larger checkpoint's bytes go to disk, then it waits to be killed, so
# the kill lands in the middle of a write whatever the machine's speed.
OVERWRITE = """
import io, os, sys, time
from pathlib import Path
import torch
from checkpoints.ckpt_write import AtomicCheckpointIO

class HalfThenWait(AtomicCheckpointIO):
    def write_to(self, checkpoint, file):
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        file.write(data[: len(data) // 2])
        file.flush()
        os.fsync(file.fileno())
        Path(sys.argv[2]).write_text(str(len(data)))
        for _ in range(6000):  # until SIGKILL; gives up after ~10 minutes so a broken test leaves no orphan
            time.sleep(0.1)
        os._exit(3)

checkpoint = torch.load(sys.argv[1], weights_only=True)
checkpoint["padding"] = torch.ones(2_000_000)  # 8 MB more: the new file is far larger than the old one
HalfThenWait().save_checkpoint(checkpoint, sys.argv[1])
"""


class RecordCheckpointIO(L.Callback):
    """Test helper: remembers the trainer's checkpoint writer."""

    seen: object = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        RecordCheckpointIO.seen = trainer.strategy.checkpoint_io


@pytest.mark.slow
def test_a_write_killed_half_way_leaves_the_previous_checkpoint_usable(workdir: Path) -> None:
    recipe = _recipe(workdir, "[{class_path: tests.test_faults.RecordCheckpointIO}]")
    assert cli.main(["fit", "--config", str(recipe)]) == 0
    assert type(RecordCheckpointIO.seen) is AtomicCheckpointIO  # the CLI's default writer
    last = workdir / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()

    marker = workdir / "half-written"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", OVERWRITE, str(last), str(marker)], env=env)
    try:
        while not marker.exists():
            assert process.poll() is None
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        assert process.wait() == -signal.SIGKILL
    finally:
        process.kill()
    # Killed mid-write: half of the new file sits in the temporary file, the destination is untouched.
    [leftover] = last.parent.glob(".last.ckpt.*.tmp")
    assert leftover.name == temporary_path(last).name.replace(f".{os.getpid()}.", f".{process.pid}.")
    assert leftover.stat().st_size == int(marker.read_text()) // 2 > len(before)
    assert last.read_bytes() == before
    loaded = checkpoints.load(last)  # evaluation loads it...
    assert loaded.training["global_step"] == 8
    # ...and a resumed fit continues from it (Lightning's --ckpt_path last finds it in checkpoint.dirpath); its own
    # first save removes the dead writer's leftover.
    assert cli.main(["fit", "--config", str(recipe), "--ckpt_path", "last", "--trainer.max_epochs", "2"]) == 0
    assert torch.load(last, weights_only=True)["global_step"] == 16
    assert not leftover.exists()
    assert not list(last.parent.glob(".*.tmp"))


class FailHalfWay(AtomicCheckpointIO):
    def write_to(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:
        file.write(b"\0" * 1000)
        raise OSError(28, "No space left on device")


def test_a_write_that_fails_leaves_the_previous_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    with pytest.raises(CheckpointError, match="no space left on device.*the previous last.ckpt there is whole") as info:
        FailHalfWay().save_checkpoint({"step": 2, "w": torch.zeros(3)}, path)
    assert isinstance(info.value.__cause__, OSError)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert list(tmp_path.iterdir()) == [path]


# ------------------------------------------------------------------------------------------------- divergence
class Poison(L.Callback):
    """Test helper: put a NaN into the weights or the gradients at optimizer step ``step``.

    ``where``: ``weights`` before the step's forward pass (the loss becomes NaN), ``gradients`` after its backward
    pass (the loss was finite), ``updated`` after its optimizer step, before that step's checkpoint is written.
    """

    def __init__(self, step: int, where: str) -> None:
        self.step, self.where = step, where

    def _poison(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            tensor.view(-1)[0] = float("nan")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if self.where == "weights" and trainer.global_step == self.step:
            self._poison(pl_module.model.decoder.output_layer.weight)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.where == "gradients" and trainer.global_step == self.step:
            self._poison(pl_module.model.decoder.output_layer.weight.grad)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.where == "updated" and trainer.global_step == self.step + 1:
            self._poison(pl_module.model.decoder.output_layer.weight)


@pytest.mark.parametrize(
    ("where", "message", "saved_step"),
    [
        ("weights", "training loss became nan at step 5 (epoch 0)", 4),
        ("gradients", "a gradient became NaN or infinite at step 5 (epoch 0)", 4),
        # Poisoned after step 5's update: the step-6 checkpoint is refused, the step-4 one stays.
        ("updated", "the weights became NaN or infinite by step 6 (epoch 0; model.decoder.weight)", 4),
    ],
)
@pytest.mark.parametrize("clip", [None, 0.5])  # with norm clipping the check reads the clipping's norm
def test_divergence_stops_naming_the_step_and_keeps_the_last_good_checkpoint(
    workdir: Path, capsys: pytest.CaptureFixture[str], where: str, message: str, saved_step: int, clip: float | None
) -> None:
    poison = f"[{{class_path: tests.test_faults.Poison, init_args: {{step: 5, where: {where}}}}}]"
    recipe = _recipe(workdir, poison, clip)
    code = cli.main(["fit", "--config", str(recipe)])
    # Exit status 1: a failed run, not bad input (TrainingDivergedError.exit_code).
    one_line_error(capsys, code, message, "resume from the last checkpoint", expected_code=1)
    checkpoint_dir = workdir / "run" / "checkpoints"
    assert [p.name for p in checkpoint_dir.iterdir()] == ["last.ckpt"]  # no validation ran, so no best.ckpt
    last = torch.load(checkpoint_dir / "last.ckpt", weights_only=True)
    assert last["global_step"] == saved_step and _finite(last)
    assert checkpoints.load(checkpoint_dir / "last.ckpt").training["global_step"] == saved_step


class GrowingLoss(L.LightningModule):
    """Test helper: a plain LightningModule (not lm-zoo's) whose training loss is ``10 * step`` nats."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.weight * 0 + 10.0 * self.global_step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.zeros(20, 1))


def test_the_divergence_guard_stops_any_modules_run_a_step_late_naming_the_step() -> None:
    """The guard is a callback like any other: on a module of its own it checks the step's ``loss``. Step 3's loss
    (30 nats) passes the threshold of 25; it is decided at the end of step 4, naming step 3."""
    from lightning_modules.divergence import DivergenceGuard
    from zoo.errors import TrainingDivergedError

    seen: list[int] = []

    class Steps(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            seen.append(trainer.global_step)

    trainer = quiet_trainer(max_steps=10, callbacks=[Steps(), DivergenceGuard(25.0, "the test's threshold")])
    with pytest.raises(TrainingDivergedError, match=r"loss became 30 > the test's threshold 25 at step 3 \(epoch 0\)"):
        trainer.fit(GrowingLoss())
    assert seen[-1] == 5  # the end of step 4 (the loop has counted 5 steps there)


def _exit_on_term(_: int) -> int:
    return 0


def test_a_fit_in_this_process_leaves_the_signal_handlers_it_found(workdir: Path) -> None:
    """Training takes Ctrl-C and SIGTERM (LastCheckpoint) and Lightning takes them too; after the fit both are the
    process's own again. Left as Lightning's, a later SIGTERM was swallowed: a forked multiprocessing.Pool (GBW's word
    counting) waited forever in terminate() for workers that no longer died of it, now and then, in the suite."""
    import multiprocessing

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    assert cli.main(["fit", "--config", str(_recipe(workdir))]) == 0
    assert {signum: signal.getsignal(signum) for signum in before} == before
    with multiprocessing.get_context("fork").Pool(2) as pool:  # terminate() on leaving: SIGTERM to idle workers
        assert pool.map(_exit_on_term, [1, 2]) == [0, 0]


# ----------------------------------------------------------------------------------------------- the options
def test_last_checkpoint_takes_steps_or_time_not_both(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(workdir)
    code = cli.main(["fit", "--config", str(recipe), "--last_checkpoint.train_time_interval", "0:10:00"])
    one_line_error(capsys, code, "last_checkpoint: set every_n_train_steps (2) or train_time_interval (0:10:00)")


def test_last_checkpoint_defaults_to_every_30_minutes(workdir: Path) -> None:
    from checkpoints.ckpt_write import LastCheckpoint

    default = LastCheckpoint()
    assert default._train_time_interval.total_seconds() == 1800 and default._every_n_train_steps == 0
    assert LastCheckpoint(every_n_train_steps=0)._train_time_interval is None  # 0: no periodic saves


@pytest.mark.parametrize("step_path", ["direct", "lightning"])  # lm-zoo's step, and Lightning's closure and clipping
def test_with_norm_clipping_the_divergence_check_reads_the_clipping_norm(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, step_path: str
) -> None:
    """No second pass over the gradients where the clipping computes their norm; the other pass where it does not."""
    from lightning_modules.divergence import DivergenceGuard
    from zoo import settings

    checked: list[torch.Tensor | None] = []
    norms: list[torch.Tensor] = []
    check, clip_norm = DivergenceGuard.check, torch.nn.utils.clip_grad_norm_

    def recorded(self: DivergenceGuard, loss: Any, gradients: Any, *where: int) -> None:
        checked.append(gradients)
        check(self, loss, gradients, *where)

    monkeypatch.setattr(DivergenceGuard, "check", recorded)
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda *a, **k: norms.append(clip_norm(*a, **k)) or norms[-1]
    )
    for clip in (0.5, None):
        checked.clear()
        norms.clear()
        run = workdir / f"run-{clip}"
        overrides = ["--trainer.default_root_dir", str(run), "--checkpoint.dirpath", str(run / "checkpoints")]
        with settings.overridden(training_step=step_path):
            assert cli.main(["fit", "--config", str(_recipe(workdir, clip=clip)), *overrides]) == 0
        assert len(checked) == 8  # every step, once
        if clip is not None:
            assert all(g is n for g, n in zip(checked, norms, strict=True))
        else:
            assert not norms and all(g is not None and g.ndim == 0 for g in checked)


# ------------------------------------------------------------------------------------------------ a full disk
class FullDiskAfter:
    """Test helper: a ``write_to`` that writes ``allowed`` checkpoints, then half of the next and fails as a full
    disk does (``torch.save`` passes the OSError of ``write`` on, with no file name)."""

    def __init__(self, allowed: int) -> None:
        self.allowed, self.written = allowed, 0

    def __call__(self, checkpoint: dict[str, Any], file: IO[bytes]) -> None:  # set on the class: called unbound
        if self.written == self.allowed:
            file.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += 1
        torch.save(checkpoint, file)


def test_a_checkpoint_write_refused_by_a_full_disk_keeps_the_previous_one_and_stops_with_one_line(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """last.ckpt every 2 steps: the second save finds the disk full. The run stops with one line naming the file and
    what to do; last.ckpt is the first save's, whole and resumable; no temporary file is left."""
    monkeypatch.setattr(AtomicCheckpointIO, "write_to", FullDiskAfter(1))
    code = cli.main(["fit", "--config", str(_recipe(workdir))])
    last = workdir / "run" / "checkpoints" / "last.ckpt"
    line = one_line_error(capsys, code, str(last), "no space left on device", "the previous last.ckpt there is whole")
    assert "--ckpt_path last" in line
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert not list(last.parent.glob(".*.tmp"))
    monkeypatch.undo()
    assert cli.main(["fit", "--config", str(_recipe(workdir)), "--ckpt_path", "last"]) == 0


def test_lightnings_per_step_sigterm_broadcast_is_skipped_where_lm_zoo_agrees_on_signals() -> None:
    """Lightning's epoch loop broadcasts rank 0's SIGTERM flag at every step of a multi-process run (a collective and a
    host synchronisation); lm-zoo's handler never sets that flag, and its own agreed stop carries every rank's signal,
    so a multi-process fit shadows the broadcast on its loop and gives it back after. (tests/test_ddp.py holds the
    agreed stop: a signal to one rank stops both at one step.)"""
    from types import SimpleNamespace

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_modules.lightning_private import (
        restore_lightnings_sigterm_broadcast,
        skip_lightnings_sigterm_broadcast,
    )

    assert callable(_TrainingEpochLoop._broadcast_sigterm_tensor)  # the private method this relies on is still there
    loop = _TrainingEpochLoop.__new__(_TrainingEpochLoop)
    for world_size, skipped in ((1, False), (2, True)):
        trainer = SimpleNamespace(world_size=world_size, fit_loop=SimpleNamespace(epoch_loop=loop))
        skip_lightnings_sigterm_broadcast(trainer)
        assert ("_broadcast_sigterm_tensor" in loop.__dict__) == skipped
        if skipped:
            assert loop._broadcast_sigterm_tensor() is None  # no collective, nothing read back
        restore_lightnings_sigterm_broadcast(trainer)
        assert "_broadcast_sigterm_tensor" not in loop.__dict__


def test_a_rank_on_another_machine_whose_heartbeat_stopped_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank of another machine cannot be looked up in /proc: the one whose heartbeat count in the run's store has
    stopped is named, with its host and process; one still beating is not."""
    import threading

    import torch.distributed as dist

    from lightning_modules import faults
    from tests.conftest import free_port

    monkeypatch.setattr(faults, "HEARTBEAT_SECONDS", 0.05)
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    store = dist.PrefixStore("lm-zoo/", server)
    store.set("process/1", "far-away 111")
    store.set("process/2", "far-away 222")
    stop = threading.Event()
    beating = threading.Thread(target=faults._beat, args=(store, 2, stop), daemon=True)  # rank 2 is alive
    beating.start()
    store.add("beat/1", 5)  # rank 1 beat, then stopped
    try:
        said = faults._what_stopped(faults._Peers(store, 0, 3))
    finally:
        stop.set()
        beating.join()
    assert said == "rank 1 (process 111 on far-away) stopped answering (killed, frozen, or its machine lost)"


def test_a_killed_child_rank_is_named_with_its_signal_whenever_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 learns of a killed peer when its sockets close, before the kernel makes it a zombie, and looks for it
    while it ends. Here the child (a real process, as Lightning's launcher starts rank 1) is killed right after the
    first look at it, whatever that look is, and ``_fate`` is asked again as ``_what_stopped`` asks it: the signal is
    named. Reaping before reading /proc said "is gone" instead (CI at 45d7c8f)."""
    from lightning_modules import faults

    child = subprocess.Popen(["sleep", "60"])
    looked = []

    def end_the_child_after(look: Any) -> Any:  # the first look at the child, whichever it is
        def first_look_then_kill(*args: Any) -> Any:
            seen = look(*args)
            if not looked:
                looked.append(look.__name__)
                child.send_signal(signal.SIGKILL)
                while faults._process_state(child.pid) != "Z":
                    time.sleep(0.01)
            return seen

        return first_look_then_kill

    monkeypatch.setattr(faults, "_process_state", end_the_child_after(faults._process_state))
    monkeypatch.setattr(os, "waitpid", end_the_child_after(os.waitpid))
    try:
        fates = [faults._fate(child.pid) for _ in range(3)]
    finally:
        child.kill()
    said = next(fate for fate in fates if fate is not None)
    assert looked and said == "was killed by SIGKILL", (looked, fates)


def test_a_failed_rank_process_leaves_rank_0_its_grace_then_every_process_is_killed_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The watch of the ranks Lightning's launcher started: rank 1 is killed; rank 0 (a stand-in process here, as the
    watch kills the one it runs in) and rank 2 are left alone for the grace (Lightning's observer killed them within
    5 s), then killed after one line naming rank 1's fate. _fate still names it after the watch reaped it."""
    import threading

    from lightning_modules import faults

    monkeypatch.setattr(faults, "CHILD_POLL_SECONDS", 0.05)
    rank_0, rank_1, rank_2 = (subprocess.Popen(["sleep", "60"]) for _ in range(3))
    monkeypatch.setitem(faults._children, rank_1.pid, rank_1)
    watch = threading.Thread(target=faults._watch, args=([rank_1, rank_2], rank_0.pid, 1.0), daemon=True)
    try:
        watch.start()
        rank_1.kill()
        struck = time.monotonic()
        time.sleep(0.5)
        assert rank_0.poll() is None and rank_2.poll() is None  # within the grace
        watch.join(10)
        assert rank_0.wait(5) == rank_2.wait(5) == -signal.SIGKILL
        assert time.monotonic() - struck >= 1.0
    finally:
        for process in (rank_0, rank_1, rank_2):
            process.kill()
    assert capsys.readouterr().err == (
        f"lm-zoo: error: rank 1 (process {rank_1.pid}) was killed by SIGKILL, and rank 0 did not stop within 1 s (a "
        "collective waits for it), so every process of the run is killed; the last checkpoint on disk is whole: once "
        "the cause is fixed, the same command with --ckpt_path last resumes the run\n"
    )
    assert faults._fate(rank_1.pid) == "was killed by SIGKILL"  # reaped by the watch, its status kept


def test_rank_processes_that_end_as_agreed_end_the_watch_without_a_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Done (0), or stopped at a signal as every rank agreed (lm-zoo's 143): rank 0 is left to its own stop, however
    long its checkpoint takes to write."""
    import threading

    from lightning_modules import faults

    monkeypatch.setattr(faults, "CHILD_POLL_SECONDS", 0.05)
    rank_0 = subprocess.Popen(["sleep", "60"])
    finished = [subprocess.Popen(["true"]), subprocess.Popen(["sh", "-c", "exit 143"])]
    watch = threading.Thread(target=faults._watch, args=(finished, rank_0.pid, 0.1), daemon=True)
    try:
        watch.start()
        watch.join(10)
        assert not watch.is_alive() and rank_0.poll() is None
    finally:
        rank_0.kill()


def test_lightnings_launcher_hands_the_rank_processes_to_lm_zoos_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The private seam lightning_private relies on: the launcher starts its observer through its module's
    ``_launch_process_observer`` (an upgrade that moved it fails here)."""
    import inspect

    from lightning.pytorch.strategies.launchers import subprocess_script

    from lightning_modules.faults import watch_rank_processes
    from lightning_modules.lightning_private import watch_rank_processes_with

    assert "_launch_process_observer(self.procs)" in inspect.getsource(subprocess_script._SubprocessScriptLauncher)
    monkeypatch.setattr(subprocess_script, "_launch_process_observer", subprocess_script._launch_process_observer)
    watch_rank_processes_with(watch_rank_processes)
    assert subprocess_script._launch_process_observer is watch_rank_processes
