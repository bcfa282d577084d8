"""The 2-process DDP recipe the multi-process tests train (``tests/test_ddp.py``, ``tests/test_multinode.py``) and
reading the checkpoints they write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

RECIPE = """
seed_everything: 3
trainer:
  max_steps: {max_steps}
  accelerator: cpu
  devices: 2
  strategy: ddp
  num_sanity_val_steps: 0
  limit_val_batches: 0
  enable_progress_bar: false
  enable_model_summary: false
  logger: false
  default_root_dir: {root}
  callbacks:
{callbacks}
model:
  class_path: lightning_modules.LanguageModel
  init_args:
    architecture: lstm
    embedding_size: 16
    hidden_size: 16
    num_layers: 2
    dropout: 0.3
    head: nce
    noise_samples: 8
data:
  class_path: datamodules.TextDataModule
  init_args:
    corpus: {corpus}
    batch_size: 4
    bptt: 8
    variable_bptt: true
    seed: 5
checkpoint:
  dirpath: {root}/checkpoints
last_checkpoint:
  every_n_train_steps: 5
optimizer:
  class_path: torch.optim.Adam
  init_args: {{lr: 0.01}}
"""


MAX_STEPS = 12  # all in epoch 0 (each rank has ~28 windows of its 4 columns)


def ddp_recipe(directory: Path, corpus: Path, *callbacks: str, max_steps: int = MAX_STEPS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    recipe = directory / "recipe.yaml"
    listed = "".join(callbacks) or "    []\n"
    recipe.write_text(RECIPE.format(max_steps=max_steps, root=directory, corpus=corpus, callbacks=listed))
    return recipe


def read_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)
