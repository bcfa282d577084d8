import math
import random
import re

import pytest

from datamodules import corpora, synthetic
from datamodules.synthetic import (
    SYNTHETIC_TASKS,
    arithmetic_example,
    generate_splits,
    xml_closing_tags_matched,
    xml_document,
    xml_next_characters,
)
from tests.conftest import XML_TAG, drawn_bits
from zoo.errors import DataError

ARITHMETIC = re.compile(r"(-?\d+)([+-])(-?\d+)=(-?\d+)\.")
SMALL = {"train_chars": 3000, "valid_chars": 500, "test_chars": 500}


def check_xml(doc: str) -> int:
    """Assert that ``doc`` is well formed as the paper generates it; return how many tags it opens."""
    assert XML_TAG.sub("", doc) == "", "only tags, nothing between them"
    stack: list[str] = []
    opened = 0
    for close, name in XML_TAG.findall(doc):
        assert re.fullmatch(r"[a-z]{2,10}", name), name
        if close:
            assert stack and stack[-1] == name, f"</{name}> does not close the latest open tag"
            stack.pop()
        else:
            stack.append(name)
            opened += 1
    assert not stack, "tags left open"
    return opened


def test_xml_documents_are_well_formed_and_respect_the_iteration_limit():
    rng = random.Random(7)
    opened = [check_xml(xml_document(rng)) for _ in range(3000)]
    # One tag before the loop plus at most one per iteration before closing becomes forced.
    assert max(opened) <= 1 + synthetic.XML_MAX_ITERATIONS
    assert min(opened) >= 1
    assert max(opened) > 10, "deep documents occur"


def test_xml_close_probability_is_one_half():
    rng = random.Random(3)
    # The first step closes the root with probability 1/2, which gives a two-tag document "<a></a>" at once.
    short = sum(xml_document(rng).count("<") == 2 for _ in range(4000))
    assert 0.2 < short / 4000 < 0.3  # P = 1/2 (close) * 1/2 (then stop) = 1/4


def test_arithmetic_examples_are_correct():
    rng = random.Random(11)
    lengths = set()
    for _ in range(3000):
        line = arithmetic_example(rng)
        lhs, rhs = line.split("=")
        assert re.fullmatch(r"[a-z0-9+-]+", lhs) and re.fullmatch(r"-?\d+\.", rhs), line
        m = ARITHMETIC.fullmatch(re.sub("[a-z]", "", lhs) + "=" + rhs)
        assert m, line
        a, op, b, result = int(m[1]), m[2], int(m[3]), int(m[4])
        assert result == (a + b if op == "+" else a - b), line
        for operand in (m[1], m[3]):
            digits = operand.lstrip("-")
            assert 1 <= len(digits) <= 8 and (digits == "0" or not digits.startswith("0")), line
            lengths.add(len(digits))
        assert set(line) <= set("abcdefghijklmnopqrstuvwxyz0123456789+-=."), "the paper's 40-symbol alphabet"
    assert lengths == set(range(1, 9))


def test_arithmetic_distractors_occur_between_input_characters_only():
    rng = random.Random(5)
    lines = [arithmetic_example(rng) for _ in range(500)]
    lhs = [line.split("=")[0] for line in lines]
    assert sum(any(c.isalpha() for c in s) for s in lhs) > 400
    assert all(not any(c.isalpha() for c in line.split("=")[1]) for line in lines)
    # Runs of 0..3 letters only.
    assert max(len(run) for s in lhs for run in re.findall("[a-z]+", s)) == 3
    assert any(s[0] in "-0123456789" and s[1] in "-+0123456789" for s in lhs), "zero distractors happen too"


def test_both_signs_and_operators_occur():
    text = generate_splits("arithmetic", seed=1, **SMALL)["train"]
    plain = [re.sub("[a-z]", "", line) for line in text.splitlines()]
    assert any(line.startswith("-") for line in plain) and any(not line.startswith("-") for line in plain)
    assert any("--" in line for line in plain) and any("+-" in line for line in plain)
    assert any(re.match(r"-?\d+\+\d", line) for line in plain)


def test_tasks_registry():
    assert set(SYNTHETIC_TASKS) == {"xml", "arithmetic"}


@pytest.mark.parametrize("task", ["xml", "arithmetic"])
def test_generate_splits_is_deterministic_and_sized(task):
    first = generate_splits(task, seed=0, **SMALL)
    assert first == generate_splits(task, seed=0, **SMALL)
    assert first != generate_splits(task, seed=1, **SMALL)
    assert first["train"] != first["valid"] != first["test"]
    for split, size in (("train", 3000), ("valid", 500), ("test", 500)):
        text = first[split]
        assert text.endswith("\n")
        assert len(text) >= size
        last = text[:-1].rsplit("\n", 1)[-1] + "\n"
        assert len(text) - len(last) < size, "stops at the first whole line that reaches the size"
    # Splits are independent streams: resizing train leaves valid alone.
    assert generate_splits(task, seed=0, train_chars=100, valid_chars=500, test_chars=500)["valid"] == first["valid"]


def test_generate_splits_is_stable_across_runs():
    # Pinned text: a seed must give the same corpus in every Python process and on every machine (no salted hash()).
    tiny = {"train_chars": 1, "valid_chars": 1, "test_chars": 1}
    assert generate_splits("arithmetic", seed=0, **tiny) == {
        "train": "-w5dbf-7un7o4o48d5hyo3w=-7744858.\n",
        "valid": "-t8mj1rt15ucw8bw-d-rt6jyz8l4hx9a3j50k9cub=68412351.\n",
        "test": "2ap9cqb-j181eh2bjw21=-181192.\n",
    }
    assert generate_splits("xml", seed=0, **tiny)["test"] == (
        "<zzw><vtn></vtn></zzw><cqbsjccj><keyxct></keyxct></cqbsjccj>\n"
    )


def test_generate_splits_rejects_bad_input():
    with pytest.raises(DataError, match="unknown synthetic task"):
        generate_splits("sorting")
    with pytest.raises(DataError, match="valid_chars"):
        generate_splits("xml", valid_chars=0)


def test_resolve_synthetic_corpus_writes_once_to_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = corpora.resolve_corpus("synthetic-xml", options={"seed": 3, **SMALL})
    assert corpus.level == "char" and corpus.default_tokenizer == "char"
    paths = [corpus.splits[s].path for s in ("train", "valid", "test")]
    assert all(p.is_relative_to(tmp_path / "cache" / "synthetic") for p in paths)
    assert [p.name for p in paths] == ["train.txt", "valid.txt", "test.txt"]
    assert corpus.read_text("valid") == generate_splits("xml", seed=3, **SMALL)["valid"]
    for line in corpus.read_text("train").splitlines():
        check_xml(line)

    mtimes = [p.stat().st_mtime_ns for p in paths]
    again = corpora.resolve_corpus("synthetic-xml", options={"seed": 3, **SMALL})
    assert [again.splits[s].path for s in ("train", "valid", "test")] == paths
    assert [p.stat().st_mtime_ns for p in paths] == mtimes, "not regenerated"

    other = corpora.resolve_corpus("synthetic-xml", options={"seed": 4, **SMALL})
    assert other.splits["train"].path.parent != paths[0].parent
    arithmetic = corpora.resolve_corpus("synthetic-arithmetic", options=SMALL)
    assert arithmetic.level == "char" and "=" in arithmetic.read_text("test")


def test_resolve_synthetic_corpus_rejects_unknown_options(tmp_path, monkeypatch):
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path))
    with pytest.raises(DataError, match="unknown option") as err:
        corpora.resolve_corpus("synthetic-xml", options={"sed": 1})
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="positive"):
        corpora.resolve_corpus("synthetic-arithmetic", options={"train_chars": -5})


def test_closing_tags_are_matched_against_the_innermost_open_tag():
    rng = random.Random(5)
    documents = [xml_document(rng) for _ in range(200)]
    matched, closing = xml_closing_tags_matched("".join(documents))
    assert matched == closing == sum(d.count("</") for d in documents)  # generated text nests perfectly
    # A wrong name still closes the innermost tag (one mistake counts once); a close with nothing open is wrong; an
    # unfinished tag ("<ab") and text between tags are not tags.
    assert xml_closing_tags_matched("<ab><cd></ab></ab>") == (1, 2)
    assert xml_closing_tags_matched("</x><ab>zz<cd></cd><ab") == (1, 2)


def test_the_generators_next_character_distribution_worked_out_by_hand():
    """The document "<ab></ab>": a root of two uniform letters whose length (2-10, uniform) ends at 2 with P 1/9;
    the first decision (1/2) closes it, copying "ab"; the second (1/2), with nothing open, ends the line."""
    letter = 1 / 26
    chosen = [d.get(c, 0.0) for d, c in zip(xml_next_characters("<ab></ab>"), "<ab></ab>\n", strict=True)]
    assert chosen == pytest.approx([1, letter, letter, 1 / 9, 1, 1 / 2, 1, 1, 1, 1 / 2])
    distributions = xml_next_characters("<ab></ab>")
    assert distributions[2] == pytest.approx(dict.fromkeys("abcdefghijklmnopqrstuvwxyz", letter))  # 1 letter: no end
    assert distributions[5] == pytest.approx({"/": 0.5, **dict.fromkeys("abcdefghijklmnopqrstuvwxyz", 0.5 / 26)})
    assert distributions[9] == {"<": 0.5, "\n": 0.5}  # a second top-level element, or the end


def test_the_next_character_bits_add_up_to_the_generators_draws():
    """An independent path: a document's bits are those of the draws that made it, read from its tags (each opening
    name's length, log2 9, and letters, log2 26 each; each decision, 1 bit while the 50 steps last, and one decision
    after the last tag, which ends the line), and must equal the sum of the per-character bits."""
    rng = random.Random(21)
    documents = [xml_document(rng) for _ in range(1000)]  # about 1 in 9 runs past the 50 steps
    forced = 0
    for document in documents:
        distributions = xml_next_characters(document)
        assert all(sum(d.values()) == pytest.approx(1.0) for d in distributions)
        per_character = -sum(math.log2(d[c]) for d, c in zip(distributions, document + "\n", strict=True))
        forced += len(XML_TAG.findall(document)) > synthetic.XML_MAX_ITERATIONS  # one per tag after the first, +1
        assert per_character == pytest.approx(drawn_bits(document), abs=1e-9), document
    assert forced > 0, "some documents reach the forced closes"


@pytest.mark.parametrize(
    "text", ["", "<ab></cd>", "</ab>", "<ab>", "<ab>x</ab>", "<a></a>", "<abcdefghijk></abcdefghijk>"]
)
def test_the_next_character_distribution_refuses_what_the_generator_cannot_write(text):
    with pytest.raises(DataError, match="not a synthetic XML document"):
        xml_next_characters(text)
