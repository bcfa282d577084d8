"""Tokenizers behind one interface: word, character, byte and SentencePiece.

A tokenizer turns a split's text into one flat stream of ids with an end-of-line token per line, and back. Its whole
state is a small JSON-able dict (:meth:`Tokenizer.state_dict`), stored in every checkpoint so that a model is always
used with the vocabulary it was trained on.

Units for metrics: besides tokens, each tokenizer counts the *characters* and *words* of the original text
(:meth:`Tokenizer.count_units`), so bits per character and per-word perplexity can be reported over the text itself,
comparable across tokenizers (a SentencePiece model's nats are divided by the text's characters, not its pieces).
"""

from __future__ import annotations

import base64
import io
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any, ClassVar

import numpy as np
import sentencepiece as spm

from zoo.errors import ConfigError

EOS = "<eos>"
UNK = "<unk>"
BOS_SENTENCE = "<S>"
EOS_SENTENCE = "</S>"
UNK_SENTENCE = "<UNK>"


@dataclass(frozen=True)
class TextUnits:
    """How much text a split holds, in the units metrics are normalised by.

    Attributes:
        tokens: ids in the encoded stream (= tokens predicted per epoch).
        chars: characters of the original text (for the byte tokenizer: bytes; for spaced symbols: symbols + lines).
        words: whitespace-separated words plus one end-of-line per line (the usual word-level count).
    """

    tokens: int
    chars: int
    words: int


def _lines(text: str) -> list[str]:
    """Lines without their newline; what follows the last newline counts only if it is more than white space.

    (Mikolov's PTB-char files end in ``"\n "``: that trailing space is no line, and counting it would add an <eos>.)
    """
    lines = text.split("\n")
    if lines and not lines[-1].strip():
        lines.pop()
    return lines


def _word_count(text: str) -> int:
    return sum(len(line.split()) + 1 for line in _lines(text))


class Tokenizer(ABC):
    """Maps text to ids and back. Subclasses register themselves under :attr:`kind`."""

    kind: ClassVar[str]
    _kinds: ClassVar[dict[str, type[Tokenizer]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:  # concrete tokenizers only
            Tokenizer._kinds[cls.kind] = cls

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """The end-of-line id: what sampling stops at (and starts from, unless the tokenizer has a ``bos_id``)."""

    @property
    def bos_id(self) -> int:
        """The id every sample starts from: the end-of-line id, except for tokenizers with a start-of-sentence token."""
        return self.eos_id

    @property
    def sentences(self) -> bool:
        """Whether the text is sentences, each between its own start and end token (GBW's ``sentence`` tokenizer):
        a model of it samples whole sentences (at temperature 0.7, as Léonard 2016) and is scored sentence by
        sentence, each from a zero state, rather than as one stream."""
        return self.bos_id != self.eos_id

    @abstractmethod
    def encode_text(self, text: str) -> np.ndarray:
        """A whole split as a flat int32 id stream, one end-of-line token per line."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """A prompt (no end-of-line added); unknown symbols map to the unknown id."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Ids back to text; the end-of-line id becomes a newline."""

    def unknown(self, text: str) -> list[str]:
        """The symbols of ``text`` that are not in the vocabulary (:meth:`encode` reads each as the unknown id);
        none for tokenizers that can spell anything (bytes, SentencePiece with byte fallback)."""
        return []

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer, JSON-serialisable, with ``"kind"``."""

    def count_units(self, text: str, num_tokens: int) -> TextUnits:
        """Characters and words of ``text`` (which encodes to ``num_tokens`` ids)."""
        return TextUnits(tokens=num_tokens, chars=len(text), words=_word_count(text))

    @staticmethod
    def from_state_dict(state: dict[str, Any]) -> Tokenizer:
        """Rebuild a tokenizer saved with :meth:`state_dict`."""
        kind = state.get("kind")
        if kind not in Tokenizer._kinds:
            raise ConfigError(f"unknown tokenizer kind {kind!r}: expected one of {', '.join(Tokenizer._kinds)}")
        return Tokenizer._kinds[kind]._from_state(state)

    @classmethod
    @abstractmethod
    def _from_state(cls, state: dict[str, Any]) -> Tokenizer: ...


class VocabularyTokenizer(Tokenizer):
    """A tokenizer with an explicit symbol list, built from the training split with counts (most frequent first).

    Args:
        symbols: id -> symbol; the first entries are the specials.
        counts: training-split count of each symbol (kept for unigram noise distributions and ``vocab.txt``).
    """

    specials: ClassVar[tuple[str, ...]] = (EOS, UNK)
    eos_symbol: ClassVar[str] = EOS
    unk_symbol: ClassVar[str] = UNK

    def __init__(self, symbols: list[str], counts: list[int]) -> None:
        if len(symbols) != len(counts) or len(set(symbols)) != len(symbols):
            raise ConfigError("a vocabulary needs unique symbols and one count per symbol")
        missing = [s for s in self.specials if s not in symbols]
        if missing:
            raise ConfigError(f"a {self.kind} vocabulary needs the special symbols {', '.join(missing)}")
        self.symbols = list(symbols)
        self.counts = list(counts)
        self.index = {s: i for i, s in enumerate(self.symbols)}
        self.unk_id = self.index[self.unk_symbol]

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def eos_id(self) -> int:
        return self.index[self.eos_symbol]

    @abstractmethod
    def _line_symbols(self, line: str) -> list[str]:
        """The symbols of one line (without the end-of-line)."""

    @classmethod
    def build(cls, text: str, min_count: int = 1, **options: Any) -> VocabularyTokenizer:
        """Build the vocabulary from a training split.

        Args:
            text: the training split.
            min_count: symbols seen fewer times map to ``<unk>``.
            **options: tokenizer options (see the subclass).
        """
        proto = cls(list(cls.specials), [0] * len(cls.specials), **options)
        counter: Counter[str] = Counter()
        lines = _lines(text)
        for line in lines:
            counter.update(proto._line_symbols(line))
        counter[EOS] += len(lines)
        kept = [(s, n) for s, n in counter.most_common() if n >= min_count and s not in cls.specials]
        dropped = sum(n for s, n in counter.items() if n < min_count and s not in cls.specials)
        symbols = list(cls.specials) + [s for s, _ in kept]
        counts = [counter[EOS], counter[UNK] + dropped] + [n for _, n in kept]
        return cls(symbols, counts, **options)

    def encode_text(self, text: str) -> np.ndarray:
        index, unk, eos = self.index, self.unk_id, self.eos_id
        ids: list[int] = []
        for line in _lines(text):
            ids.extend(index.get(s, unk) for s in self._line_symbols(line))
            ids.append(eos)
        return np.asarray(ids, dtype=np.int32)

    def encode(self, text: str) -> list[int]:
        return [self.index.get(s, self.unk_id) for s in self._line_symbols(text)]

    def unknown(self, text: str) -> list[str]:
        return [s for s in self._line_symbols(text) if s not in self.index and s != self.unk_symbol]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "symbols": self.symbols, "counts": self.counts}

    @classmethod
    def _from_state(cls, state: dict[str, Any]) -> Tokenizer:
        options = {k: v for k, v in state.items() if k not in ("kind", "symbols", "counts")}
        return cls(state["symbols"], state["counts"], **options)


class WordTokenizer(VocabularyTokenizer):
    """Whitespace-separated words with ``<eos>`` at the end of every line (Mikolov's PTB setup)."""

    kind = "word"

    def _line_symbols(self, line: str) -> list[str]:
        return line.split()

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        for i in ids:
            if i == self.eos_id:
                out.append("\n")
            else:
                out.append(self.symbols[i] + " ")
        return "".join(out).replace(" \n", "\n")


class CharTokenizer(VocabularyTokenizer):
    """Characters; or, with ``spaced_symbols``, space-separated symbols with ``_`` for spaces (Mikolov's PTB-char).

    Args:
        symbols: id -> symbol.
        counts: training counts.
        spaced_symbols: the corpus writes one symbol per space-separated field (PTB-char); otherwise every character
            is a symbol and the newline is the end-of-line token.
    """

    kind = "char"

    def __init__(self, symbols: list[str], counts: list[int], spaced_symbols: bool = False) -> None:
        super().__init__(symbols, counts)
        self.spaced_symbols = spaced_symbols

    def _line_symbols(self, line: str) -> list[str]:
        return line.split() if self.spaced_symbols else list(line)

    def encode(self, text: str) -> list[int]:
        if self.spaced_symbols:  # a prompt is plain text: one symbol per character, "_" for a space
            text = " ".join("_" if ch == " " else ch for ch in text)
        return super().encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        pieces = ["\n" if i == self.eos_id else ("\ufffd" if i == self.unk_id else self.symbols[i]) for i in ids]
        text = "".join(pieces)
        return text.replace("_", " ") if self.spaced_symbols else text

    def count_units(self, text: str, num_tokens: int) -> TextUnits:
        units = super().count_units(text, num_tokens)
        # PTB-char's bpc is per symbol (each character, "_" for a space, and the line end) as in Mikolov's setup.
        return TextUnits(units.tokens, num_tokens, units.words) if self.spaced_symbols else units

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "spaced_symbols": self.spaced_symbols}


class SentenceTokenizer(VocabularyTokenizer):
    """Independent sentences, one per line, as ``<S> w1 ... wn </S>``; words outside the vocabulary are ``<UNK>``.

    The One Billion Word benchmark's convention (Chelba et al. 2013; Léonard 2016 wraps every sentence in ``<S>`` and
    ``</S>``): words are separated by ASCII white space only, as the benchmark's byte-oriented tools split them (a
    no-break space inside a token is part of the word); blank lines are no sentences. ``counts`` holds the training
    count of every id, ``<S>`` and ``</S>`` once per sentence and ``<UNK>`` summing the words below the cutoff: the
    unigram distribution NCE draws its noise from.

    Args:
        symbols: id -> symbol; the first three are ``<S>``, ``</S>``, ``<UNK>``.
        counts: training count of each symbol.
    """

    kind = "sentence"
    specials: ClassVar[tuple[str, ...]] = (BOS_SENTENCE, EOS_SENTENCE, UNK_SENTENCE)
    eos_symbol: ClassVar[str] = EOS_SENTENCE
    unk_symbol: ClassVar[str] = UNK_SENTENCE

    def __init__(self, symbols: list[str], counts: list[int]) -> None:
        super().__init__(symbols, counts)
        self._byte_index: dict[bytes, int] | None = None

    @property
    def bos_id(self) -> int:
        """``<S>``: what every sentence, sampled or read, starts with."""
        return self.index[BOS_SENTENCE]

    def _line_symbols(self, line: str) -> list[str]:
        return self.split_words(line)

    @staticmethod
    def split_words(line: str) -> list[str]:
        """The words of a line, split at ASCII white space only (``str.split`` would also split at U+00A0)."""
        if line.isascii():
            return line.split()
        return [word.decode("utf-8") for word in line.encode("utf-8").split()]

    @classmethod
    def from_counts(cls, word_counts: Mapping[str, int], num_sentences: int, min_count: int = 1) -> SentenceTokenizer:
        """The vocabulary of words seen at least ``min_count`` times, most frequent first (ties by symbol).

        Args:
            word_counts: training count of every word (no markers).
            num_sentences: training sentences, the count of ``<S>`` and of ``</S>``.
            min_count: the cutoff; rarer words become ``<UNK>`` and add their counts to it.
        """
        kept = sorted(
            ((w, n) for w, n in word_counts.items() if n >= min_count and w not in cls.specials),
            key=lambda item: (-item[1], item[0]),
        )
        dropped = sum(n for w, n in word_counts.items() if n < min_count and w not in cls.specials)
        unk = word_counts.get(UNK_SENTENCE, 0) + dropped  # a corpus already holding <UNK> keeps its own too
        symbols = [*cls.specials, *(w for w, _ in kept)]
        counts = [num_sentences, num_sentences, unk, *(n for _, n in kept)]
        return cls(symbols, counts)

    @classmethod
    def build(cls, text: str, min_count: int = 1, **options: Any) -> SentenceTokenizer:
        """Build the vocabulary from a training split held in memory (``datamodules.gbw`` streams large ones)."""
        counter: Counter[str] = Counter()
        sentences = 0
        for line in _lines(text):
            words = cls.split_words(line)
            if words:
                counter.update(words)
                sentences += 1
        return cls.from_counts(counter, sentences, min_count)

    def encode_text(self, text: str) -> np.ndarray:
        index, unk = self.index, self.unk_id
        ids: list[int] = []
        for line in _lines(text):
            words = self._line_symbols(line)
            if words:
                ids.append(self.bos_id)
                ids.extend(index.get(w, unk) for w in words)
                ids.append(self.eos_id)
        return np.asarray(ids, dtype=np.int32)

    def encode_block(self, block: bytes) -> tuple[np.ndarray, np.ndarray]:
        """Encode whole lines of UTF-8 bytes at C speed: no Python string per word, no Python loop per token.

        Args:
            block: complete lines (what follows the last newline counts as a line).

        Returns:
            ``(ids, lengths)``: the int32 ids of every non-blank line as ``<S> w1 ... wn </S>``, laid end to end, and
            each of those sentences' length in ids (words + 2), int64.
        """
        if self._byte_index is None:
            self._byte_index = {s.encode("utf-8"): i for i, s in enumerate(self.symbols)}
        words = block.split()  # (W,) every word of the block; split() and split(b"\n") agree on the lines' words
        per_line = np.fromiter(map(len, map(bytes.split, block.split(b"\n"))), dtype=np.int64)
        per_line = per_line[per_line > 0]  # blank lines are no sentences
        word_ids = np.fromiter(map(self._byte_index.get, words, repeat(self.unk_id)), np.int32, count=len(words))
        lengths = per_line + 2
        ends = np.cumsum(lengths)  # (S,) one past each sentence's </S>
        ids = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int32)
        is_word = np.ones(len(ids), dtype=bool)
        is_word[ends - lengths] = False
        is_word[ends - 1] = False
        ids[ends - lengths] = self.bos_id
        ids[ends - 1] = self.eos_id
        ids[is_word] = word_ids
        return ids, lengths

    def decode(self, ids: Iterable[int]) -> str:
        """Sentences one per line; ``<S>`` is dropped and ``</S>`` ends the line."""
        out: list[str] = []
        bos, eos = self.bos_id, self.eos_id
        for i in ids:
            if i == eos:
                out.append("\n")
            elif i != bos:
                out.append(self.symbols[i] + " ")
        text = "".join(out).replace(" \n", "\n")
        return text[:-1] if text.endswith(" ") else text  # a sentence cut short has no </S> to end it

    def count_units(self, text: str, num_tokens: int) -> TextUnits:
        """Predicted tokens are every id but the ``<S>`` that opens each sentence; words count one ``</S>`` each."""
        sentences = sum(1 for line in _lines(text) if self._line_symbols(line))
        return TextUnits(tokens=num_tokens - sentences, chars=len(text), words=num_tokens - sentences)


class ByteTokenizer(Tokenizer):
    """The 256 byte values of the UTF-8 text (enwik8 convention: bits per character means bits per byte)."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def eos_id(self) -> int:
        return ord("\n")

    def encode_text(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes (which need not be UTF-8) as ids."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def count_units(self, text: str, num_tokens: int) -> TextUnits:
        return TextUnits(tokens=num_tokens, chars=num_tokens, words=_word_count(text))

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @classmethod
    def _from_state(cls, state: dict[str, Any]) -> Tokenizer:
        return cls()


class SentencePieceTokenizer(Tokenizer):
    """An open-vocabulary SentencePiece model trained on the training split, with exact text round trips.

    The settings that make ``decode(encode(s)) == s`` (identity normalisation, no whitespace collapsing, byte fallback
    instead of ``<unk>``) are fixed in :meth:`train`; they are what makes per-character metrics honest.
    """

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes) -> None:
        self.model_proto = model_proto
        self.processor = spm.SentencePieceProcessor(model_proto=model_proto)

    @classmethod
    def train(
        cls, text: str, vocab_size: int = 8000, model_type: str = "unigram", max_sentences: int = 2_000_000
    ) -> SentencePieceTokenizer:
        """Train on the lines of ``text``.

        Args:
            text: the training split.
            vocab_size: pieces, including the 256 byte pieces and 4 specials; a tiny corpus may yield fewer.
            model_type: ``unigram`` or ``bpe``.
            max_sentences: lines sampled for training.
        """

        def sentences() -> Iterator[str]:
            return (line for line in _lines(text) if line)

        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=1.0,
                byte_fallback=True,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                split_digits=True,
                pad_id=0,
                unk_id=1,
                bos_id=2,
                eos_id=3,
                hard_vocab_limit=False,
                input_sentence_size=max_sentences,
                shuffle_input_sentence=True,
                minloglevel=2,
            )
        except RuntimeError as err:
            raise ConfigError(f"SentencePiece training failed: {str(err).splitlines()[0]}") from None
        return cls(model.getvalue())

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self.processor.eos_id()

    def encode_text(self, text: str) -> np.ndarray:
        eos = self.eos_id
        ids: list[int] = []
        for pieces in self.processor.encode(_lines(text)):
            ids.extend(pieces)
            ids.append(eos)
        return np.asarray(ids, dtype=np.int32)

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        lines: list[list[int]] = [[]]
        for i in ids:
            if i == self.eos_id:
                lines.append([])
            else:
                lines[-1].append(int(i))
        return "\n".join(self.processor.decode(line) for line in lines)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "model_proto": base64.b64encode(self.model_proto).decode("ascii")}

    @classmethod
    def _from_state(cls, state: dict[str, Any]) -> Tokenizer:
        return cls(base64.b64decode(state["model_proto"]))


def build_tokenizer(
    kind: str, train_text: str, spaced_symbols: bool = False, options: dict[str, Any] | None = None
) -> Tokenizer:
    """Build a tokenizer of ``kind`` from the training split.

    Args:
        kind: ``word``, ``char``, ``sentence`` (one sentence per line in ``<S> ... </S>``), ``byte`` or
            ``sentencepiece``.
        train_text: the training split (ignored by ``byte``).
        spaced_symbols: the corpus is PTB-char style (``char`` only).
        options: ``min_count`` for word/char/sentence; ``vocab_size``, ``model_type``, ``max_sentences`` for
            sentencepiece.
    """
    options = dict(options or {})
    if kind == "word":
        return WordTokenizer.build(train_text, **options)
    if kind == "char":
        return CharTokenizer.build(train_text, spaced_symbols=spaced_symbols, **options)
    if kind == "sentence":
        return SentenceTokenizer.build(train_text, **options)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "sentencepiece":
        return SentencePieceTokenizer.train(train_text, **options)
    raise ConfigError(f"unknown tokenizer {kind!r}: use word, char, sentence, byte or sentencepiece")
