"""Single sentences read in batches, each from a zero state after ``<eos>``: their log-probabilities (``lm-zoo
score``, :func:`score_sentences`; targeted syntactic evaluation, :mod:`.syneval`) and the encoding and padding that
constituency parsing (:mod:`.parsing`) shares.

A sentence is padded at its end only: a recurrent model reads left to right, so the padding cannot change the steps
before it, and a batch gives each sentence what it would get alone. The scores themselves come from one place,
:meth:`zoo.RecurrentLM.score`.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
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


# The conventions an n-best column can be written in (``lm-zoo score --nbest --scale``): SRILM's n-best tools read
# log10 p, Kaldi's rescoring scripts a cost, the negated natural log (utils/rnnlm_compute_scores.sh writes those).
SCALES = ("log10", "ln", "kaldi-cost")


@dataclass
class SentenceScore:
    """A sentence's log-probability under a model: what ``lm-zoo score`` prints, one JSON object per sentence.

    Attributes:
        text: the sentence as given.
        logprob: log p(sentence) in nats: the sum over its tokens and, unless left out, its end (``<eos>``).
        log10prob: the same in base 10, SRILM's convention.
        tokens: the tokens scored (the end included).
        oov: the words (characters, for a character model) not in the vocabulary, each scored as ``<unk>``: a
            hypothesis with unknown words gets ``<unk>``'s probability for them, which toolkits report apart
            (SRILM's OOV count), so a rescorer can penalise them.
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

    def on_scale(self, scale: str) -> float:
        """The score in one of :data:`SCALES`: log10 p, ln p, or Kaldi's cost -ln p."""
        if scale not in SCALES:
            raise ValueError(f"unknown scale {scale!r}: one of {', '.join(SCALES)}")
        # + 0.0 turns -0.0 (the cost of a hypothesis with nothing scored) into 0.0, which prints without a sign.
        return {"log10": self.log10prob, "ln": self.logprob, "kaldi-cost": -self.logprob}[scale] + 0.0


def _sentence_score(text: str, scores: torch.Tensor, tokenizer: Any, per_token: bool) -> SentenceScore:
    logprob = float(scores.sum())
    return SentenceScore(
        text=text,
        logprob=logprob,
        log10prob=logprob / math.log(10),
        tokens=len(scores),
        oov=len(tokenizer.unknown(text)),
        token_logprobs=scores.tolist() if per_token else None,
    )


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

    At the edges: a sentence of no words scores its end alone, or, with ``end=()``, 0 nats over 0 tokens (in a
    document it leaves the carried state as it was); a sentence of any length is read whole, its state never cut at
    the training or evaluation window (docs/evaluation.md, "At the edges").

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
    if document:
        return list(stream_scores(model, tokenizer, sentences, document=True, end=end, per_token=per_token))
    end = [tokenizer.eos_id] if end is None else list(end)
    rows = [[tokenizer.bos_id, *tokenizer.encode(text), *end] for text in sentences]
    logprobs = model.score(rows, batch_size=batch_size, by_length=by_length)
    return [
        _sentence_score(text, scores, tokenizer, per_token) for text, scores in zip(sentences, logprobs, strict=True)
    ]


def stream_scores(
    model: RecurrentLM,
    tokenizer: Any,
    sentences: Iterable[str],
    batch_size: int = 64,
    document: bool = False,
    end: Sequence[int] | None = None,
    per_token: bool = False,
) -> Iterator[SentenceScore]:
    """:func:`score_sentences` over sentences read as they come (a file, a pipe): ``batch_size`` at a time, each
    batch's scores yielded in the given order as soon as it is scored, so memory is bounded by the batch and a reader
    downstream gets results while the input still flows. With ``document``, one sentence at a time, the state carried
    from each to the next (:meth:`zoo.RecurrentLM.score_document`).
    """
    if not document:
        for batch in batched(sentences, batch_size):
            yield from score_sentences(model, tokenizer, batch, batch_size, end=end, per_token=per_token)
        return
    end = [tokenizer.eos_id] if end is None else list(end)
    # The document's rows are handed to score_document one at a time, each as its score is asked for, so that a line
    # with nothing to score (an empty line with ``end=()``) can be answered here, in its place, without the model: a
    # recurrent network cannot read a window of no steps, and reading nothing leaves the carried state as it was.
    queue: deque[list[int]] = deque()

    def fed() -> Iterator[list[int]]:
        while True:
            yield queue.popleft()

    before = tokenizer.bos_id
    with contextlib.closing(model.score_document(fed())) as scorer:
        for text in sentences:
            ids = [*tokenizer.encode(text), *end]
            if ids:
                queue.append([before, *ids])
                scores = next(scorer)
                before = ids[-1]
            else:
                scores = torch.zeros(0, dtype=torch.float64)  # 0 nats over 0 tokens
            yield _sentence_score(text, scores, tokenizer, per_token)


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """``items`` in lists of ``size`` (the last may be shorter), read lazily (``itertools.batched`` needs 3.12)."""
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch
