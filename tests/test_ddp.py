"""Real 2-process DDP fits (CPU, gloo) of a tiny NCE language model: each rank draws its own dropout masks and the
same noise words, a run killed mid-epoch resumes bit for bit with every rank's own state, and a loss that diverges on
one rank stops both ranks at the same step with one line each.

``lm-zoo fit`` runs as a subprocess in a session of its own, so that Lightning's DDP can re-launch the command for
rank 1 and the test can kill both ranks at once (rank 1 is a child of rank 0, not of the test). The recipe is the
smallest that exercises what a per-rank resume must restore: dropout (each rank's generators), NCE noise (the shared
generator), variable BPTT (the stream position), the carried state of each rank's own columns and Adam's moments.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import cli
from lightning_modules.divergence import WINDOW_LOSS
from lightning_modules.resume import RESUME_KEY, keyed_by_rank, rank_state
from tests.conftest import ROOT
from tests.ddp_runs import MAX_STEPS, ddp_recipe, read_checkpoint
from zoo.errors import CheckpointError, TrainingDivergedError

TIMEOUT = 180  # seconds: a hung rank (the bug this file guards against) fails the test instead of blocking it

KILL_AT_STEP = 8  # three steps after the periodic last.ckpt of step 5, which the resumed run must redo identically
DIVERGE_AT_STEP = 3


class RecordDraws(L.Callback):
    """Test helper: at step 0, save this rank's next dropout mask and next NCE noise words to ``rank_<r>.pt`` in
    ``directory``, without drawing from the generators the run uses (a copy of each draws)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != 0:
            return
        with torch.random.fork_rng(devices=[]):  # the global generator continues as if nothing was drawn
            mask = F.dropout(torch.ones(256), 0.5, training=True) > 0
        shared = torch.Generator().manual_seed(0)
        shared.set_state(pl_module.shared_generator.get_state())
        noise = pl_module.model.decoder.sample_noise(*batch.inputs.shape, generator=shared)
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save({"mask": mask, "noise": noise}, self.directory / f"rank_{trainer.global_rank}.pt")


class PauseAt(L.Callback):
    """Test helper: at the start of step ``step``, write ``<marker>.<rank>`` and wait to be killed (every rank does,
    before any collective of the step, so the kill finds both ranks at the same point)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            Path(f"{self.marker}.{trainer.global_rank}").write_text(str(batch_idx))
            for _ in range(1200):  # until SIGKILL; gives up after ~2 minutes so a broken test leaves no orphan
                time.sleep(0.1)
            os._exit(3)


class DivergeOn(L.Callback):
    """Test helper: on rank ``rank`` only, make step ``step``'s training loss (as the divergence guard sees it)
    ``value``, as a batch that blew up that rank's loss would; the other ranks' losses stay finite and small. Writes
    when it did so to ``<directory>/injected`` and what each rank raised to ``<directory>/raised_<rank>``."""

    def __init__(self, rank: int, step: int, value: float, directory: str) -> None:
        self.rank, self.step, self.value, self.directory = rank, step, value, Path(directory)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:  # before the guard's own: a trainer's callbacks come before a module's (configure_callbacks)
        if trainer.global_rank == self.rank and trainer.global_step == self.step + 1:  # step `step` has just run
            outputs[WINDOW_LOSS] = torch.tensor(self.value)
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "injected").write_text(repr(time.time()))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        raised = f"{type(exception).__name__} {trainer.global_step} {exception}"
        (self.directory / f"raised_{trainer.global_rank}").write_text(raised)


def _callback(class_name: str, **init_args: Any) -> str:
    args = ", ".join(f"{name}: {value}" for name, value in init_args.items())
    return f"    - class_path: tests.test_ddp.{class_name}\n      init_args: {{{args}}}\n"


# torchrun starting the 2 ranks on this machine (what the torchrun console script runs), instead of Lightning's launcher
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def _start(recipe: Path, env: dict[str, str], *args: str, torchrun: bool = False) -> subprocess.Popen[str]:
    """``lm-zoo fit`` on 2 ranks in its own session (rank 1 joins it), stderr captured, stdout to a log; the ranks are
    started by Lightning's launcher, or by torchrun."""
    log = open(recipe.with_suffix(".log"), "a")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, *(TORCHRUN if torchrun else ()), "-m", "cli", "fit", "--config", str(recipe), *args],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen[str], timeout: float = TIMEOUT) -> tuple[int, str]:
    """Wait for rank 0's exit and for every rank to close stderr (rank 1 holds it until it exits); kill the whole
    session if that takes longer than ``timeout``."""
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        pytest.fail(f"a rank still ran after {timeout} s:\n{stderr[-3000:]}")
    return process.returncode, stderr


def _fit(recipe: Path, env: dict[str, str], *args: str) -> None:
    code, stderr = _finish(_start(recipe, env, *args))
    assert code == 0, recipe.with_suffix(".log").read_text()[-2000:] + stderr[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(ddp_workspace: tuple[Path, Path, dict[str, str]]) -> Path:
    """An uninterrupted 2-process run, recording each rank's first draws; its directory."""
    tmp_path, corpus, env = ddp_workspace
    run = tmp_path / "uninterrupted"
    _fit(ddp_recipe(run, corpus, _callback("RecordDraws", directory=run / "draws")), env)
    return run


@pytest.mark.slow
def test_each_rank_draws_its_own_dropout_masks_and_the_same_noise(uninterrupted: Path) -> None:
    rank_0, rank_1 = (read_checkpoint(uninterrupted / "draws" / f"rank_{rank}.pt") for rank in (0, 1))
    assert 0.3 < rank_0["mask"].float().mean() < 0.7 and 0.3 < rank_1["mask"].float().mean() < 0.7
    # Independent masks of 256 units agree on about half of them; the same seed would make all 256 agree.
    assert (rank_0["mask"] == rank_1["mask"]).float().mean() < 0.75
    assert rank_0["noise"].dim() == 2 and rank_0["noise"].size(1) == 8  # (T, k): k per step, shared by the batch
    assert torch.equal(rank_0["noise"], rank_1["noise"])
    assert rank_0["noise"].unique().numel() > 8  # really drawn words, not a constant


@pytest.mark.slow
def test_one_process_with_the_same_global_batch_draws_the_same_noise_as_the_two_ranks(
    uninterrupted: Path, ddp_workspace: tuple[Path, Path, dict[str, str]]
) -> None:
    tmp_path, corpus, _ = ddp_workspace
    run = tmp_path / "one_process_draws"
    recipe = ddp_recipe(run, corpus, _callback("RecordDraws", directory=run / "draws"), max_steps=1)
    one_process = ["--trainer.devices=1", "--trainer.strategy=auto", "--data.init_args.batch_size=8"]
    assert cli.main(["fit", "--config", str(recipe), *one_process]) == 0
    single, rank_0 = (
        read_checkpoint(run / "draws" / "rank_0.pt"),
        read_checkpoint(uninterrupted / "draws" / "rank_0.pt"),
    )
    assert torch.equal(single["noise"], rank_0["noise"])  # what the GBW config says a 4-GPU run shares


@pytest.mark.slow
def test_a_killed_two_process_run_resumes_bit_for_bit(
    uninterrupted: Path, ddp_workspace: tuple[Path, Path, dict[str, str]]
) -> None:
    tmp_path, corpus, env = ddp_workspace
    run = tmp_path / "killed"
    recipe = ddp_recipe(run, corpus, _callback("PauseAt", step=KILL_AT_STEP, marker=run / "paused"))
    process = _start(recipe, env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all((run / f"paused.{rank}").exists() for rank in (0, 1)):
            assert process.poll() is None, recipe.with_suffix(".log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks never reached the kill step"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # both ranks, as a lost machine would
        process.communicate()
    saved = read_checkpoint(run / "checkpoints" / "last.ckpt")
    assert saved["global_step"] == KILL_AT_STEP - 3
    resume = saved[RESUME_KEY]
    assert resume["world_size"] == 2 and set(resume) == {"world_size", "rank_0", "rank_1"}
    # Each rank carried its own columns' state and drew its own masks: the two entries differ.
    assert not torch.equal(resume["rank_0"]["train_state"][0], resume["rank_1"]["train_state"][0])
    assert not torch.equal(resume["rank_0"]["rng"]["torch"], resume["rank_1"]["rng"]["torch"])
    assert torch.equal(resume["rank_0"]["shared_rng"]["state"], resume["rank_1"]["shared_rng"]["state"])

    resumed = tmp_path / "resumed"
    _fit(ddp_recipe(resumed, corpus), env, "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    expected, final = (
        read_checkpoint(uninterrupted / "checkpoints" / "last.ckpt"),
        read_checkpoint(resumed / "checkpoints" / "last.ckpt"),
    )
    assert final["global_step"] == expected["global_step"] == MAX_STEPS
    assert len(expected["state_dict"]) == len(final["state_dict"]) > 5
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(final["state_dict"][name], tensor), name
    for rank in ("rank_0", "rank_1"):  # ...and each rank ends with the same carried state
        for ours, theirs in zip(final[RESUME_KEY][rank]["train_state"], expected[RESUME_KEY][rank]["train_state"]):
            assert torch.equal(ours, theirs), rank


@pytest.mark.slow
def test_a_checkpoint_resumes_only_in_the_world_size_that_wrote_it(
    uninterrupted: Path, ddp_workspace: tuple[Path, Path, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path, corpus, _ = ddp_workspace
    recipe = ddp_recipe(tmp_path / "one_process", corpus, max_steps=MAX_STEPS + 2)
    code = cli.main(
        [
            "fit",
            "--config",
            str(recipe),
            "--trainer.devices=1",
            "--trainer.strategy=auto",
            f"--ckpt_path={uninterrupted / 'checkpoints' / 'last.ckpt'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == CheckpointError.exit_code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lm-zoo: error: this checkpoint holds 2 processes' training state") and "has 1" in last
    assert "Traceback" not in err


def test_rank_state_reads_both_layouts() -> None:
    legacy = {"train_state": None, "rng": {}}  # a one-process checkpoint written before the per-rank layout
    assert rank_state(legacy, rank=0, world_size=1) is legacy
    with pytest.raises(CheckpointError, match="one process's training state .* this run has 2"):
        rank_state(legacy, rank=1, world_size=2)
    keyed = keyed_by_rank([{"which": 0}, {"which": 1}])
    assert keyed["world_size"] == 2 and rank_state(keyed, rank=1, world_size=2) == {"which": 1}
    with pytest.raises(CheckpointError, match="2 processes' training state .* this run has 4"):
        rank_state(keyed, rank=3, world_size=4)


@pytest.mark.slow
def test_a_loss_diverging_on_one_rank_stops_both_ranks_at_once(
    ddp_workspace: tuple[Path, Path, dict[str, str]],
) -> None:
    tmp_path, corpus, env = ddp_workspace
    run = tmp_path / "diverging"
    recipe = ddp_recipe(
        run, corpus, _callback("DivergeOn", rank=1, step=DIVERGE_AT_STEP, value=1.0e4, directory=run / "raised")
    )
    code, stderr = _finish(_start(recipe, env))  # fails, killing both, if a rank hangs
    assert code == TrainingDivergedError.exit_code, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    elapsed = time.time() - float((run / "raised" / "injected").read_text())
    print(f"\nrank 1's loss diverged at step {DIVERGE_AT_STEP}: both ranks had exited {elapsed:.2f} s later")
    # One line from each process, the same line: rank 1's loss, named on both ranks, at the same step. (The two
    # processes share the pipe, so one's newline may land after the other's text: the lines are found by content.)
    line = re.search(r"lm-zoo: error: rank 1's training loss became 1e\+04 > [^\n]*?last checkpoint", stderr)
    assert line is not None, stderr[-3000:]
    assert f"at step {DIVERGE_AT_STEP} (epoch 0)" in line[0] and "model.init_args.divergence_threshold" in line[0]
    assert stderr.count(line[0]) == 2 and stderr.count("lm-zoo: error:") == 2, stderr[-3000:]
    for rank in (0, 1):
        raised = (run / "raised" / f"raised_{rank}").read_text()
        # Decided at the end of the next step (the figures reach the host without the host waiting, and the guard
        # reads them at a step's end, when the loop has counted it), naming the step that diverged.
        assert raised.startswith(f"TrainingDivergedError {DIVERGE_AT_STEP + 2} rank 1's training loss"), raised
    # No checkpoint holds the diverged step's weights: none beyond the periodic one before it (none at step 3).
    assert not (run / "checkpoints" / "last.ckpt").exists()


# ----------------------------------------------------------------------------------- signals and lost ranks
class FaultAt(L.Callback):
    """Test helper: at the start of step ``step`` on rank ``rank``, the ``fault``: ``SIGTERM`` or ``SIGINT`` to this
    process alone (a scheduler's preemption reaches one worker), ``SIGINT to the group`` (Ctrl-C in the run's
    terminal reaches every rank), ``SIGKILL`` (the OOM killer), ``SIGSTOP`` (a rank that hangs without exiting, as one
    in a stuck NCCL kernel) or ``raise`` (any bug, a ``RuntimeError``). Writes the time it struck to
    ``<directory>/struck``."""

    def __init__(self, step: int, rank: int, fault: str, directory: str) -> None:
        self.step, self.rank, self.fault, self.directory = step, rank, fault, Path(directory)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "struck").write_text(repr(time.time()))
        if self.fault == "raise":
            raise RuntimeError(f"injected by the test at step {self.step}")
        signum = getattr(signal, self.fault.split()[0])
        if self.fault.endswith("to the group"):
            os.killpg(os.getpgid(0), signum)
        else:
            os.kill(os.getpid(), signum)


class StallAt(L.Callback):
    """Test helper: at the start of step ``step`` on rank ``rank``, sleep ``seconds`` before the step's collectives
    (a rank busy elsewhere: writing a checkpoint, in a long validation)."""

    def __init__(self, step: int, rank: int, seconds: float) -> None:
        self.step, self.rank, self.seconds = step, rank, seconds

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            time.sleep(self.seconds)


def _same_weights_as(expected_run: Path, final_run: Path) -> None:
    expected, final = (
        read_checkpoint(expected_run / "checkpoints" / "last.ckpt"),
        read_checkpoint(final_run / "checkpoints" / "last.ckpt"),
    )
    assert final["global_step"] == expected["global_step"] == MAX_STEPS
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(final["state_dict"][name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signame", "rank", "group", "code"),
    [("SIGTERM", 1, False, 143), ("SIGINT", 0, True, 130)],
    ids=["sigterm-to-rank-1-alone", "sigint-to-the-whole-group"],
)
def test_a_signal_on_any_rank_stops_every_rank_at_one_step_and_resumes_bit_for_bit(
    uninterrupted: Path,
    ddp_workspace: tuple[Path, Path, dict[str, str]],
    signame: str,
    rank: int,
    group: bool,
    code: int,
) -> None:
    """The ranks agree on the stop through the step's gather: every rank writes the same last.ckpt at the same step
    (a rank that stopped alone used to wait for ever in that checkpoint's gather), each exits with one line, and
    --ckpt_path last resumes to the uninterrupted run's weights."""
    tmp_path, corpus, env = ddp_workspace
    run = tmp_path / f"signal_{signame}"
    fault = f"{signame} to the group" if group else signame
    signalled = _callback("FaultAt", step=6, rank=rank, fault=f"'{fault}'", directory=run / "marks")
    returncode, stderr = _finish(_start(ddp_recipe(run, corpus, signalled), env))
    elapsed = time.time() - float((run / "marks" / "struck").read_text())
    print(f"\n{signame} to {'the group' if group else f'rank {rank}'} at step 6: every rank gone {elapsed:.2f} s later")
    assert returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    stops = re.findall(rf"lm-zoo: interrupted: {signame} on rank {rank} at step (\d+) \(epoch 0\)", stderr)
    assert len(stops) == 2 and stops[0] == stops[1], stderr[-3000:]  # one line per rank, the same step
    saved = read_checkpoint(run / "checkpoints" / "last.ckpt")
    # The signal travels in step 6's gather, which is read at step 7's check (a step later, so that the host never
    # waits for the GPU): step 7 ends, and its state is kept.
    assert saved["global_step"] == int(stops[0]) == 8
    assert set(saved[RESUME_KEY]) == {"world_size", "rank_0", "rank_1"}
    resumed = tmp_path / f"resumed_{signame}"
    _fit(ddp_recipe(resumed, corpus), env, "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    _same_weights_as(uninterrupted, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
@pytest.mark.parametrize("how", ["SIGKILL", "raise"])
def test_a_lost_rank_stops_the_others_with_one_line_naming_it(
    uninterrupted: Path, ddp_workspace: tuple[Path, Path, dict[str, str]], how: str, launcher: str
) -> None:
    """Rank 1 is killed, or raises, at step 8: rank 0 stops with one line naming rank 1 and what happened (it used to
    print gloo's traceback); the last checkpoint on disk (step 5's) is whole and resumes to the
    uninterrupted run's weights. Under Lightning's launcher rank 0 learns of it 7 s late (busy before the step's
    collectives), past the 5 s in which Lightning's observer of the rank processes killed it without a word."""
    tmp_path, corpus, env = ddp_workspace
    run = tmp_path / f"lost_{how}_{launcher}"
    callbacks = _callback("FaultAt", step=8, rank=1, fault=how, directory=run / "marks")
    if launcher == "lightning":
        callbacks += _callback("StallAt", step=8, rank=0, seconds=7)
    recipe = ddp_recipe(run, corpus, callbacks)
    process = _start(recipe, env, torchrun=launcher == "torchrun")
    returncode, stderr = _finish(process)  # fails, killing every process, if a rank is left waiting
    elapsed = time.time() - float((run / "marks" / "struck").read_text())
    print(f"\nrank 1 {'killed' if how == 'SIGKILL' else 'raised'} at step 8 ({launcher}): gone {elapsed:.2f} s later")
    assert returncode != 0
    said = "was killed by SIGKILL" if how == "SIGKILL" and launcher == "lightning" else "is gone"
    said = said if how == "SIGKILL" else "stopped (RuntimeError: injected by the test at step 8)"
    line = re.search(r"lm-zoo: error: rank 1 [^\n]*, so rank 0 stops too[^\n]*--ckpt_path last[^\n]*", stderr)
    assert line is not None and said in line[0], stderr[-3000:]
    assert "[rank0]" not in stderr and "Connection reset by peer" not in stderr, stderr[-3000:]  # no gloo traceback
    assert read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 5
    resumed = tmp_path / f"resumed_lost_{how}_{launcher}"
    _fit(ddp_recipe(resumed, corpus), env, "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    _same_weights_as(uninterrupted, resumed)


@pytest.mark.slow
def test_a_frozen_rank_stops_the_others_within_the_timeout_naming_it(
    uninterrupted: Path, ddp_workspace: tuple[Path, Path, dict[str, str]]
) -> None:
    """Rank 1 stops (SIGSTOP) at step 8 without exiting: no failure report reaches rank 0, whose next collective waits
    for the process group's timeout (8 s here), then it stops with one line naming rank 1 as frozen; the last
    checkpoint (step 5's) is whole and resumes to the uninterrupted run's weights."""
    tmp_path, corpus, env = ddp_workspace
    run = tmp_path / "frozen"
    timeout = 8
    recipe = ddp_recipe(run, corpus, _callback("FaultAt", step=8, rank=1, fault="SIGSTOP", directory=run / "marks"))
    process = _start(recipe, env, f"--process_group_timeout={timeout}")
    try:
        process.wait(timeout=TIMEOUT)  # rank 0; rank 1 stays stopped, holding stderr open
        elapsed = time.time() - float((run / "marks" / "struck").read_text())
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the frozen rank, which no one else ends
        stderr = process.communicate()[1]
    print(f"\nrank 1 frozen at step 8: rank 0 gone {elapsed:.2f} s later (process group timeout {timeout} s)")
    assert process.returncode != 0 and timeout <= elapsed < timeout + 30, stderr[-3000:]
    line = re.search(r"lm-zoo: error: rank 1 \(process \d+\) is frozen [^\n]*, so rank 0 stops too[^\n]*", stderr)
    assert line is not None, f"{process.returncode} {stderr[-3000:]} {recipe.with_suffix('.log').read_text()[-3000:]}"
    assert read_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 5
    resumed = tmp_path / "resumed_frozen"
    _fit(ddp_recipe(resumed, corpus), env, "--ckpt_path", str(run / "checkpoints" / "last.ckpt"))
    _same_weights_as(uninterrupted, resumed)
