"""``lm-zoo search``: Jozefowicz et al. 2015's architecture search, run by workers sharing an Optuna storage,
``lm-zoo search report``, and ``lm-zoo search serve``, the storage server through which workers on other machines share
one search (docs/search.md)."""

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
from commands.recipes import config_file
from lightning_modules.storages import StorageServer, host_port, is_loopback
from search.evolution import (
    STUDY,
    SearchStore,
    Worker,
    format_report,
    load_config,
    report,
    worker_random,
)
from zoo.errors import ConfigError, number_flag


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


STORAGE_HELP = "sqlite:///search.db, a journal FILE.log, grpc://HOST:PORT (lm-zoo search serve) or postgresql://..."


def cmd_serve(argv: Sequence[str]) -> None:
    """``lm-zoo search serve``: Optuna's gRPC storage proxy in front of a database, until Ctrl-C."""
    parser = CommandParser(
        prog="lm-zoo search serve",
        description="serve a search's storage to workers on other machines (lm-zoo search --storage grpc://HOST:PORT)",
    )
    parser.add_argument("--storage", required=True, help="the database, e.g. sqlite:///search.db")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this machine only; reach it from others through an SSH "
        "tunnel, docs/search.md; 0.0.0.0 or :: opens it to the network, with no authentication)",
    )
    parser.add_argument("--port", type=number_flag("--port", int, 0), default=13000, help="0: one the system picks")
    args = parser.parse_args(argv)
    if args.port > 65535:
        raise ConfigError(f"--port must be a port number from 0 to 65535, got {args.port}")
    server = StorageServer(args.storage, args.host, args.port, watch=STUDY).start()
    every_interface = args.host in ("0.0.0.0", "::", "")
    where = host_port("HOST" if every_interface else args.host, server.port)
    if not is_loopback(args.host):
        print(
            f"search serve: listening beyond this machine's loopback ({args.host}): anyone who can reach port "
            f"{server.port} can read and rewrite the search, with no authentication; keep it behind a firewall, or "
            "serve on 127.0.0.1 and reach it through an SSH tunnel (docs/search.md)",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"search serve: {args.storage} on {host_port(args.host, server.port)}; workers: lm-zoo search --storage "
        f"grpc://{where} --config ... (Ctrl-C stops)",
        flush=True,
    )
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print(f"search serve: stopped; {len(server.failed)} silent trial(s) failed", flush=True)


def cmd_report(argv: Sequence[str]) -> None:
    """``lm-zoo search report``: the search's statistics and its list of best cells."""
    parser = CommandParser(prog="lm-zoo search report", description="the search's statistics and list")
    parser.add_argument("--storage", required=True, help=f"the workers' --storage: {STORAGE_HELP}")
    parser.add_argument(
        "--config", type=config_file, help="the search config (its tasks and thresholds; default: the store's)"
    )
    parser.add_argument("--top", type=int, default=10, help="list rows to print (--json: up to 100)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    store = SearchStore(args.storage, create=False)
    result = report(store, load_config(args.config) if args.config else None, top=max(args.top, 100))
    print(json.dumps(result, indent=1, default=str) if args.json else format_report(result, args.top))


def cmd_search(argv: Sequence[str]) -> None:
    """``lm-zoo search`` (run workers), ``lm-zoo search report`` and ``lm-zoo search serve``."""
    argv = list(argv)
    quiet_optuna()
    if argv[:1] == ["serve"]:
        cmd_serve(argv[1:])
        return
    if argv[:1] == ["report"]:
        cmd_report(argv[1:])
        return
    parser = CommandParser(
        prog="lm-zoo search",
        description="Jozefowicz et al. 2015's architecture search (docs/search.md)",
        epilog="lm-zoo search report --storage URL [--top N] [--json]: the search's statistics and its best cells; "
        "lm-zoo search serve --storage sqlite:///search.db --port 13000: a storage server for workers on many machines",
    )
    parser.add_argument(
        "--config",
        required=True,
        type=config_file,
        help="the search: a file, or a shipped one's name (search/jozefowicz)",
    )
    parser.add_argument("--storage", required=True, help=STORAGE_HELP)
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
