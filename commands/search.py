"""``lm-zoo search``: Jozefowicz et al. 2015's architecture search, run by workers sharing an Optuna storage, and
``lm-zoo search report``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Sequence

import optuna  # the search extra (pip install "lm-zoo[search]")
import torch

from commands.common import CommandParser
from lightning_modules.search.evolution import SearchStore, Worker, format_report, load_config, report, worker_random
from zoo.errors import ConfigError


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``2h`` or a number of seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text[-1:] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise ConfigError(f"--budget {text!r} is not a duration: write e.g. 2h, 30m or 90s") from None


def quiet_optuna() -> None:
    """Optuna's per-trial INFO lines and its "experimental" warnings on heartbeats say nothing a search's own log does
    not: the command turns them off for its process (a library module never changes global log levels)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def cmd_search(argv: Sequence[str]) -> None:
    """``lm-zoo search`` (run workers) and ``lm-zoo search report``."""
    argv = list(argv)
    quiet_optuna()
    if argv[:1] == ["report"]:
        parser = CommandParser(prog="lm-zoo search report", description="the search's statistics and list")
        parser.add_argument("--storage", required=True, help="the search's storage URL (or journal .log file)")
        parser.add_argument("--config", help="the search config (its tasks and thresholds; default: the store's)")
        parser.add_argument("--top", type=int, default=10, help="list rows to print (--json: up to 100)")
        parser.add_argument("--json", action="store_true")
        args = parser.parse_args(argv[1:])
        store = SearchStore(args.storage, create=False)
        result = report(store, load_config(args.config) if args.config else None, top=max(args.top, 100))
        print(json.dumps(result, indent=1, default=str) if args.json else format_report(result, args.top))
        return
    parser = CommandParser(
        prog="lm-zoo search",
        description="Jozefowicz et al. 2015's architecture search (docs/search.md)",
        epilog="lm-zoo search report --storage URL [--top N] [--json]: the search's statistics and its best cells",
    )
    parser.add_argument("--config", required=True, help="the search (configs/search/jozefowicz.yaml)")
    parser.add_argument("--storage", required=True, help="e.g. sqlite:///search.db, postgresql://host/db")
    parser.add_argument("--workers", type=int, default=1, help="processes on this machine, sharing the storage")
    parser.add_argument("--budget", default="1h", help="how long to search (e.g. 2h); the running step finishes")
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds this machine's workers (with the worker index and the store's size)"
    )
    parser.add_argument("--threads", type=int, help="torch threads per worker (default: the cores / workers)")
    parser.add_argument("--heartbeat", type=int, default=60, help="seconds; a worker silent for 4 is failed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    budget = parse_duration(args.budget)
    config = load_config(args.config)
    store = SearchStore(args.storage, heartbeat=args.heartbeat)

    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    torch.set_num_threads(threads)
    helpers = []
    if not args.worker:
        for index in range(1, args.workers):
            command = [sys.executable, "-m", "cli", "search", "--config", args.config, "--storage", args.storage]
            command += ["--budget", str(budget), "--seed", str(args.seed + index), "--threads", str(threads)]
            command += ["--heartbeat", str(args.heartbeat)]
            helpers.append(subprocess.Popen([*command, "--worker"]))
    worker = Worker(config, store, worker_random(args.seed, store), log=lambda line: print(line, flush=True))
    try:
        steps = worker.run(budget)
    finally:
        for helper in helpers:
            helper.wait()
    print(f"search: {steps} steps in this process; lm-zoo search report --storage {args.storage}")
