"""``lm-zoo evaluate SOURCE``: perplexity, bits per character or (music) NLL per frame of a split, by the procedure
the flags choose."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import checkpoints
from checkpoints.export_write import score
from commands import COMMANDS
from commands.common import (
    CommandParser,
    option,
    quantize_model,
    source_arguments,
)
from datamodules.corpora import SPLITS
from datamodules.kinds import PROCEDURES
from lightning_modules.evaluation.dynamic import DynamicEvaluation
from lightning_modules.evaluation.mc_dropout import DEFAULT_ROWS_PER_CALL, MCDropout
from lightning_modules.evaluation.perplexity import check_settings, parse_temperature
from zoo.errors import ConfigError
from zoo.settings import DEFAULT_MATMUL_PRECISION, MATMUL_PRECISION_HELP, MATMUL_PRECISIONS, set_matmul_precision


def cmd_evaluate(argv: Sequence[str]) -> None:
    """``lm-zoo evaluate SOURCE``: score a split with the full softmax (deterministic, MC dropout or dynamic)."""
    parser = CommandParser(prog="lm-zoo evaluate", description=COMMANDS["evaluate"].summary)
    source_arguments(parser, quantize=True)
    parser.add_argument("--split", choices=SPLITS, default="test")
    parser.add_argument("--batch-size", type=int, help="parallel streams (default: the training run's eval batch size)")
    parser.add_argument("--bptt", type=int, help="window length (default: the training run's eval BPTT)")
    parser.add_argument(
        "--max-tokens",
        type=option("--max-tokens", int, 1),
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

    procedure = procedure_from_args(args)  # mc, dynamic, tune_trials
    check_settings(  # before loading
        args.batch_size, args.bptt, args.long_context, args.temperature, **procedure, max_tokens=args.max_tokens
    )
    if args.quantize and (procedure["mc"] or procedure["dynamic"]):
        raise ConfigError(
            f"--quantize {args.quantize} scores with fixed int8 weights: --mc-samples needs dropout and --dynamic "
            "trains the weights; drop one of them"
        )
    loaded = checkpoints.load(args.source, args.revision)
    quantize_model(loaded, args.quantize, args.device)
    set_matmul_precision(args.matmul_precision)  # for the whole command: temperature search and dynamic steps too
    datamodule = loaded.datamodule(args.corpus, args.data_root)
    if procedure["mc"] or procedure["dynamic"] or args.long_context or args.temperature != 1.0:
        loaded.kind.refuse(PROCEDURES, loaded.source)  # a music model is scored as it is
    options = {"long_context": args.long_context, "temperature": args.temperature, "seed": args.seed, **procedure}
    result = score(loaded, datamodule, args.split, args.batch_size, args.bptt, args.device, args.max_tokens, **options)
    result.source = loaded.source
    result.matmul_precision = args.matmul_precision  # a setting the figure depends on, as the eval batch size
    result.quantize = args.quantize
    print(json.dumps(result.to_json()) if args.json else result.describe())


def add_procedure_arguments(parser: argparse.ArgumentParser) -> None:
    """``lm-zoo evaluate``'s procedure flags; a bad value is one :class:`ConfigError` line naming the flag."""
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
        "--mc-samples",
        type=option("--mc-samples", int, 1),
        metavar="N",
        help="MC dropout: average the predictions of N sampled dropout masks in probability space (paper: 200)",
    )
    group.add_argument(
        "--dropout-scale",
        type=option("--dropout-scale", float, 0),
        metavar="F",
        help="MC dropout: every dropout rate times F while sampling (Melis et al. 2018; default 1)",
    )
    group.add_argument(
        "--mc-batch",
        type=option("--mc-batch", int, 1),
        metavar="ROWS",
        help=f"MC dropout: most stream replicas (streams x samples) per forward call (default {DEFAULT_ROWS_PER_CALL})",
    )
    group.add_argument("--seed", type=option("--seed", int, 0), default=0, help="seeds MC masks and --tune (default 0)")
    group.add_argument(
        "--dynamic",
        action="store_true",
        help="dynamic evaluation (Krause et al. 2017): one stream; after scoring each segment, a gradient step on it",
    )
    defaults = DynamicEvaluation()
    for flag, metavar, text in (
        ("--dyn-lr", "ETA", f"learning rate (default {defaults.learning_rate:g}; Table 6: 1e-6 .. 1e-3)"),
        ("--dyn-decay", "LAMBDA", f"decay towards the trained weights (default {defaults.decay_rate:g}; 1e-6 .. 1e-2)"),
        ("--dyn-eps", "EPS", f"epsilon of the RMS-normalised step (default {defaults.epsilon:g}; 1e-8 .. 1e-2)"),
    ):
        group.add_argument(flag, type=option(flag, float, 0), metavar=metavar, help=text)
    for flag, metavar, text in (
        ("--dyn-max-time-steps", "T", "segment length (default 10 for words, 25 for characters; 1 .. 20 / 50)"),
        (
            "--dyn-stat-batches",
            "K",
            f"training batches for the mean squared gradients (default {defaults.stat_batches})",
        ),
        ("--dyn-stat-batch-size", "B", f"streams per such batch (default {defaults.stat_batch_size}, the paper's)"),
    ):
        group.add_argument(flag, type=option(flag, int, 1), metavar=metavar, help=text)
    group.add_argument(
        "--tune",
        action="store_true",
        help="with --dynamic: search Table 6's ranges on the valid split (Optuna TPE); the best settings score --split",
    )
    group.add_argument(
        "--tune-trials",
        type=option("--tune-trials", int, 1),
        metavar="N",
        help=f"settings --tune tries (default {DEFAULT_TUNE_TRIALS}; the first is the given one)",
    )
    group.add_argument(
        "--tune-tokens",
        type=option("--tune-tokens", int, 1),
        metavar="N",
        help="score each --tune trial on the first N valid tokens only (default: all; Krause et al. used 30000)",
    )


def procedure_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of :func:`add_procedure_arguments` as :func:`evaluate` arguments (``mc``, ``dynamic``,
    ``tune_trials``, ``tune_tokens``).

    Raises:
        ConfigError: a flag given without the procedure it belongs to.
    """
    flags = ("mc_samples", "dropout_scale", "mc_batch", "dynamic", "tune", "tune_trials", "tune_tokens", *DYNAMIC_FLAGS)
    values = {name: getattr(args, name, None) for name in flags}
    given = {name: v for name, v in values.items() if v is not None and v is not False}  # 0 is a given value
    for flag, needs, mode in (
        ("dropout_scale", "mc_samples", "--mc-samples N"),
        ("mc_batch", "mc_samples", "--mc-samples N"),
        ("tune_trials", "tune", "--tune"),
        ("tune_tokens", "tune", "--tune"),
        *((name, "dynamic", "--dynamic") for name in DYNAMIC_FLAGS),
        ("tune", "dynamic", "--dynamic"),
    ):
        if flag in given and needs not in given:
            raise ConfigError(f"--{flag.replace('_', '-')} applies only with {mode}: add it or drop the flag")
    mc = None
    if "mc_samples" in given:
        mc = MCDropout(given["mc_samples"], given.get("dropout_scale", 1.0), given.get("mc_batch"))
    dynamic = None
    if "dynamic" in given:
        dynamic = DynamicEvaluation(**{field: given[flag] for flag, field in DYNAMIC_FLAGS.items() if flag in given})
    trials = given.get("tune_trials", DEFAULT_TUNE_TRIALS) if "tune" in given else 0
    return {"mc": mc, "dynamic": dynamic, "tune_trials": trials, "tune_tokens": given.get("tune_tokens")}


#: ``lm-zoo evaluate`` flag (argparse dest) -> :class:`DynamicEvaluation` field.
DYNAMIC_FLAGS = {
    "dyn_lr": "learning_rate",
    "dyn_decay": "decay_rate",
    "dyn_eps": "epsilon",
    "dyn_max_time_steps": "max_time_steps",
    "dyn_stat_batches": "stat_batches",
    "dyn_stat_batch_size": "stat_batch_size",
}

DEFAULT_TUNE_TRIALS = 20
