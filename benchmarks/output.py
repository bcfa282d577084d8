"""Where a benchmark writes its results: ``--out`` and ``--resume``, the same for every script.

A run writes a new file: ``--out PATH`` when given (refused if PATH exists), else ``benchmarks/results/<name>-<date
and time>.json`` beside the committed ``<name>.json``, which a run therefore never overwrites. ``--resume`` (scripts
that fill a table cell by cell, or add rounds to a measurement) continues an existing file instead: ``--out``, or the
committed results by default. So a README's "reproduce" command measures afresh in a fresh clone, and continuing an
earlier run is a choice the command line shows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

RESULTS = Path(__file__).resolve().parent / "results"


def committed(name: str) -> Path:
    """The results file the repository holds for the benchmark ``name``."""
    return RESULTS / f"{name}.json"


def add_arguments(parser: argparse.ArgumentParser, name: str, resumable: bool = True) -> None:
    """``--out`` (and, for a script that can continue a file, ``--resume``) for the benchmark ``name``."""
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the results file to write, which must not exist yet (default: a new {RESULTS.name}/{name}-<time>.json"
        f", never the committed {name}.json)" + ("; with --resume, the file to continue" if resumable else ""),
    )
    if resumable:
        parser.add_argument(
            "--resume",
            action="store_true",
            help=f"continue --out (default: the committed {name}.json) instead of starting a new file",
        )


def commit() -> str:
    """The checkout's commit (12 digits), ``-dirty`` with uncommitted changes to tracked files; ``unknown`` outside
    git: which code a result measured. ``LM_ZOO_COMMIT`` names it where the checkout's git is not the one measured
    (the lent GPU machine's copy of the working tree)."""
    if os.environ.get("LM_ZOO_COMMIT"):
        return os.environ["LM_ZOO_COMMIT"]
    root = RESULTS.parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance(device: str) -> dict[str, Any]:
    """What ran a measurement, for a results file to record beside it: the commit, the device in words, torch and its
    CUDA and cuDNN builds, and the versions of the packages a training step goes through (a result measured at other
    versions than the project pins says so on its page: benchmarks/render.py)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch  # deferred: the scripts that write no CUDA results need not pay for it here

    on_gpu = str(device).startswith("cuda")
    packages = {}
    for name in ("lightning", "torchmetrics", "huggingface_hub"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    return {
        "commit": commit(),
        "device": torch.cuda.get_device_name(torch.device(device)) if on_gpu else str(hardware()["cpu"]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if on_gpu else None,
        "cudnn": torch.backends.cudnn.version() if on_gpu else None,
        "packages": packages,
    }


def fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2, as ``lm-zoo`` does for bad input."""
    print(f"{Path(sys.argv[0]).name}: {message}", file=sys.stderr)
    raise SystemExit(2)


def output_path(args: argparse.Namespace, name: str) -> Path:
    """The file this run writes, after the checks of the module docstring."""
    if getattr(args, "resume", False):
        path = args.out or committed(name)
        if not path.is_file():
            fail(f"--resume: {path} does not exist, so there is nothing to continue (without --resume: a new file)")
        return path
    if args.out is not None:
        if args.out.exists():
            fail(f"--out {args.out} exists: give --resume to continue it, or name a new file")
        return args.out
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = RESULTS / f"{name}-{stamp}.json", 2
    while path.exists():  # two runs started in the same second
        path, n = RESULTS / f"{name}-{stamp}-{n}.json", n + 1
    return path


def table_path(args: argparse.Namespace, name: str) -> Path:
    """The file a ``--table-only`` run reads: ``--out``, or the committed results."""
    path = args.out or committed(name)
    if not path.is_file():
        fail(f"--table-only: {path} does not exist")
    return path


def read(path: Path) -> dict[str, Any]:
    """The results in ``path``, or nothing when it does not exist yet."""
    return json.loads(path.read_text()) if path.exists() else {}


def write(path: Path, results: Any) -> None:
    """Write ``results`` as indented JSON; through a temporary file, so that an interrupted run leaves the file as it
    was (a table filled over several sessions is never cut in half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(partial, path)


def check_same(what: str, recorded: dict[str, Any], expected: dict[str, Any], path: Path) -> None:
    """``--resume`` adds to a file only what the same settings would have written: ``recorded`` (a cell's, or the
    file's) must hold ``expected``'s values (those it records: a file written before a setting was recorded is not
    held to it)."""
    differ = [f"{k} {recorded[k]!r}, not {v!r}" for k, v in expected.items() if k in recorded and recorded[k] != v]
    if differ:
        settings = "; ".join(differ)
        fail(f"--resume: {what} of {path} was run with {settings}: resume with its settings or start a new file")


def hardware() -> dict[str, object]:
    """What the figures were measured on."""
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        model = names[0] if names else model
    return {"machine": platform.machine(), "cpu": model, "cpu_count": os.cpu_count(), "system": platform.platform()}
