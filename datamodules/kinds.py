"""The two kinds of model lm-zoo trains, text and piano-roll music, and what differs between them, decided here once.

A model of text reads tokens and reports perplexity or bits per character (:func:`text_figures` says which); a model
of music (:mod:`zoo.music`) reads frames of 88 notes, has no tokenizer, one Bernoulli output per note, and reports
its negative log-likelihood per frame. The loaders, the export, the model cards, the registry and the commands ask a
:class:`ModelKind` what follows from that, instead of testing for music themselves. It imports nothing but the
errors, so the inference path and ``lm-zoo --help`` can read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zoo.errors import ConfigError

# A text result's figures (the Contracts: loss = mean nats per predicted token, ppl = exp(loss), bpc = nats per
# character / ln 2); word_ppl is the perplexity per word of the original text.
PPL, BPC, WORD_PPL = "ppl", "bpc", "word_ppl"
# A music result's figure: nats per frame, summed over the notes (Jozefowicz et al. 2015, Table 2).
NLL_PER_STEP = "nll_per_step"
# The tokenizers whose tokens are characters: their text is scored per character whatever the corpus's level.
CHARACTER_TOKENIZERS = ("char", "byte")
MUSIC_HEAD = "bernoulli"  # config.json's "head" of a piano-roll model: one Bernoulli per note (zoo.music)
# What a command may refuse a kind (ModelKind.refuse): scoring lines of text, evaluate's procedures.
SCORE, PROCEDURES = "score", "procedures"


def text_figures(per_character: bool, tokenizer: str | None) -> tuple[str, ...]:
    """The figures a text model reports beside its loss, the headline first: the one rule that training's logs,
    ``lm-zoo evaluate``, the model cards, the registry and the learning curves follow.

    Bits per character where each token is a character (a perplexity that close to 1 says little). A SentencePiece
    piece's perplexity depends on the vocabulary it was cut with, so beside it come bits per character and the
    perplexity per word of the original text, which do not. Perplexity per token otherwise (words, sentences).

    Args:
        per_character: whether the text is scored character by character (a character-level corpus or tokenizer).
        tokenizer: the tokenizer's kind (``word``, ``char``, ``byte``, ``sentence``, ``sentencepiece``).

    Returns:
        Some of :data:`PPL`, :data:`BPC`, :data:`WORD_PPL`, the one to quote first.
    """
    if tokenizer == "sentencepiece":
        return (PPL, BPC, WORD_PPL)
    return (BPC,) if per_character else (PPL,)


def music_figures(per_character: bool, tokenizer: str | None) -> tuple[str, ...]:
    """The figure a music model reports, whatever is asked: :data:`NLL_PER_STEP` (a frame is no text)."""
    return (NLL_PER_STEP,)


@dataclass(frozen=True, eq=False)
class ModelKind:
    """What a kind of model is scored by, reads and may not do; one object per kind (compared by identity).

    Attributes:
        name: ``text`` or ``music``.
        data_key: the data setting that names its corpus or dataset.
        metrics: the figures its results may report, any of which marks a result as this kind's.
        figures: which of them a model reports, the headline first, given whether its text is scored per character
            and its tokenizer's kind (:func:`text_figures`, :func:`music_figures`).
        metric_words: those figures in words, for messages.
        count: what its results count, the units its figures average over.
        head: ``config.json``'s ``"head"`` of every model of this kind; ``None`` where the network names its own
            (a text model's softmax, NCE, mixture of softmaxes, ...).
        has_tokenizer: whether it reads through a tokenizer (a frame of notes is its own input).
        sample_files: whether ``lm-zoo generate`` writes its samples as files (MIDI, under ``--out``) rather than
            printing text.
        refusals: what the commands refuse it (:data:`SCORE`, :data:`PROCEDURES`), each with the rest of the line
            that says so after "SOURCE is a <name> model".
    """

    name: str
    data_key: str
    metrics: tuple[str, ...]
    figures: Callable[[bool, str | None], tuple[str, ...]]
    metric_words: str
    count: str
    head: str | None
    has_tokenizer: bool
    sample_files: bool
    refusals: Mapping[str, str] = field(default_factory=dict)

    def refuse(self, what: str, source: str) -> None:
        """Stop a command that does not apply to this kind (``what``: :data:`SCORE`, :data:`PROCEDURES`).

        Raises:
            ConfigError: this kind refuses ``what``; the line names ``source`` and what to do instead.
        """
        why = self.refusals.get(what)
        if why is not None:
            raise ConfigError(f"{source} is a {self.name} model{why}")


TEXT = ModelKind(
    name="text",
    data_key="corpus",
    metrics=(PPL, BPC),
    figures=text_figures,
    metric_words="perplexity / bpc",
    count="tokens",
    head=None,
    has_tokenizer=True,
    sample_files=False,
)
MUSIC = ModelKind(
    name="music",
    data_key="dataset",
    metrics=(NLL_PER_STEP,),
    figures=music_figures,
    metric_words="NLL per frame",
    count="frames",
    head=MUSIC_HEAD,
    has_tokenizer=False,
    sample_files=True,
    refusals={
        SCORE: ": lm-zoo score scores text (lm-zoo evaluate scores music)",
        PROCEDURES: ", scored as it is: --temperature, --long-context, --mc-samples and --dynamic apply to text "
        "models; drop them",
    },
)
KINDS = (TEXT, MUSIC)
METRICS = tuple(metric for kind in KINDS for metric in kind.metrics)  # every figure a result may be quoted by


def kind_of_config(config: Mapping[str, Any]) -> ModelKind:
    """The kind of the model an export's ``config.json`` describes: told by its ``"head"``."""
    return next((kind for kind in KINDS if kind.head is not None and config.get("head") == kind.head), TEXT)


def kinds_of_result(result: Mapping[str, Any]) -> list[ModelKind]:
    """The kinds whose figures a result (an ``lm-zoo evaluate`` or registry record) holds: one for a sound result,
    none or two for a malformed one."""
    return [kind for kind in KINDS if any(metric in result for metric in kind.metrics)]


def kind_of_result(result: Mapping[str, Any]) -> ModelKind:
    """The kind of model a result was measured on, by the figures it holds (a text model's when it holds none)."""
    return next(iter(kinds_of_result(result)), TEXT)


def result_figures(result: Mapping[str, Any]) -> tuple[str, ...]:
    """The figures a result (an ``lm-zoo evaluate`` or registry record) reports, the headline first, by its kind's
    rule: a text result holds bits per character exactly where its text was scored per character or is
    SentencePiece's, so whether it holds them says which."""
    kind = kind_of_result(result)
    return tuple(figure for figure in kind.figures(BPC in result, result.get("tokenizer")) if figure in result)
