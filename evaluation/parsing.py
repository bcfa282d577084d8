"""Unsupervised constituency parsing with ON-LSTM (Shen et al. 2019, "Ordered Neurons", §5.2).

ON-LSTM's master forget gate says, at every word, how much of the state it erases; its expected split point (eq. 15)

    d̂_t = D_m - Σ_k f̃_tk          (``zoo.on_lstm``'s ``split_points()``, per layer)

is large where a high-level constituent ends before word t. Reading a sentence from a zero state and splitting it
greedily top-down at the largest d̂ (Shen et al. 2017) gives a binary tree, compared with the treebank's by unlabelled
F1. The conventions follow the authors' released code (yikangshen/Ordered-Neurons, ``test_phrase_grammar.py`` and
``data_ptb.py``); where lm-zoo differs, the comment says so:

- words: only tokens whose part-of-speech tag is a word tag (:data:`WORD_TAGS`): punctuation, currency symbols and
  ``-NONE-`` traces are dropped, as WSJ10 drops them; lower-cased, every run of digits replaced by ``N``;
- the model reads ``<eos>`` and then the words, from a zero state; d̂ at each word is the one computed on reading it
  (the code's ``gates[1:-1]``; the trailing ``<eos>`` it also feeds cannot change earlier steps);
- split at the largest d̂ into ``(x_<i, (x_i, x_>i))``, recursively;
- a tree's spans: every constituent of two words or more except the whole sentence; single words and the sentence
  span are never scored, and unary chains in the gold tree collapse;
- F1 per sentence, averaged over sentences (the code's ``f1_list.mean()``; Htut et al. 2018 do the same). A sentence
  whose gold tree has no span to score (one or two words, or flat) counts 1 when the prediction has none either, as
  in the code, and 0 otherwise;
- WSJ10: sentences of at most 10 words after the filtering;
- recall per phrase type (NP, VP, PP, ADJP, SBAR, ...): the share of the gold constituents of that label (function
  tags stripped, two words or more, the sentence's own included) whose span the predicted tree has, as the code's
  ``corpus_stats_labeled``.

The trivial baselines (left- and right-branching, balanced, random) are scored by the same code. The treebank is read
with NLTK's bracket parser (``nltk.Tree.fromstring``) from the ``.mrg`` files of the NLTK sample's zip (or a
directory): NLTK's own ``BracketParseCorpusReader`` refuses paths outside ``nltk.data.path`` since NLTK 3.9, which
would make users register their data directory with NLTK first.
"""

from __future__ import annotations

import io
import random
import re
import zipfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from nltk import Tree  # the parse extra (pip install "lm-zoo[parse]")
from nltk.corpus.reader.util import read_sexpr_block

from evaluation.sentences import pad, sentence_batches
from zoo.errors import ConfigError, DataError

# The Penn Treebank part-of-speech tags of words (the 2019 code's ``word_tags``): everything else (punctuation,
# ``$`` and ``#``, ``-NONE-`` traces, brackets) is dropped before parsing.
WORD_TAGS = frozenset(
    "CC CD DT EX FW IN JJ JJR JJS LS MD NN NNS NNP NNPS PDT POS PRP PRP$ RB RBR RBS RP SYM TO UH VB VBD VBG VBN VBP "
    "VBZ WDT WP WP$ WRB".split()
)
PHRASE_TYPES = ("NP", "VP", "PP", "ADJP", "SBAR")  # reported by name; the JSON has every label
WSJ10_WORDS = 10
TREEBANK_URL = "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/packages/corpora/treebank.zip"
TREEBANK_SHA256 = "9da92d76c3666cfb6cddeaed0f7e86b344cce0f0928a286d439e555f19c37399"  # nltk_data @ 5db857e

# A binary tree: a word, or a pair of trees.
BinaryTree = str | tuple["BinaryTree", "BinaryTree"]
Span = tuple[int, int]  # [start, end) word positions


def normalise_word(word: str) -> str:
    """A treebank token as the language model's vocabulary spells it: lower case, digit runs as ``N``."""
    return re.sub("[0-9]+", "N", word.lower())


@dataclass(frozen=True)
class GoldSentence:
    """A treebank sentence reduced to what parsing scores.

    Attributes:
        words: the kept words, normalised.
        spans: the gold tree's unlabelled constituents of two words or more, without the sentence's own span.
        labelled: ``(start, end, label)`` of every phrase of two words or more, the sentence's own included, with
            function tags stripped (``NP-SBJ`` is ``NP``).
    """

    words: tuple[str, ...]
    spans: frozenset[Span]
    labelled: frozenset[tuple[int, int, str]]


def gold_sentence(tree: Tree) -> GoldSentence:
    """Reduce a treebank tree to its kept words and its spans (see the module docstring for the conventions)."""
    words: list[str] = []
    labelled: set[tuple[int, int, str]] = set()

    def visit(node: Tree) -> None:
        if isinstance(node[0], str):  # a preterminal: (TAG word)
            if node.label() in WORD_TAGS:
                words.append(normalise_word(node[0]))
            return
        start = len(words)
        for child in node:
            visit(child)
        if len(words) - start >= 2:
            labelled.add((start, len(words), re.split("[-=]", node.label())[0] or node.label()))

    visit(tree)
    sentence = (0, len(words))
    spans = frozenset((i, j) for i, j, _ in labelled if (i, j) != sentence)
    return GoldSentence(tuple(words), spans, frozenset(labelled))


def read_treebank(path: str | Path) -> list[Tree]:
    """Every tree of the ``.mrg`` files in a zip (the NLTK sample's ``treebank.zip``: ``treebank/combined/*.mrg``) or
    a directory, in file-name order.

    Raises:
        DataError: the path is missing or holds no ``.mrg`` file.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(
            f"no treebank at {path}: put NLTK's Penn Treebank sample there (treebank.zip, from {TREEBANK_URL}) or "
            "give --treebank the path of a zip or a directory of .mrg files"
        )
    texts: list[str] = []
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = sorted(n for n in archive.namelist() if n.endswith(".mrg") and "/combined/" in f"/{n}")
            names = names or sorted(n for n in archive.namelist() if n.endswith(".mrg"))
            texts = [archive.read(n).decode("utf-8") for n in names]
    elif path.is_dir():
        texts = [p.read_text(encoding="utf-8") for p in sorted(path.rglob("*.mrg"))]
    if not texts:
        raise DataError(
            f"{path} holds no .mrg file: give --treebank a zip or directory of bracketed Penn Treebank files"
        )
    trees: list[Tree] = []
    for text in texts:
        stream = io.StringIO(text)
        while blocks := read_sexpr_block(stream):
            trees += [Tree.fromstring(block, remove_empty_top_bracketing=True) for block in blocks]
    return trees


# ---------------------------------------------------------------------------------------------------- trees and spans
def greedy_split(words: Sequence[str], split_points: Sequence[float]) -> BinaryTree:
    """Shen et al. 2017's top-down parse: split at the largest ``d̂`` into ``(x_<i, (x_i, x_>i))``, recursively.

    Args:
        words: the sentence.
        split_points: one ``d̂`` per word; ties go to the first (``numpy.argmax``, as the authors' code).
    """
    if len(words) != len(split_points) or not words:
        raise ValueError(f"greedy_split needs one split point per word, got {len(words)} words, {len(split_points)}")
    if len(words) == 1:
        return words[0]
    i = max(range(len(words)), key=lambda k: (split_points[k], -k))
    right: BinaryTree = words[i]
    if i + 1 < len(words):
        right = (right, greedy_split(words[i + 1 :], split_points[i + 1 :]))
    if i == 0:
        return right
    return (greedy_split(words[:i], split_points[:i]), right)


def tree_spans(tree: BinaryTree, include_sentence: bool = False) -> set[Span]:
    """The ``[start, end)`` spans of a binary tree's constituents of two words or more."""
    spans: set[Span] = set()

    def visit(node: BinaryTree, start: int) -> int:
        if isinstance(node, str):
            return start + 1
        end = visit(node[1], visit(node[0], start))
        spans.add((start, end))
        return end

    n = visit(tree, 0)
    if not include_sentence:
        spans.discard((0, n))
    return spans


def sentence_f1(predicted: set[Span] | frozenset[Span], gold: set[Span] | frozenset[Span]) -> float:
    """Unlabelled F1 of one sentence (1 when neither tree has a span to score)."""
    if not gold:
        return 1.0 if not predicted else 0.0
    overlap = len(set(predicted) & set(gold))
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)


def left_branching(words: Sequence[str]) -> BinaryTree:
    """``(((w1 w2) w3) w4)``."""
    tree: BinaryTree = words[0]
    for word in words[1:]:
        tree = (tree, word)
    return tree


def right_branching(words: Sequence[str]) -> BinaryTree:
    """``(w1 (w2 (w3 w4)))``."""
    tree: BinaryTree = words[-1]
    for word in reversed(words[:-1]):
        tree = (word, tree)
    return tree


def balanced(words: Sequence[str]) -> BinaryTree:
    """A balanced tree whose right subtrees are the full ones: the right part holds the largest power of two below
    the length (``parse_comparison.balance`` of the authors' code, after Williams et al. 2018)."""
    if len(words) == 1:
        return words[0]
    right = 1 << ((len(words) - 1).bit_length() - 1)  # half of len rounded up to a power of two
    return (balanced(words[:-right]), balanced(words[-right:]))


def random_tree(words: Sequence[str], rng: random.Random) -> BinaryTree:
    """Merge a uniformly chosen pair of neighbours until one tree is left (``parse_comparison.randomize``)."""
    nodes: list[BinaryTree] = list(words)
    while len(nodes) > 1:
        i = rng.randrange(len(nodes) - 1)
        nodes[i : i + 2] = [(nodes[i], nodes[i + 1])]
    return nodes[0]


# ----------------------------------------------------------------------------------------------------- the model side
def require_on_lstm(model: torch.nn.Module, where: str = "this model") -> None:
    """What parsing needs of a network: an ON-LSTM stack, whose master forget gates give the split points.

    Args:
        model: the network.
        where: the model as the line names it (``lm-zoo parse``: its SOURCE).

    Raises:
        ConfigError: another stack; the line names its cells and what would serve.
    """
    stack = getattr(model, "rnn", None)
    if hasattr(stack, "split_points"):
        return
    config = getattr(model, "config", None)
    cells = getattr(config, "architecture", None) or (type(stack).__name__ if stack is not None else "no recurrent")
    raise ConfigError(
        f"parsing reads an ON-LSTM's master forget gates, and {where} has {cells} cells: give a word-level ON-LSTM "
        "text model such as ptb-on-lstm"
    )


def sentence_split_points(
    model: torch.nn.Module, tokenizer: Any, sentences: Sequence[Sequence[str]], batch_size: int = 64
) -> list[torch.Tensor]:
    """d̂ of every layer at every word of each sentence, each read from a zero state after ``<eos>``.

    Args:
        model: a ``zoo.RecurrentLM`` whose stack is an ON-LSTM.
        tokenizer: its word tokenizer (unknown words become ``<unk>``, as in the authors' code).
        sentences: lists of words.
        batch_size: sentences per forward pass; each is padded at its end, which cannot change its earlier steps.

    Returns:
        One ``(L, n)`` float tensor per sentence of n words.
    """
    require_on_lstm(model)
    stack = model.rnn
    device = next(model.parameters()).device
    model.eval()
    results: list[torch.Tensor] = []
    with torch.no_grad():
        for ids in sentence_batches(tokenizer, [" ".join(words) for words in sentences], batch_size):
            model.features(pad(ids, tokenizer.eos_id).to(device))
            d = stack.split_points().float().cpu()  # (L, B, T)
            results += [d[:, b, 1 : len(row)] for b, row in enumerate(ids)]
    return results


@dataclass
class _Score:
    """Running sentence-F1 sums for WSJ10 and all lengths."""

    f1_all: float = 0.0
    f1_wsj10: float = 0.0

    def add(self, f1: float, short: bool) -> None:
        self.f1_all += f1
        if short:
            self.f1_wsj10 += f1

    def means(self, n_all: int, n_wsj10: int) -> dict[str, float | None]:
        return {
            "f1_wsj10": self.f1_wsj10 / n_wsj10 if n_wsj10 else None,
            "f1_all": self.f1_all / n_all if n_all else None,
        }


#: The trivial trees each layer's parses are compared with (Shen et al. 2019, Table 2).
BASELINES = ("left_branching", "right_branching", "balanced", "random")


def _baseline_trees(words: list[str], rng: random.Random) -> dict[str, BinaryTree]:
    """:data:`BASELINES`' trees of ``words``, by name."""
    return {
        "left_branching": left_branching(words),
        "right_branching": right_branching(words),
        "balanced": balanced(words),
        "random": random_tree(words, rng),
    }


def evaluate_parsing(
    model: torch.nn.Module,
    tokenizer: Any,
    trees: Iterable[Tree],
    batch_size: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Parse every treebank sentence with each layer's d̂ and score it, beside the trivial baselines.

    Args:
        model: a ``zoo.RecurrentLM`` with an ON-LSTM stack.
        tokenizer: its word tokenizer.
        trees: treebank trees (:func:`read_treebank`).
        batch_size: sentences per forward pass.
        seed: of the random-tree baseline.

    Returns:
        A JSON-ready dict: sentence counts, each layer's mean sentence F1 on WSJ10 and all lengths and its recall per
        phrase type, the same F1 for the baselines, and the conventions used.
    """
    every = [gold_sentence(tree) for tree in trees]
    gold = [g for g in every if g.words]  # a tree of punctuation or traces only has nothing to parse
    d_hat = sentence_split_points(model, tokenizer, [g.words for g in gold], batch_size)
    num_layers = d_hat[0].shape[0] if d_hat else 0
    layers = [_Score() for _ in range(num_layers)]
    found: list[Counter[str]] = [Counter() for _ in range(num_layers)]
    total: Counter[str] = Counter()
    baselines = {name: _Score() for name in BASELINES}
    rng = random.Random(seed)
    n_wsj10 = 0
    for sentence, d in zip(gold, d_hat):
        short = len(sentence.words) <= WSJ10_WORDS
        n_wsj10 += short
        total.update(label for _, _, label in sentence.labelled)
        for layer in range(num_layers):
            tree = greedy_split(sentence.words, d[layer].tolist())
            predicted = tree_spans(tree, include_sentence=True)  # recall counts the sentence's own phrase; F1 not
            layers[layer].add(sentence_f1(predicted - {(0, len(sentence.words))}, sentence.spans), short)
            found[layer].update(label for i, j, label in sentence.labelled if (i, j) in predicted)
        for name, tree in _baseline_trees(sentence.words, rng).items():
            baselines[name].add(sentence_f1(tree_spans(tree), sentence.spans), short)
    n_all = len(gold)
    return {
        "sentences": n_all,
        "wsj10_sentences": n_wsj10,
        "skipped_without_words": len(every) - len(gold),
        "layers": [
            {
                "layer": layer + 1,
                **layers[layer].means(n_all, n_wsj10),
                "recall": {label: found[layer][label] / total[label] for label in sorted(total)},
            }
            for layer in range(num_layers)
        ],
        "baselines": {name: score.means(n_all, n_wsj10) for name, score in baselines.items()},
        "phrase_counts": dict(sorted(total.items())),
        "f1": "sentence-level unlabelled F1 averaged over sentences (Shen et al. 2019's code)",
        "random_seed": seed,
    }


def describe(result: dict[str, Any]) -> str:
    """``lm-zoo parse``'s table: F1 per layer and per baseline on WSJ10 and all lengths, recall per phrase type."""

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}"

    lines = [
        f"{result['sentences']} sentences ({result['wsj10_sentences']} of at most {WSJ10_WORDS} words) from "
        f"{result.get('treebank', 'the treebank')}; {result['f1']}",
        f"{'':<18} {'WSJ10':>6} {'all':>6}   " + " ".join(f"{label:>5}" for label in PHRASE_TYPES),
    ]
    for layer in result["layers"]:
        recall = " ".join(f"{percent(layer['recall'].get(label)):>5}" for label in PHRASE_TYPES)
        f1 = f"{percent(layer['f1_wsj10']):>6} {percent(layer['f1_all']):>6}"
        lines.append(f"{'layer ' + str(layer['layer']):<18} {f1}   {recall}")
    for name, score in result["baselines"].items():
        lines.append(f"{name.replace('_', '-'):<18} {percent(score['f1_wsj10']):>6} {percent(score['f1_all']):>6}")
    lines.append("(F1 and recall in %; recall: the share of the treebank's phrases of each type that the tree has)")
    return "\n".join(lines)


def parse_text(model: torch.nn.Module, tokenizer: Any, text: str) -> tuple[list[str], torch.Tensor]:
    """The words of ``text`` (split on whitespace, normalised as treebank words) and their d̂ ``(L, n)``."""
    words = [normalise_word(w) for w in text.split()]
    if not words:
        raise ConfigError("--text has no words to parse")
    return words, sentence_split_points(model, tokenizer, [words])[0]


# ------------------------------------------------------------------------------------------------------------ drawing
def _layout(tree: BinaryTree) -> tuple[list[str], list[tuple[int, int, list[tuple[int, int]]]]]:
    """The words in order and every constituent as ``(index, height, [(index, height) of its two children])``,
    where a word's height is 0 and a constituent's index is a word position in half steps (2 * position)."""
    words: list[str] = []
    nodes: list[tuple[int, int, list[tuple[int, int]]]] = []

    def place(node: BinaryTree) -> tuple[int, int]:
        if isinstance(node, str):
            words.append(node)
            return 2 * (len(words) - 1), 0
        left, right = place(node[0]), place(node[1])
        here = ((left[0] + right[0]) // 2, max(left[1], right[1]) + 1)
        nodes.append((*here, [left, right]))
        return here

    place(tree)
    return words, nodes


def draw_text(tree: BinaryTree) -> str:
    """The tree drawn in text, the words along the bottom (NLTK's ``Tree.pretty_print`` would serve, but NLTK 3.10
    prints the leaves of a left-branching tree out of order)."""
    words, nodes = _layout(tree)
    if not nodes:
        return words[0]
    centres = []  # the text column of each half-step index
    column = 0
    for word in words:
        centres += [column + len(word) // 2, column + len(word) + 1]  # a word, then the gap after it
        column += len(word) + 3
    top = max(h for _, h, _ in nodes)
    grid = [[" "] * column for _ in range(2 * top + 2)]
    for index, height, children in nodes:
        bar = 2 * (top - height) + 1  # the row of this constituent's horizontal line
        for c in range(centres[children[0][0]], centres[children[1][0]] + 1):
            grid[bar][c] = "_"
        if height < top:
            grid[bar - 1][centres[index]] = "|"
        for child, child_height in children:
            lowest = 2 * (top - child_height) - 1 if child_height else 2 * top  # down to the child's own line
            for row in range(bar + 1, lowest + 1):
                grid[row][centres[child]] = "|"
    for i, word in enumerate(words):
        start = centres[2 * i] - len(word) // 2
        grid[-1][start : start + len(word)] = list(word)
    return "\n".join("".join(row).rstrip() for row in grid if "".join(row).strip())


def draw_png(tree: BinaryTree, path: str | Path) -> Path:
    """The tree as a PNG: the words along the bottom, each constituent a node above the middle of its words.

    Pillow (which tensorboard already installs) draws it: NLTK's own tree drawing needs tkinter and a display.
    """
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    words, nodes = _layout(tree)
    widths = [font.getlength(w) for w in words]
    column = max(widths) + 16
    height = max((h for _, h, _ in nodes), default=0)
    level, margin = 28, 20
    size = (int(column * len(words) + 2 * margin), int(level * height + 2 * margin + 24))
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)

    def xy(index: int, h: int) -> tuple[float, float]:
        return margin + column * (index / 2 + 0.5), margin + level * (height - h)

    for index, h, children in nodes:
        for child in children:
            draw.line([xy(index, h), xy(*child)], fill=(90, 90, 90), width=1)
        x, y = xy(index, h)
        draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=(200, 40, 40))
    for i, (word, width) in enumerate(zip(words, widths)):
        x, y = xy(2 * i, 0)
        draw.text((x - width / 2, y + 4), word, fill="black", font=font)
    path = Path(path)
    image.save(path)
    return path
