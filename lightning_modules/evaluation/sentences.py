"""Single sentences read in batches, each from a zero state after ``<eos>``: their log-probabilities (``lm-zoo
score``, :func:`score_sentences`; targeted syntactic evaluation, :mod:`.syneval`) and the encoding and padding that
constituency parsing (:mod:`.parsing`) shares.

A sentence is padded at its end only: a recurrent model reads left to right, so the padding cannot change the steps
before it, and a batch gives each sentence what it would get alone. The scores themselves come from one place,
:meth:`zoo.RecurrentLM.score`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zoo.language_model import RecurrentLM


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


@dataclass
class SentenceScore:
    """A sentence's log-probability under a model: what ``lm-zoo score`` prints, one JSON object per sentence.

    Attributes:
        text: the sentence as given.
        logprob: log p(sentence) in nats: the sum over its tokens and, unless left out, its end (``<eos>``).
        log10prob: the same in base 10, as ASR toolkits (SRILM, Kaldi's n-best rescoring) expect.
        tokens: the tokens scored (the end included).
        oov: the words (characters, for a character model) not in the vocabulary, each scored as ``<unk>``.
        token_logprobs: each scored token's log-probability (nats), when asked for.
    """

    text: str
    logprob: float
    log10prob: float
    tokens: int
    oov: int
    token_logprobs: list[float] | None = field(default=None)

    def to_json(self) -> dict[str, object]:
        """The JSON object, with the per-token figures only when they were asked for, and the perplexity."""
        record = {k: v for k, v in self.__dict__.items() if k != "token_logprobs"}
        record["ppl"] = math.exp(-self.logprob / self.tokens) if self.tokens else None
        if self.token_logprobs is not None:
            record["token_logprobs"] = self.token_logprobs
        return record


def score_sentences(
    model: RecurrentLM,
    tokenizer: Any,
    sentences: Sequence[str],
    batch_size: int = 64,
    document: bool = False,
    end: Sequence[int] | None = None,
    per_token: bool = False,
    by_length: bool = True,
) -> list[SentenceScore]:
    """log p(sentence) of each sentence, read after ``<eos>`` (``<S>`` for sentence models such as GBW's).

    Args:
        model: a text model.
        tokenizer: its tokenizer; unknown words are read and scored as ``<unk>`` and counted in ``oov``.
        sentences: the sentences (words separated by spaces for a word model).
        batch_size: sentences per forward pass; it changes no score.
        document: read the sentences as one running text, each in the context of those before it (the default reads
            each from the zero state, as n-best rescoring needs).
        end: the ids scored after each sentence (default: the end-of-sentence id; ``()`` scores the words alone).
        per_token: keep every token's log-probability.
        by_length: batch sentences of similar length together (:meth:`zoo.RecurrentLM.score`); the scores come back
            in the given order either way.
    """
    end = [tokenizer.eos_id] if end is None else list(end)
    encoded = [tokenizer.encode(text) + end for text in sentences]
    if document:
        rows, before = [], tokenizer.bos_id
        for ids in encoded:
            rows.append([before, *ids])
            before = ids[-1] if ids else before
    else:
        rows = [[tokenizer.bos_id, *ids] for ids in encoded]
    logprobs = model.score(rows, batch_size=1 if document else batch_size, carry_state=document, by_length=by_length)
    return [
        SentenceScore(
            text=text,
            logprob=float(scores.sum()),
            log10prob=float(scores.sum()) / math.log(10),
            tokens=len(scores),
            oov=len(tokenizer.unknown(text)),
            token_logprobs=scores.tolist() if per_token else None,
        )
        for text, scores in zip(sentences, logprobs, strict=True)
    ]
