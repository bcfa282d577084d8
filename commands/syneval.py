"""``lm-zoo syneval SOURCE``: targeted syntactic evaluation on Marvin & Linzen's minimal pairs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import checkpoints
from commands import COMMANDS
from commands.common import CommandParser, source_arguments
from datamodules.corpora import data_root
from datamodules.kinds import SYNEVAL
from evaluation import syneval
from zoo.errors import ConfigError


def cmd_syneval(argv: Sequence[str]) -> None:
    """``lm-zoo syneval SOURCE``: Marvin & Linzen's minimal pairs, accuracy per condition (Shen et al. 2019 §5.3)."""
    parser = CommandParser(prog="lm-zoo syneval", description=COMMANDS["syneval"].summary)
    source_arguments(parser)
    parser.add_argument(
        "--templates", help="templates.tar.xz or emnlp2018_templates.tar.xz (MANIFEST.md), or a directory of the "
        "original pickles (default: $LM_ZOO_DATA/syneval/templates.tar.xz)"
    )  # fmt: skip
    parser.add_argument("--max-tuples", type=int, help="score only the first N tuples of each condition (a quick look)")
    parser.add_argument("--batch-size", type=int, default=256, help="sentences per forward pass")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.max_tuples is not None and args.max_tuples < 1):
        raise ConfigError("--batch-size and --max-tuples must be at least 1")

    templates = Path(args.templates) if args.templates else data_root() / "syneval" / "templates.tar.xz"
    conditions = syneval.read_templates(templates)  # before loading a model: a refused file stops at once
    loaded = checkpoints.load(args.source, args.revision)
    loaded.refuse(SYNEVAL)  # a music model, or text read in characters, bytes or pieces
    result = syneval.evaluate_syneval(
        loaded.model.to(args.device), loaded.tokenizer, conditions, args.batch_size, args.max_tuples
    )
    result = {"source": loaded.source, "templates": str(templates), **result}
    print(json.dumps(result) if args.json else syneval.describe(result))
