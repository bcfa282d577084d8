"""``lm-zoo score SOURCE FILE``: the log-probability of every sentence of a file, one JSON line each, or an n-best
list with an LM score column for rescoring (SRILM's ``-ppl`` and ``-rescore`` do the same for n-gram models)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import checkpoints
from commands import COMMANDS
from commands.common import (
    CommandParser,
    quantize_model,
    source_arguments,
)
from datamodules.kinds import SCORE
from evaluation.sentences import SCALES, stream_scores
from zoo.errors import ConfigError, DataError, number_flag

NBEST_HELP = (
    "FILE is an n-best list: 'ID<TAB>hypothesis' lines, or Kaldi's 'ID word word ...'; each line is printed back byte "
    "for byte with its LM score (--scale) inserted after the ID, separated as the input is"
)
SCALE_HELP = (
    "the n-best column's convention: log10 (log10 p, SRILM's n-best tools; the default), ln (ln p) or kaldi-cost "
    "(-ln p, what Kaldi's rescoring scripts read): docs/evaluation.md"
)


def named(file: str) -> str:
    """FILE as an error message names it: ``-`` is standard input."""
    return "standard input" if file == "-" else file


def open_lines(file: str) -> Iterator[str]:
    """The lines of ``file`` (``-``: standard input) as they are read, without their line ends (``\\n``, ``\\r\\n``);
    nothing else in a line is changed, so that an n-best hypothesis comes back byte for byte. The file is opened at
    once (a missing one is said before any model loads); its lines are read only as they are asked for.

    Raises:
        DataError: the file does not exist, or a line is not UTF-8 text (naming the line).
    """
    try:
        stream = sys.stdin.buffer if file == "-" else open(file, "rb")  # noqa: SIM115 - closed by the generator
    except FileNotFoundError:
        raise DataError(f"{file}: no such file: give a text file with one sentence per line (or - for stdin)") from None

    def lines() -> Iterator[str]:
        with contextlib.ExitStack() as stack:
            if stream is not sys.stdin.buffer:
                stack.enter_context(stream)
            for number, raw in enumerate(stream, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"{named(file)} line {number}: not UTF-8 text ({err.reason} at byte {err.start}): "
                        "give a text file"
                    ) from None
                yield line.removesuffix("\n").removesuffix("\r")

    return lines()


@dataclass(frozen=True)
class NbestLine:
    """One n-best line taken apart so that it can be put back with a score in it: ``head`` (any indentation and the
    ID), ``separator`` (a tab, or a space in Kaldi's form), and ``rest``, the line's bytes after the ID, untouched."""

    head: str
    separator: str
    rest: str

    @property
    def hypothesis(self) -> str:
        """The words to score: the rest with its spacing normalised."""
        return " ".join(self.rest.split())

    def with_columns(self, *columns: str) -> str:
        """The line with ``columns`` after the ID: without them, exactly the line that was read."""
        return self.separator.join([self.head, *columns]) + self.rest


def parse_nbest(lines: Iterable[str], file: str) -> Iterator[NbestLine]:
    """Each n-best line taken apart: tab-separated if the line has a tab, else Kaldi's form (the ID is the first
    whitespace-separated field).

    Raises:
        DataError: a line without an ID (naming its number).
    """
    for number, line in enumerate(lines, 1):
        if "\t" in line:
            key, _, after = line.partition("\t")
            entry = NbestLine(key, "\t", "\t" + after)
        else:
            indent = line[: len(line) - len(line.lstrip())]
            key = line.split(maxsplit=1)[0] if line.strip() else ""
            entry = NbestLine(indent + key, " ", line[len(indent) + len(key) :])
        if not key.strip():
            raise DataError(
                f"{named(file)} line {number}: no hypothesis ID: give every n-best line one, 'ID<TAB>hypothesis' or "
                "'ID w w' (an empty hypothesis is its ID alone)"
            )
        yield entry


def _parsed(argv: Sequence[str]) -> argparse.Namespace:
    """``lm-zoo score``'s flags, read and checked against each other."""
    parser = CommandParser(prog="lm-zoo score", description=COMMANDS["score"].summary)
    source_arguments(parser, quantize=True)
    parser.add_argument("file", nargs="?", default="-", help="one sentence per line (default -: standard input)")
    parser.add_argument("--nbest", action="store_true", help=NBEST_HELP)
    parser.add_argument("--scale", choices=SCALES, help=SCALE_HELP)
    parser.add_argument(
        "--oov-column",
        action="store_true",
        help="with --nbest: a column after the score with the hypothesis's words outside the vocabulary, each scored "
        "as <unk> (SRILM reports them apart)",
    )
    parser.add_argument("--per-token", action="store_true", help="also every token's log-probability (nats)")
    parser.add_argument(
        "--document",
        action="store_true",
        help="read the lines as one running text, each in the context of the lines before it (default: each alone)",
    )
    parser.add_argument("--no-end", action="store_true", help="score the words only, not the end of the sentence")
    parser.add_argument("--batch-size", type=number_flag("--batch-size", int, 1), default=64, help="sentences per pass")
    args = parser.parse_args(argv)
    if args.nbest and (args.document or args.per_token):
        raise ConfigError("--nbest scores each hypothesis alone into one column: drop --document and --per-token")
    if not args.nbest and (args.scale or args.oov_column):
        raise ConfigError(
            "--scale and --oov-column shape the --nbest column; the JSON lines have logprob (ln p), log10prob and oov"
        )
    return args


def cmd_score(argv: Sequence[str]) -> None:
    """``lm-zoo score SOURCE FILE``: log p of each line of FILE (a sentence), from the start-of-sentence state."""
    args = _parsed(argv)
    lines = open_lines(args.file)  # before loading a model: a missing file stops at once
    loaded = checkpoints.load(args.source, args.revision)
    loaded.refuse(SCORE)
    quantize_model(loaded, args.quantize, args.device)
    entries = parse_nbest(lines, args.file) if args.nbest else None
    # Entries are read as the scores are asked for; those read but not yet printed wait here, one batch at most.
    pending: deque[NbestLine] = deque()

    def hypotheses() -> Iterator[str]:
        for entry in entries:  # type: ignore[union-attr]
            pending.append(entry)
            yield entry.hypothesis

    scores = stream_scores(
        loaded.model.to(args.device),
        loaded.tokenizer,
        lines if entries is None else hypotheses(),
        batch_size=args.batch_size,
        document=args.document,
        end=() if args.no_end else None,
        per_token=args.per_token,
    )
    scale = args.scale or "log10"
    for count, score in enumerate(scores, 1):  # an empty FILE prints nothing
        if entries is None:
            print(json.dumps(score.to_json()))
        else:
            columns = [f"{score.on_scale(scale):.6f}", *([str(score.oov)] if args.oov_column else [])]
            print(pending.popleft().with_columns(*columns))
        if count % args.batch_size == 0 or args.document:
            sys.stdout.flush()  # each batch as it is scored: a reader at the end of a pipe gets it now
