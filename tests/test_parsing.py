"""Unsupervised constituency parsing (evaluation.parsing; Shen et al. 2019 §5.2): the greedy
splitter, spans,
F1 and the baselines against hand-made trees and hand counts, the treebank reader against the NLTK sample, and the
model's split points against a per-sentence run."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from nltk import Tree

from datamodules.tokenizers import WordTokenizer
from evaluation import parsing
from evaluation.parsing import (
    balanced,
    draw_text,
    gold_sentence,
    greedy_split,
    left_branching,
    random_tree,
    right_branching,
    sentence_f1,
    tree_spans,
)
from tests.conftest import DATA_ROOT, needs_data
from zoo import RecurrentLM
from zoo.errors import ConfigError, DataError

TREEBANK = DATA_ROOT / "treebank" / "treebank.zip"
W = ["a", "b", "c", "d", "e"]


# ----------------------------------------------------------------------------------------- the splitter, by hand
@pytest.mark.parametrize(
    ("split_points", "tree"),
    [
        # The largest d̂ at c: ((a b) (c (d e))); then a < b: b starts a constituent of its own under (a b).
        ([0.1, 0.5, 0.9, 0.3, 0.2], (("a", "b"), ("c", ("d", "e")))),
        # Rising everywhere: every word splits off the end: left-branching.
        ([1, 2, 3, 4, 5], (((("a", "b"), "c"), "d"), "e")),
        # Falling everywhere: the first word wins each time: right-branching.
        ([5, 4, 3, 2, 1], ("a", ("b", ("c", ("d", "e"))))),
        # Ties go to the first (numpy.argmax in the authors' code).
        ([0, 0, 0, 0, 0], ("a", ("b", ("c", ("d", "e"))))),
        # The largest at d: ((a (b c)) (d e)); inside a b c the largest is b.
        ([0, 0.7, 0.1, 0.8, 0.2], (("a", ("b", "c")), ("d", "e"))),
    ],
)
def test_greedy_split_gives_the_tree_written_out(split_points, tree):
    assert greedy_split(W, split_points) == tree


def test_greedy_split_of_one_word_and_a_length_mismatch():
    assert greedy_split(["a"], [3.0]) == "a"
    with pytest.raises(ValueError):
        greedy_split(W, [1.0, 2.0])


def test_spans_leave_out_words_and_the_sentence():
    tree = (("a", "b"), ("c", ("d", "e")))
    assert tree_spans(tree) == {(0, 2), (2, 5), (3, 5)}
    assert tree_spans(tree, include_sentence=True) == {(0, 2), (2, 5), (3, 5), (0, 5)}


def test_f1_of_a_tree_against_itself_and_against_right_branching_by_hand():
    tree = (("a", "b"), ("c", ("d", "e")))
    assert sentence_f1(tree_spans(tree), tree_spans(tree)) == 1.0
    # Right-branching over 5 words: (1,5), (2,5), (3,5). The tree: (0,2), (2,5), (3,5). Two of three shared:
    # precision = recall = 2/3, so F1 = 2/3.
    assert tree_spans(right_branching(W)) == {(1, 5), (2, 5), (3, 5)}
    assert sentence_f1(tree_spans(right_branching(W)), tree_spans(tree)) == pytest.approx(2 / 3)


def test_f1_where_there_is_nothing_to_score():
    assert sentence_f1(set(), set()) == 1.0  # one- and two-word sentences, as the authors' code counts them
    assert sentence_f1({(0, 2)}, set()) == 0.0  # a flat gold tree of three words: precision 0
    assert sentence_f1(set(), {(0, 2)}) == 0.0


def test_baseline_trees():
    assert left_branching(W) == (((("a", "b"), "c"), "d"), "e")
    assert right_branching(W) == ("a", ("b", ("c", ("d", "e"))))
    # parse_comparison.balance: the right part is the largest power of two below the length.
    assert balanced(W) == ("a", (("b", "c"), ("d", "e")))
    assert balanced(W[:4]) == (("a", "b"), ("c", "d"))
    assert balanced(W[:3]) == ("a", ("b", "c"))
    assert balanced(["w"] * 6) == (("w", "w"), (("w", "w"), ("w", "w")))
    for seed in range(20):
        tree = random_tree(W, random.Random(seed))
        assert len(tree_spans(tree)) == len(W) - 2  # binary: n - 2 spans besides the sentence and the words
        assert draw_text(tree).splitlines()[-1].split() == W


def test_baselines_f1_on_gold_trees_by_hand():
    # (S (NP the cat) (VP sat (PP on (NP the mat)))) . -- gold spans: (0,2), (2,6), (3,6), (4,6).
    gold = gold_sentence(Tree.fromstring(
        "(S (NP (DT the) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .))"
    ))  # fmt: skip
    assert gold.words == ("the", "cat", "sat", "on", "the", "mat")
    assert gold.spans == {(0, 2), (2, 6), (3, 6), (4, 6)}
    words = list(gold.words)
    # Right-branching: (1,6) (2,6) (3,6) (4,6): 3 of 4 shared each way -> F1 3/4.
    assert sentence_f1(tree_spans(right_branching(words)), gold.spans) == pytest.approx(3 / 4)
    # Left-branching: (0,2) (0,3) (0,4) (0,5): 1 of 4 -> 1/4.
    assert sentence_f1(tree_spans(left_branching(words)), gold.spans) == pytest.approx(1 / 4)
    # Balanced, 6 words: ((the cat) ((sat on) (the mat))): (0,2) (2,6) (2,4) (4,6): 3 of 4 -> 3/4.
    assert sentence_f1(tree_spans(balanced(words)), gold.spans) == pytest.approx(3 / 4)


def test_gold_sentence_keeps_words_drops_punctuation_traces_and_function_tags():
    tree = Tree.fromstring(
        "(S (NP-SBJ (NP (NNP Pierre) (NNP Vinken)) (, ,) (ADJP (NP (CD 61) (NNS years)) (JJ old)) (, ,))"
        " (VP (MD will) (VP (VB join) (NP (-NONE- *T*-1)) (NP (DT the) (NN board)) (NP-TMP (NNP Nov.) (CD 29))))"
        " (. .))"
    )
    gold = gold_sentence(tree)
    assert gold.words == ("pierre", "vinken", "N", "years", "old", "will", "join", "the", "board", "nov.", "N")
    assert (0, 5, "NP") in gold.labelled and (2, 5, "ADJP") in gold.labelled and (9, 11, "NP") in gold.labelled
    assert (0, 11, "S") in gold.labelled and (0, 11) not in gold.spans  # scored for recall, never for F1
    assert all(j - i >= 2 for i, j in gold.spans)  # the trace's empty NP and one-word phrases are gone


# ------------------------------------------------------------------------------------------------- the real treebank
@pytest.mark.slow
@needs_data("treebank", "treebank.zip")
def test_reads_the_nltk_sample_as_manifest_md_counts_it():
    trees = parsing.read_treebank(TREEBANK)
    assert len(trees) == 3914  # MANIFEST.md: 199 files, 3,914 parse trees, 100,676 leaves
    assert sum(len(t.leaves()) for t in trees) == 100_676
    assert sum(1 for t in trees for _, tag in t.pos() if tag != "-NONE-") == 94_084
    assert gold_sentence(trees[0]).words[:3] == ("pierre", "vinken", "N")


def test_a_missing_or_empty_treebank_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="no treebank at"):
        parsing.read_treebank(tmp_path / "nothing.zip")
    with pytest.raises(DataError, match="holds no .mrg file"):
        parsing.read_treebank(tmp_path)


# ------------------------------------------------------------------------------------------------------- the model
SENTENCES = ["the cat sat on the mat", "a dog ran", "the mat sat on a cat and a dog", "dog"]


def tiny_on_lstm(tokenizer: WordTokenizer, num_layers: int = 2) -> RecurrentLM:
    torch.manual_seed(0)
    model = RecurrentLM(tokenizer.vocab_size, "on_lstm", 8, 8, num_layers, cell_options={"chunk_size": 4})
    return model.eval()


@pytest.fixture
def tokenizer() -> WordTokenizer:
    return WordTokenizer.build("\n".join(SENTENCES[:2]))  # "and" and others stay unknown: read as <unk>


def test_split_points_in_a_padded_batch_equal_one_sentence_at_a_time(tokenizer):
    model = tiny_on_lstm(tokenizer)
    batched = parsing.sentence_split_points(model, tokenizer, [s.split() for s in SENTENCES], batch_size=3)
    for sentence, d in zip(SENTENCES, batched):
        ids = torch.tensor([[tokenizer.eos_id, *tokenizer.encode(sentence)]])
        with torch.no_grad():
            model.features(ids)
        alone = model.rnn.split_points()[:, 0, 1:]  # (L, n): d̂ on reading each word, after the leading <eos>
        assert d.shape == (2, len(sentence.split()))
        torch.testing.assert_close(d, alone, rtol=0, atol=1e-6)


def test_parsing_needs_an_on_lstm(tokenizer):
    model = RecurrentLM(tokenizer.vocab_size, "lstm", 8, 8, 1).eval()
    with pytest.raises(ConfigError, match="ON-LSTM"):
        parsing.sentence_split_points(model, tokenizer, [["a"]])


def test_evaluate_parsing_scores_layers_and_baselines_with_the_same_code(tokenizer):
    trees = [
        Tree.fromstring("(S (NP (DT the) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .))"),
        Tree.fromstring("(S (NP (DT a) (NN dog)) (VP (VBD ran)))"),
        Tree.fromstring("(S (. .))"),  # nothing to parse
    ]
    model = tiny_on_lstm(tokenizer)
    result = parsing.evaluate_parsing(model, tokenizer, trees)
    assert (result["sentences"], result["wsj10_sentences"], result["skipped_without_words"]) == (2, 2, 1)
    golds = [gold_sentence(t) for t in trees[:2]]
    d_hat = parsing.sentence_split_points(model, tokenizer, [g.words for g in golds])
    for layer in (0, 1):
        f1s = [sentence_f1(tree_spans(greedy_split(g.words, d[layer].tolist())), g.spans) for g, d in zip(golds, d_hat)]
        assert result["layers"][layer]["f1_all"] == pytest.approx(sum(f1s) / 2)
    # Right-branching: 3/4 on the first (hand count above); "a dog ran" has gold (0,2) and predicts (1,3): 0.
    assert result["baselines"]["right_branching"]["f1_wsj10"] == pytest.approx((3 / 4 + 0) / 2)
    assert result["phrase_counts"] == {"NP": 3, "PP": 1, "S": 2, "VP": 1}
    assert "layer 1" in parsing.describe(result) and "right-branching" in parsing.describe(result)


@pytest.mark.slow
def test_cli_parses_text_and_draws_it(tmp_path, tokenizer):
    from checkpoints import LoadedModel
    from checkpoints.export_write import export_model

    loaded = LoadedModel(tiny_on_lstm(tokenizer), tokenizer, {"corpus": "somewhere"})
    exported = export_model(loaded, tmp_path / "on-lstm", results=[])
    png = tmp_path / "tree.png"
    command = [sys.executable, "-m", "cli", "parse", str(exported), "--text", "the cat sat on the mat"]
    done = subprocess.run([*command, "--draw", str(png), "--json"], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["words"] == SENTENCES[0].split() and result["layer"] == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = subprocess.run(command + ["--layer", "1"], capture_output=True, text=True, check=True).stdout
    assert drawn.splitlines()[-1].split() == SENTENCES[0].split()
    bad = subprocess.run(command + ["--layer", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("lm-zoo: error: --layer must be between 1 and 2")
