"""Fits of a small LSTM on the GBW sample in a process of their own, on one device or several, and their validation
perplexity: the CPU suite's 2-process DDP run (``tests/test_gbw_ddp.py``) and the GPU suite's 2-GPU run compare them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import DATA_ROOT, ROOT

CONFIG = ROOT / "configs" / "gbw-sample" / "lstm-2x250-softmax.yaml"


# Measured (validation perplexity after 40 steps of the 2 x 16 LSTM below, full valid shard, eval batch 64):
#   seed 1: single 747.341, DDP 747.391 (relative difference 0.00007)
#   seed 2: single 762.598, DDP 762.158 (0.00058)
#   another seed moves it by 0.020 (747.3 -> 762.6)
# so a tolerance of 0.005 is ~9x the largest DDP/single difference and 4x below what another seed changes.
TOLERANCE = 0.005


def fit(tmp_path: Path, name: str, devices: int, seed: int, accelerator: str = "cpu") -> Path:
    columns = 8 // devices  # the same global batch
    run = tmp_path / name
    command = [
        sys.executable,
        "-m",
        "cli",
        "fit",
        "--config",
        str(CONFIG),
        f"--seed_everything={seed}",
        f"--data.init_args.seed={seed}",
        f"--data.init_args.data_root={DATA_ROOT}",
        f"--data.init_args.batch_size={columns}",
        "--data.init_args.bptt=20",
        "--model.init_args.embedding_size=16",
        "--model.init_args.hidden_size=16",
        "--trainer.max_steps=40",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.logger=false",
        f"--trainer.accelerator={accelerator}",
        f"--trainer.devices={devices}",
        f"--trainer.strategy={'ddp' if devices > 1 else 'auto'}",
        f"--trainer.default_root_dir={run}",
        f"--checkpoint.dirpath={run}/checkpoints",
    ]
    env = {**os.environ, "LM_ZOO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return run / "checkpoints" / "last.ckpt"


def validation_ppl(checkpoint: Path) -> float:
    import checkpoints
    from evaluation.perplexity import evaluate

    loaded = checkpoints.load(str(checkpoint))
    datamodule = loaded.datamodule(data_root=str(DATA_ROOT))
    return evaluate(loaded.model, datamodule, "valid", batch_size=64, bptt=50).ppl
