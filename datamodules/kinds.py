"""The two kinds of model lm-zoo trains, text and piano-roll music, and what differs between them, decided here once.

A model of text reads tokens and reports perplexity or bits per character (:func:`text_figures` says which); a model
of music (:mod:`zoo.music`) reads frames of 88 notes, has no tokenizer, one Bernoulli output per note, and reports
its negative log-likelihood per frame. The loaders, the export, the model cards, the registry and the commands ask a
:class:`ModelKind` what follows from that, instead of testing for music themselves. It imports nothing but the
errors (and the standard library), so the inference path and ``lm-zoo --help`` can read it.
"""

from __future__ import annotations

import math
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
# What a command may refuse a kind (ModelKind.refuse): scoring lines of text, evaluate's procedures, syntactic
# evaluation, parsing, an int8 copy (--quantize).
SCORE, PROCEDURES, SYNEVAL, PARSE, QUANTIZE = "score", "procedures", "syneval", "parse", "quantize"
# A text model's tokens in words, for messages: "a character-level text model".
LEVELS = {
    "word": "word-level",
    "sentence": "sentence-level",
    "char": "character-level",
    "byte": "byte-level",
    "sentencepiece": "subword (SentencePiece)",
}
# The tokenizers whose tokens are words: what syneval's minimal pairs and parse's treebank sentences are read as.
WORD_TOKENIZERS = ("word", "sentence")
# What the commands that read words refuse a text model whose tokens are not words (characters, bytes, pieces): the
# rest of the line after "SOURCE is a <level> text model", {tokens} its tokenizer's kind.
WORDS_ONLY = {
    SYNEVAL: "; lm-zoo syneval scores sentences word by word, and it reads {tokens} tokens: give a word-level model "
    "such as ptb-lstm-small",
    PARSE: "; lm-zoo parse splits sentences of words, and it reads {tokens} tokens: give a word-level ON-LSTM text "
    "model such as ptb-on-lstm",
}


def per_character(tokenizer: str | None, corpus_level: str | None) -> bool:
    """Whether a text is scored character by character, the one rule for training's logs, ``lm-zoo evaluate`` and
    the cards' curves: its tokens are characters (:data:`CHARACTER_TOKENIZERS`), or its corpus is a character-level
    one (``ptb-char``'s space-separated symbols, say) read by a tokenizer other than SentencePiece, whose pieces are
    scored as pieces (:func:`text_figures` gives them bits per character beside).

    Args:
        tokenizer: the tokenizer's kind.
        corpus_level: the corpus's ``level`` (``word`` or ``char``; ``datamodules.corpora.corpus_level``), ``None``
            where unknown.
    """
    return tokenizer in CHARACTER_TOKENIZERS or (tokenizer != "sentencepiece" and corpus_level == "char")


def bits_per_character(nats: Any, chars: int) -> Any:
    """Bits per character of a text whose tokens cost ``nats`` in all (a float or a tensor): nats per character over
    ln 2."""
    return nats / chars / math.log(2)


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
        refusals: what the commands refuse it (:data:`SCORE`, :data:`PROCEDURES`, :data:`SYNEVAL`, :data:`PARSE`,
            :data:`QUANTIZE`), each with the rest of the line that says so after "SOURCE is <what it is called>"
            (:meth:`called`) and what would serve instead.
        gloss: what the kind's name leaves unsaid, for messages (a music model's ``(piano rolls)``).
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
    gloss: str = ""

    def called(self, tokenizer: str | None = None) -> str:
        """The kind in words, for a message: ``a music model (piano rolls)``; a text model's with its tokens' level
        (``a character-level text model``) when its tokenizer's kind is given."""
        level = LEVELS.get(tokenizer) if self.has_tokenizer and tokenizer else None
        return f"a {level} {self.name} model" if level else f"a {self.name} model{self.gloss}"

    def refuse(self, what: str, source: str, tokenizer: str | None = None) -> None:
        """Stop a command that does not apply to this kind of model (``what``: :data:`SCORE`, :data:`PROCEDURES`,
        :data:`SYNEVAL`, :data:`PARSE`, :data:`QUANTIZE`), or to a text model whose tokens are not words where the
        command reads words (:data:`WORDS_ONLY`).

        Args:
            what: what the command does.
            source: the model, as the line names it.
            tokenizer: the model's tokenizer's kind (``word``, ``char``, ...; ``None``: a music model's, or not
                known, which no command that reads words is refused for).

        Raises:
            ConfigError: the model is refused; the line names ``source``, its kind, and what would serve instead.
        """
        why = self.refusals.get(what)
        if why is None and tokenizer is not None and tokenizer not in WORD_TOKENIZERS:
            why = WORDS_ONLY.get(what)
        if why is not None:
            raise ConfigError(f"{source} is {self.called(tokenizer)}{why.format(tokens=tokenizer)}")


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
        SCORE: "; lm-zoo score scores lines of text: give a text model such as ptb-lstm-small (lm-zoo evaluate "
        "scores music: NLL per frame)",
        PROCEDURES: ", scored as it is: --temperature, --long-context, --mc-samples and --dynamic apply to text "
        "models; drop them",
        SYNEVAL: "; lm-zoo syneval scores sentences of a text model word by word: give a word-level text model such "
        "as ptb-lstm-small",
        PARSE: "; lm-zoo parse splits sentences of words by an ON-LSTM's master forget gates: give a word-level "
        "ON-LSTM text model such as ptb-on-lstm",
        QUANTIZE: "; --quantize applies to text models (their LSTM/GRU and output layers in int8): drop --quantize, "
        "a music model runs in float32",
    },
    gloss=" (piano rolls)",
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
