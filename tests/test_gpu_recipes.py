"""The GPU recipes for registry models (configs/ptb/awd-lstm-gpu.yaml, configs/ptb-char/awd-lstm-gpu.yaml), ready
before a GPU comes: ``benchmarks/gpu_session.sh ptb-word`` / ``ptb-char`` run here on the CPU at a tiny size (the
recipe itself, with FIT_ARGS shrinking the network and the run), and what the step brings back is checked against the
device tool's limits, unpacked as the script's header says, loaded, and (the word model) bundled by ``release
build`` from the export, as a model trained on a lent GPU is bundled at home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import checkpoints
import cli
from checkpoints.export_read import CONFIG_NAME
from lightning_modules.training import hardware
from release.command import main as release_main
from tests.conftest import ROOT, needs_data

TOOL_FILES, TOOL_FILE_BYTES = 8, 16 * 2**20  # what the device tool brings back from $OUT, at most
STEPS = 20
TINY = [
    "--model.init_args.hidden_size=16",
    "--model.init_args.embedding_size=8",
    "--model.init_args.cell_options.last_layer_size=8",
    "--data.init_args.batch_size=4",
    f"--trainer.max_steps={STEPS}",
    "--trainer.val_check_interval=10",
    "--trainer.check_val_every_n_epoch=null",
    "--trainer.limit_val_batches=3",
    "--trainer.log_every_n_steps=5",
]
# step: (recipe, name, shard size): sizes that cut each tiny model into a few shards (the word model's 10,000 x 8
# embedding, 160 KB in float16, takes a shard of its own).
RECIPES = {
    "ptb-word": ("configs/ptb/awd-lstm-gpu.yaml", "ptb_word", "100KB"),
    "ptb-char": ("configs/ptb-char/awd-lstm-gpu.yaml", "ptb_char", "10KB"),
}


def run_step(step: str, tmp_path: Path, start: Path | None = None) -> tuple[Path, Path, Path]:
    """The step as the device tool runs it, here (a later hop where ``start`` names the export it carries on from):
    returns its $OUT, the run's root and the unpacked export."""
    out, root = tmp_path / "out", tmp_path / "run"
    env = {
        **os.environ,
        "OUT": str(out),
        "RUN_ROOT": str(root),
        "STAGING": str(tmp_path / "staging"),
        "FIT_ARGS": " ".join(TINY + ([f"--trainer.max_steps={2 * STEPS}"] if start is not None else [])),
        "SHARD_SIZE": RECIPES[step][2],
        "EXPORT_DEVICE": "cpu",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3: this environment's
        "LM_ZOO_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
        **({"START": str(start)} if start is not None else {}),
    }
    result = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", step], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    name = RECIPES[step][1]
    back = tmp_path / "back"
    back.mkdir()
    with tarfile.open(out / f"{name}_rest.tgz") as archive:
        archive.extractall(back, filter="data")
    for shard in out.glob("model*.safetensors"):
        (back / name / "export" / shard.name).write_bytes(shard.read_bytes())
    return out, root, back / name


@pytest.mark.slow
@needs_data("ptb")
@pytest.mark.parametrize("step", list(RECIPES))
def test_the_gpu_step_trains_its_recipe_and_brings_back_shards_within_the_tools_limits(
    step: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out, root, back = run_step(step, tmp_path)
    files = sorted(p for p in out.iterdir())
    assert len(files) <= TOOL_FILES and all(p.is_file() and p.stat().st_size <= TOOL_FILE_BYTES for p in files), files
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2
    checkpoint = torch.load(
        root / "lightning_logs/version_0/checkpoints/best.ckpt", map_location="cpu", weights_only=False
    )
    assert checkpoint["global_step"] == STEPS
    # The recipe's averaging: on at its start fraction of the steps (the 7 minutes are far off at this size).
    averaging = checkpoint["callbacks"]["WeightAveragingOnPlateau"]
    fraction = {"ptb-word": 0.5, "ptb-char": 0.6}[step]
    assert averaging["switched_on_at_step"] == int(fraction * STEPS)
    # The export, loaded with its shards' sha256 checked, holds the chosen checkpoint's weights as float16.
    loaded = checkpoints.load(back / "export")
    exported = loaded.model.state_dict()
    chosen = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()}
    assert exported.keys() <= chosen.keys()
    for key, value in exported.items():
        assert torch.equal(value, chosen[key].half().float()), key
    assert loaded.training["environments"] == checkpoint["callbacks"]["RunSettings"]["environments"]
    # Its validation figure was measured on those stored weights; the step's logs and the run's came back too.
    config = json.loads((back / "export" / CONFIG_NAME).read_text())
    (recorded,) = config["results"]
    capsys.readouterr()
    assert cli.main(["evaluate", str(back / "export"), "--split", "valid", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (recorded["split"], recorded["eval_batch_size"], recorded["tokens"]) == ("valid", 10, again["tokens"])
    assert again["loss"] == pytest.approx(recorded["loss"], rel=1e-6)
    assert (back / "logs" / "fit.txt").is_file() and (back / "logs" / "export.txt").is_file()
    assert list((back / "logs" / "run").glob("events.out.tfevents.*")) and not (back / "logs/run/checkpoints").exists()
    if step == "ptb-word":  # bundled at home from what came back (one recipe: it measures the whole splits)
        assert_release_builds(back, tmp_path, monkeypatch, capsys)
        assert_a_second_hop_carries_on(back, tmp_path / "hop2", checkpoint)


def assert_a_second_hop_carries_on(first: Path, tmp_path: Path, first_checkpoint: dict) -> None:
    """The next call's hop: the step again with START naming what the first brought back. It carries on from the
    first's chosen checkpoint, its steps and epochs counted on."""
    _, root, back = run_step("ptb-word", tmp_path, start=first / "export")
    epoch, step = first_checkpoint["epoch"] + 1, first_checkpoint["global_step"]
    assert f"lm-zoo: the run carries on from epoch {epoch} and step {step}" in (back / "logs" / "fit.txt").read_text()
    checkpoint = torch.load(
        root / "lightning_logs/version_0/checkpoints/last.ckpt", map_location="cpu", weights_only=False
    )
    assert checkpoint["global_step"] == 2 * STEPS  # max_steps counts from the run's start, the first hop's steps in it


def assert_release_builds(
    back: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m release build`` from the unpacked export and logs, into a registry of the test's own."""
    (tmp_path / "registry.json").write_text(json.dumps({"format_version": 2, "models": {}}))
    monkeypatch.setenv("LM_ZOO_REGISTRY", str(tmp_path / "registry.json"))
    monkeypatch.setenv("LM_ZOO_PRETRAINED", str(tmp_path / "pretrained"))
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    argv = ["build", "ptb-awd-tiny", "--ckpt", str(back / "export"), "--config", RECIPES["ptb-word"][0]]
    argv += ["--logs", str(back / "logs" / "run"), "--dtype", "float16", "--max-shard-size", "100KB"]
    capsys.readouterr()
    assert release_main(argv) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["training"]["hardware"] == hardware(torch.device("cpu"))  # where it trained: here, this time
    assert entry["training"]["steps"] == STEPS and entry["results"]["test"]["eval_batch_size"] == 1
    assert len([f for f in entry["files"] if f.startswith("model-")]) >= 2
    assert checkpoints.load("ptb-awd-tiny").training["global_step"] == STEPS
