"""The output heads under DDP (CPU, gloo, two processes): the adaptive softmax when a tail cluster has no target on one
rank, and the NCE noise tables, which DDP must not broadcast every forward.

The fit runs ``lm-zoo fit`` as a subprocess, so that Lightning's DDP can re-launch the command for rank 1 (as in
tests/test_gbw_ddp.py); the broadcast count wraps the LanguageModel in ``DistributedDataParallel`` with the arguments
Lightning's ``ddp`` strategy gives it (none: ``broadcast_buffers=True``) in two spawned processes.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

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
VOCAB = 1000


def _count_broadcasts(rank: int, rendezvous: str, results: Any) -> None:
    """One rank: bytes DDP broadcasts at wrapping and per forward, for the NCE language model and for a control
    module that has a buffer (BatchNorm's running statistics); any error goes to ``results`` too, so that the test
    fails with it at once instead of waiting out its timeout."""
    try:
        results.put((rank, _broadcasts(rank, rendezvous)))
    except Exception as error:  # noqa: BLE001 - reported to the test, which fails on it
        results.put((rank, f"{type(error).__name__}: {error}"))


def _broadcasts(rank: int, rendezvous: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_modules import LanguageModel

    torch.set_num_threads(1)
    # A file, not a TCP port: a port found free and handed to both ranks can be taken meanwhile by another test's
    # process (the suspected cause of the one run, under two pytest workers, in which neither rank ever reported).
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    sent: list[int] = []
    original = dist._broadcast_coalesced

    def counting(group: Any, tensors: list[torch.Tensor], bucket_size: int, src: int) -> None:
        sent.append(sum(t.numel() * t.element_size() for t in tensors))
        original(group, tensors, bucket_size, src)

    dist._broadcast_coalesced = counting  # what DDP calls, for its parameters at wrapping and its buffers per forward
    torch.manual_seed(0)
    model = LanguageModel(vocab_size=VOCAB, embedding_size=8, hidden_size=8, num_layers=1, head="nce", noise_samples=4)
    model.set_noise_distribution(torch.arange(1, VOCAB + 1))
    control = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    figures = {}
    for name, module, inputs in [
        ("nce", model, torch.randint(0, VOCAB, (2, 5))),
        ("batchnorm", control, torch.randn(3, 4)),
    ]:
        sent.clear()
        wrapped = DistributedDataParallel(module)  # Lightning's DDPStrategy passes no kwargs by default
        at_wrapping = sum(sent)
        sent.clear()
        for _ in range(2):
            output = wrapped(inputs)
            (output[0] if isinstance(output, tuple) else output).float().mean().backward()
        figures[name] = (at_wrapping, list(sent))
    tables = torch.cat([model.model.decoder.noise.probs, model.model.decoder.noise.accept])
    gathered = [torch.empty_like(tables) for _ in range(2)]
    dist.all_gather(gathered, tables)
    figures["tables_equal"] = torch.equal(gathered[0], gathered[1])
    dist.destroy_process_group()
    return figures


@pytest.mark.slow
def test_ddp_does_not_broadcast_the_nce_noise_tables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The four vocabulary-sized tables (20 bytes a word) were buffers, which DDP broadcast from rank 0 before every
    forward: 20,000 bytes a forward here, measured. Each rank computes them itself from the same counts."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    workers = [context.Process(target=_count_broadcasts, args=(rank, rendezvous, results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    try:
        figures = dict(results.get(timeout=TIMEOUT) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    assert all(isinstance(figure, dict) for figure in figures.values()), figures  # else a rank's error
    assert [worker.exitcode for worker in workers] == [0, 0]
    for rank in range(2):
        at_wrapping, per_forward = figures[rank]["nce"]
        assert at_wrapping > 0 and per_forward == [], (rank, figures[rank])  # the parameters once, then nothing
        # The counter sees what DDP does send: BatchNorm's running statistics (3 x 4 floats and one int64) each forward.
        assert figures[rank]["batchnorm"][1] == [4 * 4 + 4 * 4 + 8] * 2, figures[rank]
        assert figures[rank]["tables_equal"]


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
