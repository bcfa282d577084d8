"""The output heads under DDP (CPU, gloo, two processes): the adaptive softmax when a tail cluster has no target on one
rank, and the NCE noise tables, which DDP must not broadcast every forward.

The fit runs ``lm-zoo fit`` as a subprocess, so that Lightning's DDP can re-launch the command for rank 1 (as in
tests/test_gbw_ddp.py); the broadcast count wraps the LanguageModel in ``DistributedDataParallel`` with the arguments
Lightning's ``ddp`` strategy gives it (none: ``broadcast_buffers=True``) in two processes of tests/ddp_broadcasts.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

CUTOFFS = [10, 14]  # head: <eos>, <unk> and the 8 frequent words; clusters: rare words 10-13 and 14-17
BPTT = 10
STEPS = 6
TIMEOUT = 240  # catches a hang (a rank waiting for a reduction the other never starts), not a speed limit


def write_corpus(directory: Path) -> Path:
    """40 lines of 10 words: the frequent f0-f7 everywhere, each rare word r0-r7 twice, in the first 16 lines only.

    The stream's first half is rank 0's column and its second half rank 1's (batch 1 per rank), so rank 1 never
    predicts a tail word: both tail clusters are empty on rank 1 in every step.
    """
    lines = []
    for i in range(40):
        words = [f"f{(3 * i + j) % 8}" for j in range(10)]
        if i < 16:
            words[5] = f"r{i % 8}"
        lines.append(" ".join(words))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.txt").write_text("\n".join(lines) + "\n")
    (directory / "valid.txt").write_text("\n".join(lines[20:24]) + "\n")
    (directory / "test.txt").write_text("\n".join(lines[24:28]) + "\n")
    return directory


def tail_targets_per_rank(corpus: Path) -> list[list[int]]:
    """For each rank, how many targets of each of the first ``STEPS`` training windows fall in a tail cluster."""
    from datamodules.text_data import TextData
    from datamodules.windows import StreamWindows

    data = TextData(corpus=str(corpus), batch_size=1, bptt=BPTT)
    assert data.vocab_size == 18 and all(s.startswith("r") for s in data.tokenizer.symbols[CUTOFFS[0] :])
    counts = []
    for rank in range(2):
        stream = StreamWindows(data.encoded("train"), 1, BPTT, data.tokenizer.eos_id, rank=rank, world_size=2)
        windows = [batch for _, batch in zip(range(STEPS), stream)]
        counts.append([int((batch.targets >= CUTOFFS[0]).sum()) for batch in windows])
    return counts


@pytest.mark.slow
def test_adaptive_head_trains_under_ddp_with_a_tail_cluster_empty_on_one_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before every cluster took part in every step's graph this fit stopped at its second step: "It looks like your
    LightningModule has parameters that were not used in producing the loss" (DDP without find_unused_parameters)."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path / "corpus")
    rank0, rank1 = tail_targets_per_rank(corpus)
    assert sum(rank0) > 0 and sum(rank1) == 0, (rank0, rank1)  # the situation occurs in every step on rank 1

    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "cli",
        "fit",
        "--model=LanguageModel",
        "--data=TextDataModule",
        f"--data.init_args.corpus={corpus}",
        "--data.init_args.batch_size=1",
        f"--data.init_args.bptt={BPTT}",
        "--model.init_args.embedding_size=8",
        "--model.init_args.hidden_size=16",
        "--model.init_args.num_layers=1",
        "--model.init_args.head=adaptive",
        f"--model.init_args.adaptive_cutoffs={CUTOFFS}",
        "--optimizer=SGD",
        "--optimizer.lr=0.5",
        "--seed_everything=1",
        f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.strategy=ddp",
        f"--trainer.default_root_dir={run}",
        f"--checkpoint.dirpath={run}/checkpoints",
    ]
    env = {**os.environ, "LM_ZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == STEPS


# ----------------------------------------------------------------------------------------- NCE noise tables
@pytest.mark.slow
def test_ddp_does_not_broadcast_the_nce_noise_tables(tmp_path: Path) -> None:
    """The four vocabulary-sized tables (20 bytes a word) were buffers, which DDP broadcast from rank 0 before every
    forward: 20,000 bytes a forward here, measured. Each rank computes them itself from the same counts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.ddp_broadcasts", str(rank), rendezvous],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for process in ranks:
            # A rank stuck for tests.ddp_broadcasts.STUCK_AFTER prints its stacks and exits before this runs out.
            outputs.append(process.communicate(timeout=TIMEOUT))
    finally:
        for process in ranks:
            process.kill()
    for rank, (process, (stdout, stderr)) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank} exited {process.returncode}:\n{stderr[-4000:]}"
    figures = [json.loads(stdout) for stdout, _ in outputs]
    for rank, figure in enumerate(figures):
        at_wrapping, per_forward = figure["nce"]
        assert at_wrapping > 0 and per_forward == [], (rank, figure)  # the parameters once, then nothing
        # The counter sees what DDP does send: BatchNorm's running statistics (3 x 4 floats and one int64) each forward.
        assert figure["batchnorm"][1] == [4 * 4 + 4 * 4 + 8] * 2, figure
    assert figures[0]["tables"] == figures[1]["tables"]  # each rank's own noise tables, the same


def test_the_noise_tables_follow_the_module_but_are_not_buffers() -> None:
    from zoo.nce import NCEHead

    head = NCEHead(4, 6, noise_samples=3)
    head.set_noise_distribution([5, 4, 3, 2, 1, 0])
    assert list(head.buffers()) == [] and not any("noise" in key for key in head.state_dict())
    probs = head.noise.probs.clone()
    head.double()
    noise = head.noise
    assert noise.probs.dtype == noise.log_probs.dtype == noise.accept.dtype == torch.float64
    assert noise.alias.dtype == torch.int64  # a cast of the floats only, as for buffers
    torch.testing.assert_close(noise.probs, probs.double(), atol=1e-7, rtol=0)
    head.to(torch.device("meta"))
    assert noise.probs.device.type == noise.alias.device.type == "meta"
