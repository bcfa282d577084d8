"""Real corpora from $LM_ZOO_DATA: a tiny model trained for a few hundred steps learns something real.

Skipped only when LM_ZOO_DATA is unset and ../shared/data is absent (CI always sets it).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

import cli
from tests.conftest import DATA_ROOT, needs_data

# Both tests train on PTB for hundreds of steps: all slow; the tiny fits elsewhere are the quick lane's.
pytestmark = [needs_data("ptb", "ptb.train.txt"), pytest.mark.slow]

CONFIG = """
seed_everything: 1
trainer:
  max_epochs: 1
  limit_train_batches: {steps}
  val_check_interval: {steps}
  gradient_clip_val: 1.0
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
model:
  class_path: lightning_modules.LanguageModel
  init_args: {{architecture: lstm, embedding_size: {emb}, hidden_size: {hidden}, num_layers: 1}}
data:
  class_path: datamodules.TextDataModule
  init_args: {{corpus: {corpus}, data_root: {data}, download: false, batch_size: {batch}, bptt: {bptt},
               eval_batch_size: 20, eval_bptt: 50}}
checkpoint:
  dirpath: {root}/checkpoints
optimizer:
  class_path: torch.optim.Adam
  init_args: {{lr: 0.005, betas: [0.0, 0.999]}}
"""


def _fit_and_evaluate(tmp_path: Path, capsys: pytest.CaptureFixture[str], **settings: object) -> dict:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(root=tmp_path / "run", data=DATA_ROOT, **settings))
    assert cli.main(["fit", "--config", str(config)]) == 0
    capsys.readouterr()
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert cli.main(["evaluate", str(last), "--split", "valid", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _unigram_ppl(train: Path, valid: Path) -> float:
    """Perplexity of the training unigram distribution (with <eos> per line) on the validation split."""
    counts: Counter[str] = Counter()
    for line in train.read_text().splitlines():
        counts.update(line.split() + ["<eos>"])
    total = sum(counts.values())
    nats, n = 0.0, 0
    for line in valid.read_text().splitlines():
        for word in line.split() + ["<eos>"]:
            nats -= math.log(counts[word] / total)
            n += 1
    return math.exp(nats / n)


def test_ptb_word_lstm_beats_the_unigram_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    result = _fit_and_evaluate(tmp_path, capsys, corpus="ptb", steps=300, emb=64, hidden=128, batch=20, bptt=35)
    unigram = _unigram_ppl(DATA_ROOT / "ptb" / "ptb.train.txt", DATA_ROOT / "ptb" / "ptb.valid.txt")
    assert result["tokens"] == 73_760  # 70,390 words + 3,370 <eos>: every token predicted once
    assert 600 < unigram < 800
    assert result["ppl"] < 0.5 * unigram, (result["ppl"], unigram)


def test_ptb_char_lstm_gets_below_3_bpc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    result = _fit_and_evaluate(tmp_path, capsys, corpus="ptb-char", steps=300, emb=32, hidden=128, batch=32, bptt=100)
    assert result["tokens"] == 389_672 + 3_370  # symbols + one end-of-line per line
    assert result["bpc"] < 3.0, result
