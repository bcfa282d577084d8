"""Devices chosen on purpose and a recorded float32 matmul precision (issue 33, parts 2 and 5).

- A fit inside another command's process (a test, ``lm-zoo tune``'s trials) trains on one device: ``auto`` becomes 1,
  several devices are refused in one line, since Lightning's DDP launcher would re-run that other command per rank.
- ``lm-zoo fit`` says in one line, once, what it chose: devices, strategy, per-rank and global batch (a real 2-process
  gloo run here), and the matmul precision.
- Every shipped recipe states next to its ``batch_size`` that it is per rank and which global batch its lr is for.
- ``--matmul_precision`` / ``--matmul-precision`` is applied (torch's flags during the run) and recorded (config.yaml,
  the checkpoint, ``lm-zoo evaluate --json``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.strategies import SingleDeviceStrategy

import cli
from commands.fit import run_lightning
from lightning_modules.training import (
    describe_devices,
    hardware,
    in_process_devices,
    requested_devices,
    source_commit,
)
from tests.conftest import one_line_error, write_tiny_recipe, write_word_corpus
from zoo.errors import ConfigError
from zoo.settings import matmul_precision_in_force, set_matmul_precision

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(workdir: Path, name: str = "run") -> Path:
    """The tiny fit, 4 steps and a 2-batch validation without the sanity check."""
    corpus = write_word_corpus(workdir / "corpus", "devices")
    steps = {"limit_train_batches": 4, "limit_val_batches": 2, "num_sanity_val_steps": 0}
    return write_tiny_recipe(workdir / f"{name}.yaml", corpus, trainer=steps)


def saved_config(run: Path) -> dict[str, Any]:
    """The config.yaml LightningCLI saved for the run (what the Trainer was built from)."""
    (found,) = run.glob("lightning_logs/version_*/config.yaml")
    return yaml.safe_load(found.read_text())


THREADS = re.compile(r"; \d+ CPU threads?( \((OMP_NUM_THREADS|other processes keep \d+ of \d+ cores busy)\))?$")


def choice_lines(err: str) -> list[str]:
    """The start-up lines, each without its CPU threads, which follow whatever else runs on the machine (checked
    here to be said, and in test_a_fit_shares_the_cores_with_other_work_and_gives_its_threads_back)."""
    lines = [line for line in err.splitlines() if line.startswith("lm-zoo: training on ")]
    assert all(THREADS.search(line) for line in lines), lines
    return [THREADS.sub("", line) for line in lines]


# -------------------------------------------------------------------------------------------- the in-process rule
@pytest.mark.parametrize(
    ("devices", "count"),
    [("auto", None), (1, 1), ("1", 1), (3, 3), ("2", 2), ([0], 1), ("0,", 1), ("0,1", 2), (-1, -1)],
)
def test_requested_devices_counts_what_lightning_would_start(devices: Any, count: int | None) -> None:
    assert requested_devices(devices) == count


@pytest.mark.parametrize(("devices", "pinned"), [("auto", 1), (1, 1), ("1", "1"), ([0], [0]), ("0,", "0,")])
def test_an_in_process_fit_gets_one_device(devices: Any, pinned: Any) -> None:
    assert in_process_devices(devices) == pinned


@pytest.mark.parametrize(
    ("devices", "nodes"), [(2, 1), ("2", 1), ([0, 1], 1), ("0,1", 1), (-1, 1), ("auto", 2), (1, 2)]
)
def test_an_in_process_fit_asking_for_several_devices_is_refused(devices: Any, nodes: int) -> None:
    with pytest.raises(ConfigError, match="trains on one device"):
        in_process_devices(devices, nodes)


def test_describe_devices_states_the_per_rank_and_the_global_batch() -> None:
    # Built, not launched: the Trainer knows its devices, ranks and strategy at construction.
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    one = L.Trainer(accelerator="cpu", devices=1, **quiet)
    assert describe_devices(one, 32) == "training on 1 cpu device, 32 columns per rank, 32 in all"
    two = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", **quiet)
    assert describe_devices(two, 32) == "training on 2 cpu devices (ddp), 32 columns per rank, 64 in all"
    spawn = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", accumulate_grad_batches=3, **quiet)
    assert describe_devices(spawn, 4) == (
        "training on 2 cpu devices (ddp_spawn), 4 columns per rank, 24 in all (4 x 2 ranks x 3 accumulated batches)"
    )
    nodes = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", **quiet)
    assert describe_devices(nodes, 4) == "training on 2 nodes x 2 cpu devices (ddp), 4 columns per rank, 16 in all"
    assert describe_devices(one, None) == "training on 1 cpu device"


class TrainerProbe(L.Callback):
    """What the running Trainer was built with, and torch's precision flags while it trains."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.strategy, self.devices = trainer.strategy, trainer.num_devices
        self.flags = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32


def test_an_in_process_fit_pins_one_device_applies_and_records_its_precision(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny_config(workdir)
    probe = TrainerProbe()
    with matmul_precision_in_force("highest"):
        run_lightning(["fit", "--config", str(config), "--matmul_precision", "medium"], [probe])
        assert probe.flags == ("medium", True)  # bfloat16 products allowed, and TF32 in cuDNN
        # The caller's precision is back once the fit is over.
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("highest", False)
    assert isinstance(probe.strategy, SingleDeviceStrategy) and probe.devices == 1
    saved = saved_config(workdir / "run")
    assert saved["trainer"]["devices"] == 1  # pinned in the config the run saved, not left at auto
    assert saved["matmul_precision"] == "medium"
    checkpoint = torch.load(workdir / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    settings = checkpoint["callbacks"]["RunSettings"]
    assert settings["matmul_precision"] == "medium"
    (environment,) = settings["environments"]  # where the run trained
    assert environment["hardware"] == hardware(torch.device("cpu")) and environment["cuda_version"] is None
    assert environment["torch_version"] == torch.__version__ and environment["commit"] == source_commit()
    assert choice_lines(capsys.readouterr().err) == [
        "lm-zoo: training on 1 cpu device, 4 columns per rank, 4 in all; float32 matmuls at medium precision"
    ]


def test_lm_zoos_own_command_line_keeps_lightnings_choice(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # own_command: what `lm-zoo fit` (argv None) and `lm-zoo --debug fit` pass; on this CPU machine auto is 1 device.
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    run_lightning(["fit", "--config", str(tiny_config(workdir))], own_command=True)
    saved = saved_config(workdir / "run")
    assert saved["trainer"]["devices"] == "auto"
    assert saved["matmul_precision"] == "highest"  # the default, recorded
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before  # put back after
    lines = choice_lines(capsys.readouterr().err)
    assert lines == [
        "lm-zoo: training on 1 cpu device, 4 columns per rank, 4 in all; float32 matmuls at highest precision"
    ]


def test_an_in_process_fit_for_two_devices_is_one_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # ddp_spawn, so that if the refusal ever went missing no launcher would re-run pytest itself.
    args = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp_spawn"]
    code = cli.main(["fit", "--config", str(tiny_config(workdir)), *args])
    one_line_error(capsys, code, "trainer.devices 2", "trains on one device", "lm-zoo fit itself")
    assert not (workdir / "run" / "checkpoints").exists()  # refused before any training


def test_a_matmul_precision_that_does_not_exist_is_one_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["fit", "--config", str(tiny_config(workdir)), "--matmul_precision", "low"])
    one_line_error(capsys, code, "--matmul_precision", "low")


# ------------------------------------------------------------------------------------------- a real 2-process run
@pytest.mark.slow
def test_a_two_process_ddp_fit_says_once_what_it_chose(tmp_path: Path) -> None:
    """``python -m cli fit`` is its own command line, which Lightning re-runs for rank 1: two gloo ranks."""
    config = tiny_config(tmp_path)
    command = [
        sys.executable,
        "-m",
        "cli",
        "fit",
        "--config",
        str(config),
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        "--trainer.accumulate_grad_batches=2",
        "--trainer.logger=false",
    ]
    env = {**os.environ, "LM_ZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert choice_lines(done.stderr) == [
        "lm-zoo: training on 2 cpu devices (ddp), 4 columns per rank, 16 in all (4 x 2 ranks x 2 accumulated "
        "batches); float32 matmuls at highest precision"
    ]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    settings = checkpoint["callbacks"]["RunSettings"]
    assert settings["matmul_precision"] == "highest"
    assert [e["hardware"] for e in settings["environments"]] == [f"{hardware(torch.device('cpu'))}, 2 processes"]


# ------------------------------------------------------------------------------------------------ lm-zoo evaluate
def test_evaluate_applies_and_records_its_matmul_precision(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from commands import evaluate as evaluate_command

    flags = []
    scoring = evaluate_command.score_split
    monkeypatch.setattr(
        evaluate_command,
        "score_split",
        lambda *a, **k: (
            flags.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)) or scoring(*a, **k)
        ),
    )
    run_lightning(["fit", "--config", str(tiny_config(workdir))])
    best = str(workdir / "run" / "checkpoints" / "best.ckpt")
    capsys.readouterr()
    assert cli.main(["evaluate", best, "--device", "cpu", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["matmul_precision"] == "highest"
    with matmul_precision_in_force("highest"):
        assert cli.main(["evaluate", best, "--device", "cpu", "--json", "--matmul-precision", "high"]) == 0
        assert flags[-1] == ("high", True)  # while it scored
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32  # put back
    high = json.loads(capsys.readouterr().out)
    assert high["matmul_precision"] == "high"
    assert high["tokens"] == default["tokens"] and high["eval_batch_size"] == default["eval_batch_size"]
    assert cli.main(["evaluate", best, "--device", "cpu", "--matmul-precision", "medium"]) == 0
    assert capsys.readouterr().out.strip().endswith("; float32 matmuls at medium precision)")


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_set_matmul_precision_sets_cublas_onednn_and_cudnn_together(precision: str) -> None:
    with matmul_precision_in_force("high" if precision == "highest" else "highest"):
        set_matmul_precision(precision)
        assert torch.get_float32_matmul_precision() == precision
        assert torch.backends.cudnn.allow_tf32 == (precision != "highest")
        assert torch.backends.cuda.matmul.allow_tf32 == (precision != "highest")


def test_matmul_precision_in_force_restores_torchs_flags() -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True  # torch's own default: TF32 in cuDNN whatever the matmul precision
    with matmul_precision_in_force("highest"):
        assert not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest" and torch.backends.cudnn.allow_tf32
    with pytest.raises(ValueError, match="use one of highest, high, medium"):
        set_matmul_precision("low")


# ------------------------------------------------------------------------------------------------- the recipes
FIT_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name not in ("tune", "search"))
STATEMENT = re.compile(r"^\s+batch_size: (\d+)\s+# per rank; lr is for (\d+) in all: on N devices (\d+)/N(.*)$")


@pytest.mark.parametrize("path", FIT_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_recipe_states_its_batch_per_rank_and_the_global_batch_of_its_lr(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    lines = [m for line in path.read_text().splitlines() if (m := STATEMENT.match(line))]
    assert len(lines) == 1, f"{path}: batch_size needs its '# per rank; lr is for G in all: ...' comment"
    per_rank, stated, divided, rule = lines[0].groups()
    assert int(per_rank) == config["data"]["init_args"]["batch_size"]
    trainer = config.get("trainer") or {}
    devices = trainer.get("devices", 1)
    ranks = (devices if isinstance(devices, int) else 1) * trainer.get("num_nodes", 1)
    assert int(stated) == int(divided) == int(per_rank) * ranks * trainer.get("accumulate_grad_batches", 1)
    optimizer = config["optimizer"]["class_path"].rsplit(".", 1)[-1]
    expected = "(SGD's linear rule)" if optimizer == "SGD" else f"({optimizer}: keep the global batch)"
    assert rule.endswith(expected), (path, rule)


# --------------------------------------------------------------------------------------------------- lm-zoo tune
def test_a_tune_trial_trains_on_one_device(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("optuna")
    space = workdir / "space.yaml"
    space.write_text("optimizer.init_args.lr: {type: float, low: 0.5, high: 1.0}\n")
    argv = ["tune", "--config", str(tiny_config(workdir)), "--space", str(space), "--trials", "1"]
    assert cli.main([*argv, "--workdir", str(workdir / "study")]) == 0
    trial = workdir / "study" / "trial_0"
    assert yaml.safe_load((trial / "config.yaml").read_text())["trainer"]["devices"] == "auto"  # as the config says
    assert saved_config(trial)["trainer"]["devices"] == 1  # what the trial's Trainer was built with
    assert choice_lines(capsys.readouterr().err)[0].startswith("lm-zoo: training on 1 cpu device, 4 columns")


def test_tune_refuses_a_config_for_several_devices_before_training(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("optuna")
    config = tiny_config(workdir)
    config.write_text(config.read_text().replace("  max_epochs: 1\n", "  max_epochs: 1\n  devices: 2\n"))
    space = workdir / "space.yaml"
    space.write_text("optimizer.init_args.lr: {type: float, low: 0.5, high: 1.0}\n")
    code = cli.main(["tune", "--config", str(config), "--space", str(space), "--trials", "1"])
    one_line_error(capsys, code, f"--config {config}", "trainer.devices 2", "--jobs N")
    assert not list(workdir.rglob("trial_*"))


def test_tune_helpers_take_the_gpus_in_turn() -> None:
    tune = pytest.importorskip("commands.tune")
    assert [tune.worker_environment(i, 4, {})["CUDA_VISIBLE_DEVICES"] for i in (1, 2, 3, 4, 5)] == list("12301")
    chosen = {"CUDA_VISIBLE_DEVICES": "5,7"}
    assert [tune.worker_environment(i, 2, chosen)["CUDA_VISIBLE_DEVICES"] for i in (1, 2)] == ["7", "5"]
    assert "CUDA_VISIBLE_DEVICES" not in tune.worker_environment(1, 1, {})  # one GPU (or none): nothing to share out
    assert "CUDA_VISIBLE_DEVICES" not in tune.worker_environment(1, 0, {})


def test_the_commit_is_looked_up_only_in_a_clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packages imported from site-packages (an installed wheel) are no git checkout, even inside one: no git command
    runs and the commit is unknown; in this clone git says which commit, unless $LM_ZOO_COMMIT names it."""
    from lightning_modules import training

    monkeypatch.delenv("LM_ZOO_COMMIT", raising=False)
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert source_commit().removesuffix("-dirty") == here
    monkeypatch.setattr(training, "PACKAGES_ROOT", tmp_path / "site-packages")
    monkeypatch.setattr(training.subprocess, "run", lambda *a, **k: pytest.fail(f"git ran: {a}"))
    assert source_commit() == "unknown"
    monkeypatch.setenv("LM_ZOO_COMMIT", "abc123")
    assert source_commit() == "abc123"


def test_a_fit_shares_the_cores_with_other_work_and_gives_its_threads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """CoreSharing: the cores left by other processes' work (a core counted from half of one), at least one thread
    and at most the process's own; re-read every CHECK_SECONDS, a line when the count changes; OMP_NUM_THREADS and a
    single thread are kept as they are; the process's own count back at the end."""
    from lightning_modules import cores

    clock = {"now": 100.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(cores.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(cores.time, "sleep", lambda seconds: advance(seconds, others=0.0))
    monkeypatch.setattr(cores, "cpu_seconds", lambda: (clock["busy"], clock["own"]))

    def advance(seconds: float, others: float, own: float = 1.0) -> None:
        clock["now"] += seconds
        clock["own"] += own * seconds
        clock["busy"] += (own + others) * seconds

    before = torch.get_num_threads()
    try:
        sharing = cores.CoreSharing(cores=4, threads=4, fixed=False)
        assert sharing.start() == "4 CPU threads" and torch.get_num_threads() == 4
        advance(cores.CHECK_SECONDS / 2, others=2.0)
        assert sharing.check() is None and torch.get_num_threads() == 4  # not yet time to look
        advance(cores.CHECK_SECONDS, others=2.0)
        assert sharing.check() == "2 CPU threads (other processes keep 2 of 4 cores busy)"
        advance(cores.CHECK_SECONDS, others=3.6)
        assert sharing.check() == "1 CPU thread (other processes keep 4 of 4 cores busy)"  # never fewer than one
        advance(cores.CHECK_SECONDS, others=0.4)
        assert sharing.check() == "4 CPU threads" and torch.get_num_threads() == 4  # the others are gone
        assert [sharing.threads_for(x) for x in (0.49, 0.5, 1.49, 1.5)] == [4, 3, 3, 2]
        torch.set_num_threads(2)
        sharing.restore()
        assert torch.get_num_threads() == 4
        kept = cores.CoreSharing(cores=4, threads=1)  # one thread: nothing to give up
        advance(cores.CHECK_SECONDS, others=3.0)
        assert kept.fixed and kept.check() is None
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert cores.CoreSharing(cores=4, threads=3).describe().endswith("(OMP_NUM_THREADS)")
    finally:
        torch.set_num_threads(before)
