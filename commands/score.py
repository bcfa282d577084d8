"""``lm-zoo score SOURCE FILE``: the log-probability of every sentence of a file, one JSON line each, or an n-best
list with an LM score column for rescoring (SRILM's ``-ppl`` and ``-rescore`` do the same for n-gram models)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import checkpoints
from commands import COMMANDS
from commands.common import (
    DEVICE_HELP,
    QUANTIZE_HELP,
    QUANTIZE_MODES,
    SOURCE_HELP,
    CommandParser,
    device_argument,
    option,
    quantize_model,
)
from lightning_modules.evaluation.sentences import score_sentences
from zoo.errors import ConfigError, DataError

NBEST_HELP = (
    "FILE is an n-best list: 'ID<TAB>hypothesis' lines, or Kaldi's 'ID word word ...'; each line is printed back with "
    "its LM score (log10 p, SRILM's convention; Kaldi's costs are -ln p: docs/evaluation.md) after the ID, separated "
    "as the input is"
)


def read_lines(file: str) -> list[str]:
    """The lines of ``file`` (``-``: standard input), without their line ends.

    Raises:
        DataError: the file cannot be read as UTF-8 text.
    """
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{file}: no such file: give a text file with one sentence per line (or - for stdin)") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{file}: not UTF-8 text ({err.reason} at byte {err.start}): give a text file") from None
    return text.splitlines()


def split_nbest(lines: Sequence[str], file: str) -> list[tuple[str, str, str]]:
    """``(id, separator, hypothesis)`` of each n-best line: tab-separated if the line has a tab, else Kaldi's form
    (the ID is the first whitespace-separated field).

    Raises:
        DataError: a line without an ID (naming its number).
    """
    entries = []
    for number, line in enumerate(lines, 1):
        if "\t" in line:
            key, _, hypothesis = line.partition("\t")
            separator = "\t"
        else:
            key, _, hypothesis = line.strip().partition(" ")
            separator = " "
        if not key.strip():
            raise DataError(f"{file} line {number}: no hypothesis ID; n-best lines are 'ID<TAB>hypothesis' or 'ID w w'")
        entries.append((key.strip(), separator, " ".join(hypothesis.split())))
    return entries


def cmd_score(argv: Sequence[str]) -> None:
    """``lm-zoo score SOURCE FILE``: log p of each line of FILE (a sentence), from the start-of-sentence state."""
    parser = CommandParser(prog="lm-zoo score", description=COMMANDS["score"])
    parser.add_argument("source", help=SOURCE_HELP)
    parser.add_argument("file", nargs="?", default="-", help="one sentence per line (default -: standard input)")
    parser.add_argument("--revision", help="for a Hub source: branch, tag or commit (default main)")
    parser.add_argument("--nbest", action="store_true", help=NBEST_HELP)
    parser.add_argument("--per-token", action="store_true", help="also every token's log-probability (nats)")
    parser.add_argument(
        "--document",
        action="store_true",
        help="read the lines as one running text, each in the context of the lines before it (default: each alone)",
    )
    parser.add_argument("--no-end", action="store_true", help="score the words only, not the end of the sentence")
    parser.add_argument("--batch-size", type=option("--batch-size", int, 1), default=64, help="sentences per pass")
    parser.add_argument("--device", type=device_argument, default="auto", help=DEVICE_HELP)
    parser.add_argument("--quantize", choices=QUANTIZE_MODES, help=QUANTIZE_HELP)
    args = parser.parse_args(argv)
    if args.nbest and (args.document or args.per_token):
        raise ConfigError("--nbest scores each hypothesis alone into one column: drop --document and --per-token")

    lines = read_lines(args.file)  # before loading a model: a missing file stops at once
    entries = split_nbest(lines, args.file) if args.nbest else None
    loaded = checkpoints.load(args.source, args.revision)
    if loaded.is_music:
        raise ConfigError(f"{loaded.source} is a music model: lm-zoo score scores text (lm-zoo evaluate scores music)")
    quantize_model(loaded, args.quantize, args.device)
    sentences = [hypothesis for _, _, hypothesis in entries] if entries is not None else lines
    scores = score_sentences(
        loaded.model.to(args.device),
        loaded.tokenizer,
        sentences,
        batch_size=args.batch_size,
        document=args.document,
        end=() if args.no_end else None,
        per_token=args.per_token,
    )
    if entries is None:
        for score in scores:  # an empty FILE prints nothing
            print(json.dumps(score.to_json()))
        return
    for (key, separator, hypothesis), score in zip(entries, scores, strict=True):
        print(separator.join([key, f"{score.log10prob:.6f}", *([hypothesis] if hypothesis else [])]))
