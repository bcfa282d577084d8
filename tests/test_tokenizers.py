"""Tokenizers: vocabularies, unknown words, exact round trips, state round trips, unit counts."""

from __future__ import annotations

import pytest

from datamodules.tokenizers import EOS, UNK, Tokenizer, build_tokenizer

TEXT = " the cat sat \n the dog sat on the mat \n\n a cat \n"


def test_word_vocabulary_counts_and_eos_per_line() -> None:
    tok = build_tokenizer("word", TEXT)
    assert tok.symbols[:2] == [EOS, UNK]
    assert tok.symbols[2] == "the"  # most frequent first
    counts = dict(zip(tok.symbols, tok.counts))
    assert counts[EOS] == 4 and counts["the"] == 3 and counts["cat"] == 2
    ids = tok.encode_text(TEXT)
    assert len(ids) == 11 + 4  # words plus one <eos> per line, the blank line included
    assert tok.decode(ids) == "the cat sat\nthe dog sat on the mat\n\na cat\n"
    units = tok.count_units(TEXT, len(ids))
    assert units.words == units.tokens == 15


def test_unknown_words_map_to_unk_and_min_count() -> None:
    tok = build_tokenizer("word", TEXT, options={"min_count": 2})
    assert "dog" not in tok.index
    assert tok.encode("the zebra sat") == [tok.index["the"], tok.unk_id, tok.index["sat"]]
    assert dict(zip(tok.symbols, tok.counts))[UNK] == 4  # dog, on, mat and a fell below the cutoff


def test_char_spaced_symbols_like_ptb_char() -> None:
    text = "a _ c a t\nt h e _ d o g\n"
    tok = build_tokenizer("char", text, spaced_symbols=True)
    ids = tok.encode_text(text)
    assert len(ids) == 5 + 7 + 2  # symbols plus one end-of-line per line
    assert tok.decode(ids) == "a cat\nthe dog\n"
    assert tok.encode("a cat") == [tok.index[s] for s in "a _ c a t".split()]
    assert tok.count_units(text, len(ids)).chars == len(ids)  # bpc per symbol, as Mikolov's setup


def test_char_raw_text_counts_every_character() -> None:
    text = "héllo wörld\nzz\n"
    tok = build_tokenizer("char", text)
    ids = tok.encode_text(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("hq")) == "h\ufffd"  # unseen character


def test_byte_tokenizer_round_trip_and_bytes_as_chars() -> None:
    tok = build_tokenizer("byte", "")
    text = "naïve ∑\n"
    ids = tok.encode_text(text)
    assert tok.vocab_size == 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.count_units(text, len(ids)).chars == len(ids)


def test_sentencepiece_exact_round_trip_and_open_vocabulary() -> None:
    lines = [f" the {w} sat on  the mat, ﬁne {i} \t" for i, w in enumerate(["cat", "dog", "bird", "fish"] * 30)]
    text = "\n".join(lines) + "\n"
    tok = build_tokenizer("sentencepiece", text, options={"vocab_size": 300})
    ids = tok.encode_text(text)
    assert tok.decode(ids) == text  # identity normalisation, whitespace kept
    unseen = "zürich ∑ 🙂"
    assert tok.decode(tok.encode(unseen)) == unseen  # byte fallback: no <unk>
    units = tok.count_units(text, len(ids))
    assert (
        units.chars == len(text)
        and units.tokens == len(ids)
        and units.words == sum(len(line.split()) + 1 for line in lines)
    )


@pytest.mark.parametrize("kind", ["word", "char", "sentence", "byte", "sentencepiece"])
def test_state_dict_round_trip(kind: str) -> None:
    text = "\n".join(f"line {i} of some text here" for i in range(50)) + "\n"
    options = {"vocab_size": 290} if kind == "sentencepiece" else None
    tok = build_tokenizer(kind, text, options=options)
    again = Tokenizer.from_state_dict(tok.state_dict())
    assert type(again) is type(tok) and again.vocab_size == tok.vocab_size
    assert list(again.encode_text(text)) == list(tok.encode_text(text))


def test_unknown_tokenizer_kind() -> None:
    from zoo.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown tokenizer 'bpe'"):
        build_tokenizer("bpe", "x")


def test_white_space_after_the_last_newline_is_not_a_line() -> None:
    text = "a _ b\nc\n "  # PTB-char files end like this
    tok = build_tokenizer("char", text, spaced_symbols=True)
    assert len(tok.encode_text(text)) == 3 + 1 + 2
    assert len(build_tokenizer("word", " x \n\n y \n").encode_text(" x \n\n y \n")) == 5  # inner blank lines stay
