"""The reverse-copy task (Melis et al. 2020 §4.3): examples, what is scored, its multi-sequence windows, and a model
that learns it through ``lm-zoo fit`` and ``lm-zoo evaluate``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import cli
from datamodules import ReverseCopyDataModule
from datamodules.reverse_copy import MARKER
from datamodules.windows import IGNORE_INDEX
from tests.conftest import one_line_error


def module(**options: int) -> ReverseCopyDataModule:
    settings = {"num_symbols": 7, "min_length": 2, "max_length": 5, "train_examples": 40, "eval_examples": 9}
    return ReverseCopyDataModule(**{**settings, **options})


def examples_of(dm: ReverseCopyDataModule, split: str) -> list[tuple[list[int], list[int]]]:
    """Each example as (source, answer), read from the ids alone: the answer is what follows the marker, the source
    the ids before it that are not padding."""
    split_data = dm.encoded(split)
    marker, pad = dm.tokenizer.index[MARKER], dm.tokenizer.eos_id
    found = []
    for start, end in zip(split_data.offsets[:-1], split_data.offsets[1:], strict=True):
        row = split_data.ids[start:end].tolist()
        assert row.count(marker) == 1
        m = row.index(marker)
        padding = [i for i in row[:m] if i == pad]
        assert row[: len(padding)] == padding  # padding only in front
        found.append((row[len(padding) : m], row[m + 1 :]))
    return found


def test_the_answer_is_the_source_reversed_and_lengths_lie_in_the_range() -> None:
    dm = module()
    for split, count in (("train", 40), ("valid", 9), ("test", 9)):
        pairs = examples_of(dm, split)
        assert len(pairs) == count
        for source, answer in pairs:
            assert answer == source[::-1]
            assert 2 <= len(source) <= 5
            assert all(dm.tokenizer.symbols[i].isdigit() for i in source)  # symbols "0".."6", never a special
        assert dm.units(split).tokens == sum(len(source) for source, _ in pairs)
    lengths = {len(source) for source, _ in examples_of(module(train_examples=400), "train")}
    assert lengths == {2, 3, 4, 5}
    # Other seeds give other examples; the splits differ from each other.
    assert examples_of(dm, "valid") != examples_of(dm, "test")
    assert examples_of(module(seed=1), "train") != examples_of(dm, "train")


def test_the_memorisation_task_repeats_the_source_in_order() -> None:
    """reverse=False: Jozefowicz et al. 2015's memorisation filter (5 symbols of 26, read, then reproduced)."""
    dm = module(num_symbols=26, min_length=5, max_length=5, reverse=False)
    assert dm.corpus_name == "synthetic-copy"
    for source, answer in examples_of(dm, "train"):
        assert answer == source and len(source) == 5
    stream = dm.stream("valid", batch_size=2)
    assert stream.num_predicted == 9 * 5


def test_symbols_are_uniform_and_independent() -> None:
    dm = module(num_symbols=10, min_length=30, max_length=30, train_examples=2000)
    sources = np.array([source for source, _ in examples_of(dm, "train")])  # (2000, 30)
    counts = np.bincount(sources.ravel() - sources.min(), minlength=10)
    expected = sources.size / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30  # 9 degrees of freedom: p < 0.001 above 27.9
    # Successive tokens are independent: the same symbol follows a symbol about 1 time in 10.
    repeats = float((sources[:, 1:] == sources[:, :-1]).mean())
    assert abs(repeats - 0.1) < 0.01


@pytest.mark.parametrize(("batch_size", "bptt"), [(1, None), (3, None), (4, 5), (7, 23), (50, 11)])
def test_windows_score_exactly_the_answers(batch_size: int, bptt: int | None) -> None:
    """Over all windows, the scored (input, target) pairs are the answers' steps and nothing else: each answer token
    is predicted once, from the marker or the answer token before it, with the state reset at every example."""
    dm = module()
    pairs = examples_of(dm, "valid")
    stream = dm.stream("valid", batch_size=batch_size, bptt=bptt)
    assert stream.num_predicted == sum(len(source) for source, _ in pairs)
    marker = dm.tokenizer.index[MARKER]
    wanted = sorted(
        (prev, target) for source, answer in pairs for prev, target in zip([marker, *answer[:-1]], answer, strict=True)
    )
    scored, resets = [], 0
    for window in stream:
        keep = window.targets != IGNORE_INDEX
        scored += list(zip(window.inputs[keep].tolist(), window.targets[keep].tolist(), strict=True))
        resets += int(window.reset.sum())
    assert sorted(scored) == wanted
    assert resets == len(pairs)


def test_default_windows_hold_one_whole_example_per_column() -> None:
    """bptt defaults to one example's width, so every training window starts each column with a reset and holds the
    whole example: backpropagation reaches from every answer token back to its source."""
    dm = module(batch_size=4)
    windows = list(dm.stream("train"))
    assert len(windows) == 40 // 4
    for window in windows:
        assert window.inputs.shape == (4, 2 * 5 + 1)
        assert bool(window.reset[:, 0].all()) and not bool(window.reset[:, 1:].any())


def test_bad_settings_and_a_checkpoint_of_another_vocabulary_are_refused() -> None:
    with pytest.raises(Exception, match="min_length <= max_length"):
        module(min_length=4, max_length=3)
    with pytest.raises(Exception, match="num_symbols"):
        module(num_symbols=1)
    other = module(num_symbols=9)
    with pytest.raises(Exception, match="set data.num_symbols"):
        module().load_state_dict(other.state_dict())


CONFIG = """
seed_everything: 1
trainer:
  max_epochs: {epochs}
  gradient_clip_val: 1.0
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
model:
  class_path: lightning_modules.LanguageModel
  init_args: {{architecture: {architecture}, embedding_size: 16, hidden_size: 48, num_layers: 1,
              cell_options: {options}}}
data:
  class_path: datamodules.ReverseCopyDataModule
  init_args: {{num_symbols: 5, min_length: 3, max_length: 3, train_examples: 1600, eval_examples: 200,
              batch_size: 16, eval_batch_size: 50}}
optimizer:
  class_path: torch.optim.Adam
  init_args: {{lr: 0.01}}
"""


@pytest.mark.slow
@pytest.mark.parametrize(("architecture", "options"), [("lstm", "{}"), ("mogrifier", "{rounds: 4, rank: 4}")])
def test_a_small_model_learns_to_reverse(
    architecture: str, options: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trained through ``lm-zoo fit`` on 3 tokens of 5 symbols, the model's test cross-entropy on the answers, from
    ``lm-zoo evaluate``, falls far below guessing (ln 5 = 1.61 nats) and counts only the answer tokens."""
    torch.set_num_threads(1)
    config = tmp_path / "config.yaml"
    root = tmp_path / "run"
    config.write_text(CONFIG.format(epochs=6, root=root, architecture=architecture, options=options))
    assert cli.main(["fit", "--config", str(config)]) == 0
    capsys.readouterr()
    assert cli.main(["evaluate", str(root), "--split", "test", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 200 * 3
    assert result["corpus"] == "synthetic-reverse-copy"
    assert result["loss"] < 0.5, result


def test_a_bad_length_range_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.yaml"
    text = CONFIG.format(epochs=1, root=tmp_path / "run", architecture="lstm", options="{}")
    config.write_text(text.replace("min_length: 3", "min_length: 4"))
    one_line_error(capsys, cli.main(["fit", "--config", str(config)]), "min_length <= max_length")
