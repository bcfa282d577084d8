"""``lm-zoo evaluate SOURCE``: perplexity, bits per character or (music) NLL per frame of a split, by the procedure
the flags choose."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import checkpoints
from commands import COMMANDS
from commands.common import CommandParser, quantize_model, source_arguments
from datamodules.corpora import SPLITS
from datamodules.kinds import PROCEDURES
from evaluation.dispatch import score_split
from evaluation.perplexity import check_settings, parse_temperature
from evaluation.procedures import chosen_by_flag
from evaluation.scoring import ScoringProcedure
from zoo.errors import ConfigError, number_flag
from zoo.settings import DEFAULT_MATMUL_PRECISION, MATMUL_PRECISION_HELP, MATMUL_PRECISIONS, matmul_precision_in_force


def cmd_evaluate(argv: Sequence[str]) -> None:
    """``lm-zoo evaluate SOURCE``: score a split with the full softmax (deterministic, MC dropout or dynamic)."""
    parser = CommandParser(prog="lm-zoo evaluate", description=COMMANDS["evaluate"].summary)
    source_arguments(parser, quantize=True)
    parser.add_argument("--split", choices=SPLITS, default="test")
    parser.add_argument("--batch-size", type=int, help="parallel streams (default: the training run's eval batch size)")
    parser.add_argument("--bptt", type=int, help="window length (default: the training run's eval BPTT)")
    parser.add_argument(
        "--max-tokens",
        type=number_flag("--max-tokens", int, 1),
        metavar="N",
        help="score only the windows up to the one holding the split's N-th token (a music model's: frame), a fixed "
        "part of it that is quick to re-measure; the result records N (default: the whole split)",
    )
    parser.add_argument("--corpus", help="another corpus or directory to score (default: the training corpus)")
    parser.add_argument("--data-root", help="where corpora live (default: $LM_ZOO_DATA)")
    parser.add_argument(
        "--matmul-precision", choices=MATMUL_PRECISIONS, default=DEFAULT_MATMUL_PRECISION, help=MATMUL_PRECISION_HELP
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_procedure_arguments(parser)  # --long-context, --temperature, --mc-samples, --dynamic, --tune, ...
    args = parser.parse_args(argv)

    procedure = procedure_from_args(args)
    # Before loading.
    check_settings(args.batch_size, args.bptt, args.long_context, args.temperature, procedure, args.max_tokens)
    if args.quantize and procedure is not None and procedure.needs_float_weights:
        raise ConfigError(
            f"--quantize {args.quantize} scores with fixed int8 weights: {procedure.flag} "
            f"{procedure.needs_float_weights}; drop one of them"
        )
    loaded = checkpoints.load(args.source, args.revision)
    quantize_model(loaded, args.quantize, args.device)
    datamodule = loaded.datamodule(args.corpus, args.data_root)
    if procedure is not None or args.long_context or args.temperature != 1.0:
        loaded.refuse(PROCEDURES)  # a music model is scored as it is
    options = {
        "long_context": args.long_context,
        "temperature": args.temperature,
        "seed": args.seed,
        "procedure": procedure,
    }
    # For the whole scoring, the temperature search and dynamic steps too; the caller's own put back after (a script
    # or a test calling cmd_evaluate keeps its precision).
    with matmul_precision_in_force(args.matmul_precision):
        sizes = (args.split, args.batch_size, args.bptt, args.device, args.max_tokens)
        result = score_split(loaded.model, loaded.kind, datamodule, *sizes, **options)
    result.source = loaded.source
    result.matmul_precision = args.matmul_precision  # a setting the figure depends on, as the eval batch size
    result.quantize = args.quantize
    print(json.dumps(result.to_json()) if args.json else result.describe())


def add_procedure_arguments(parser: argparse.ArgumentParser) -> None:
    """``lm-zoo evaluate``'s procedure flags: long context, temperature, the seed and every procedure's own
    (:data:`~evaluation.procedures.SCORING_PROCEDURES`); a bad value is one :class:`ConfigError` line
    naming the flag."""
    group = parser.add_argument_group("procedures (Melis et al. 2020 §3.3; the result records every setting)")
    group.add_argument(
        "--long-context", action="store_true", help="score the split as one stream (batch size 1, BPTT as given)"
    )
    group.add_argument(
        "--temperature",
        type=parse_temperature,
        default=1.0,
        metavar="T|auto",
        help="softmax temperature (default 1); auto: golden-section search on the valid split in [0.5, 2], then "
        "applied to --split (with --dynamic, or MoS dropout under --mc-samples, each trial re-runs the pass)",
    )
    group.add_argument(
        "--seed", type=number_flag("--seed", int, 0), default=0, help="seeds MC masks and --tune (default 0)"
    )
    for flag in (flag for procedure in chosen_by_flag() for flag in procedure.flags):
        if flag.kind is bool:
            group.add_argument(flag.name, action="store_true", help=flag.help)
        else:
            kind = number_flag(flag.name, flag.kind, flag.minimum)
            group.add_argument(flag.name, type=kind, metavar=flag.metavar, help=flag.help)


def procedure_from_args(args: argparse.Namespace) -> ScoringProcedure | None:
    """The procedure the flags of :func:`add_procedure_arguments` choose; ``None``: the deterministic pass.

    Raises:
        ConfigError: a flag given without the procedure it belongs to, or two procedures at once.
    """
    procedures = chosen_by_flag()
    flags = {flag.name: flag for procedure in procedures for flag in procedure.flags}
    values = {name: getattr(args, name.lstrip("-").replace("-", "_")) for name in flags}
    given = {name: value for name, value in values.items() if value is not None and value is not False}
    chosen = [procedure for kind in procedures if (procedure := kind.from_flags(given)) is not None]
    if len(chosen) > 1:
        raise ConfigError(f"{chosen[-1].flag} with {chosen[0].flag} is not supported: run them separately")
    return chosen[0] if chosen else None
