"""``lm-zoo parse SOURCE``: unsupervised constituency parsing with an ON-LSTM (Shen et al. 2019 §5.2)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import checkpoints
from commands import COMMANDS
from commands.common import CommandParser, source_arguments
from datamodules.corpora import data_root
from datamodules.kinds import PARSE
from evaluation import parsing
from zoo.errors import ConfigError


def cmd_parse(argv: Sequence[str]) -> None:
    """``lm-zoo parse SOURCE``: trees from an ON-LSTM's master forget gate (Shen et al. 2019 §5.2)."""
    parser = CommandParser(prog="lm-zoo parse", description=COMMANDS["parse"].summary)
    source_arguments(parser)
    parser.add_argument(
        "--treebank", help="bracketed Penn Treebank trees: a zip or directory of .mrg files "
        "(default: $LM_ZOO_DATA/treebank/treebank.zip, NLTK's WSJ sample)"
    )  # fmt: skip
    parser.add_argument("--text", help="parse this sentence instead (words separated by spaces) and draw its tree")
    parser.add_argument("--layer", type=int, help="the layer whose split points parse --text (default: the 2nd)")
    parser.add_argument("--draw", metavar="PNG", help="with --text: also draw the tree into this PNG file")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per forward pass")
    parser.add_argument("--seed", type=int, default=0, help="of the random-tree baseline")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.draw and args.text is None:
        raise ConfigError("--draw draws the tree of --text: give the sentence with --text")

    trees = None
    if args.text is None:  # before loading a model: a missing treebank stops at once
        treebank = Path(args.treebank) if args.treebank else data_root() / "treebank" / "treebank.zip"
        trees = parsing.read_treebank(treebank)
    loaded = checkpoints.load(args.source, args.revision)
    loaded.refuse(PARSE)  # a music model, or text read in characters, bytes or pieces
    parsing.require_on_lstm(loaded.model, f"{loaded.source} ({loaded.called})")
    model = loaded.model.to(args.device)
    if trees is None:
        words, d_hat = parsing.parse_text(model, loaded.tokenizer, args.text)
        layer = args.layer or min(2, d_hat.shape[0])
        if not 1 <= layer <= d_hat.shape[0]:
            raise ConfigError(f"--layer must be between 1 and {d_hat.shape[0]} (the model's layers), got {layer}")
        tree = parsing.greedy_split(words, d_hat[layer - 1].tolist())
        if args.draw:
            parsing.draw_png(tree, args.draw)
        if args.json:
            split_points = [[round(v, 4) for v in row] for row in d_hat.tolist()]
            print(json.dumps({"source": loaded.source, "words": words, "layer": layer, "tree": tree,
                              "split_points": split_points}))  # fmt: skip
        else:
            print(parsing.draw_text(tree))
        return
    result = parsing.evaluate_parsing(model, loaded.tokenizer, trees, args.batch_size, args.seed)
    result = {"source": loaded.source, "treebank": str(treebank), **result}
    if args.json:
        print(json.dumps(result))
        return
    print(parsing.describe(result))
