"""Single sentences read in batches, each from a zero state after ``<eos>``: the encoding and padding that constituency
parsing (:mod:`.parsing`) and targeted syntactic evaluation (:mod:`.syneval`) share.

A sentence is padded at its end only: a recurrent model reads left to right, so the padding cannot change the steps
before it, and a batch gives each sentence what it would get alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


def sentence_batches(
    tokenizer: Any, sentences: Sequence[str], batch_size: int, end: Sequence[int] = ()
) -> Iterator[list[list[int]]]:
    """The token ids of the sentences, ``batch_size`` sentences at a time.

    Args:
        tokenizer: a word tokenizer with ``bos_id`` and ``encode``; unknown words become ``<unk>``.
        sentences: space-separated words.
        batch_size: sentences per batch (the last may hold fewer).
        end: ids appended to every sentence (syneval's full stop or ``<eos>``).

    Yields:
        One list per batch, of one row per sentence: ``bos_id``, the sentence's ids, then ``end``.
    """
    for first in range(0, len(sentences), batch_size):
        yield [[tokenizer.bos_id, *tokenizer.encode(s), *end] for s in sentences[first : first + batch_size]]


def pad(rows: Sequence[Sequence[int]], fill: int) -> torch.Tensor:
    """The rows as one ``(len(rows), longest)`` long tensor, each padded at its end with ``fill``."""
    padded = torch.full((len(rows), max(len(row) for row in rows)), fill, dtype=torch.long)
    for b, row in enumerate(rows):
        padded[b, : len(row)] = torch.tensor(row)
    return padded
