"""Evaluation of a language model over a whole split: the numbers ``lm-zoo evaluate`` reports.

The loop is written out rather than run through ``Trainer.test`` so that the result carries exact counts (summed in
float64) and every setting perplexity depends on: the eval batch size (each of the B streams starts without context)
and the BPTT length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from datamodules.streams import IGNORE_INDEX
from datamodules.text import TextDataModule
from lightning_modules.language_model import LanguageModel


@torch.no_grad()
def evaluate(
    model: LanguageModel,
    datamodule: TextDataModule,
    split: str = "test",
    batch_size: int | None = None,
    bptt: int | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Score a split with the full softmax, deterministically (dropout off).

    Args:
        model: the language model (its vocabulary must be the data module's).
        datamodule: provides the split's stream and its size in tokens/characters/words.
        split: ``train``, ``valid`` or ``test``.
        batch_size: parallel streams; ``None`` uses the data module's eval batch size.
        bptt: window length; ``None`` uses the data module's eval BPTT.
        device: where to run.

    Returns:
        ``split, corpus, tokens, loss`` (mean nats per token), ``ppl``, ``bpc`` (character-level corpora and
        SentencePiece), ``word_ppl`` (when tokens are not words), ``eval_batch_size``, ``bptt``.
    """
    model.eval().to(device)
    stream = datamodule.stream(split, batch_size=batch_size, bptt=bptt)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    state = None
    for batch in stream:
        targets = batch.targets.to(device)
        reset = None if batch.reset is None else batch.reset.to(device)
        nll, state = model.token_nll(batch.inputs.to(device), targets, state, reset)
        total += nll.double().sum()
        count += int((targets != IGNORE_INDEX).sum())
    units = datamodule.units(split)
    nats = float(total)
    loss = nats / count
    result: dict[str, Any] = {
        "split": split,
        "corpus": datamodule.corpus_name,
        "tokenizer": datamodule.tokenizer.kind,
        "tokens": count,
        "loss": loss,
        "ppl": math.exp(loss),
    }
    if datamodule.level == "char" or datamodule.tokenizer.kind == "sentencepiece":
        result["bpc"] = nats / units.chars / math.log(2)
    if datamodule.tokenizer.kind == "sentencepiece":  # per-word perplexity over the original text
        result["word_ppl"] = math.exp(nats / units.words)
    result.update(eval_batch_size=stream.batch_size, bptt=stream.bptt)
    return result
