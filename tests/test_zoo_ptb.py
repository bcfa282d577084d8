"""Every architecture in the zoo learns real PTB: a short budget brings validation perplexity from the ~10^4 of an
untrained model to below 1,000 (the training unigram distribution scores ~690, see test_real_data.py), measured on the
validation split's first 10,000 tokens' windows (the whole split took a third of each test's time).

Skipped only when LM_ZOO_DATA is unset and ../shared/data is absent (CI always sets it).
"""

from __future__ import annotations

import pytest

import zoo
from benchmarks.short_budget import ptb, train_briefly
from datamodules.data_modules import TextDataModule
from tests.conftest import DATA_ROOT, needs_data

# Every test here trains an architecture for 150 steps on PTB (seconds to tens of seconds each): all slow; each
# architecture's quick checks are tests/test_zoo.py's.
pytestmark = [needs_data("ptb", "ptb.train.txt"), pytest.mark.slow]


@pytest.fixture(scope="module")
def datamodule() -> TextDataModule:
    return ptb(str(DATA_ROOT))


@pytest.mark.parametrize("name", zoo.names())
def test_a_short_budget_on_ptb_reduces_validation_perplexity(name: str, datamodule: TextDataModule) -> None:
    result = train_briefly(name, datamodule, steps=150, hidden_size=32, num_layers=1, lr=5e-3, eval_tokens=10_000)
    assert result["ppl_before"] > 5_000, result  # untrained: about the vocabulary size (10,000)
    assert result["ppl_after"] < 1_000, result
