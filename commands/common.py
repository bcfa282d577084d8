"""What every subcommand shares: its argument parser, the SOURCE and ``--device`` arguments, and
:func:`user_error`, the one place where an exception becomes the one-line message ``lm-zoo`` prints."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path
from typing import Any, NoReturn

from datamodules.corpora import cache_root
from datamodules.kinds import QUANTIZE
from zoo.errors import ConfigError, DataError, LMZooError

SOURCE_HELP = (
    "a .ckpt written by lm-zoo fit, a run's directory (its newest best.ckpt, e.g. runs/ptb/lstm-small), a directory "
    "written by lm-zoo export, a Hub repo id or a registered name"
)


class CommandParser(argparse.ArgumentParser):
    """The parser of lm-zoo's own subcommands: a bad argument is one line (``main`` prints it), not usage plus an
    error; ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}; {self.prog} --help lists the options")


DEVICE_HELP = "auto (a CUDA GPU where there is one, else cpu), cpu, cuda or cuda:N"
QUANTIZE_MODES = ("int8", "int8-head")  # zoo.quantization.MODES, kept here so that --help need not import torch
QUANTIZE_HELP = (
    "int8: the LSTM/GRU and output layers in int8 (PyTorch's dynamic quantization), for faster inference on a CPU; "
    "int8-head: the output layer alone, any cell (faster for small layers: docs/evaluation.md)"
)


# The commands with --quantize: an int8 model is no stored kind of model (an export holds float32 or float16 weights)
# but a copy made in memory as one of these runs it. The others that take a model refuse the flag (refuse_quantize).
QUANTIZING = ("evaluate", "generate", "score")


def source_arguments(parser: argparse.ArgumentParser, quantize: bool = False) -> None:
    """The arguments of a command that runs a model: SOURCE, ``--revision``, ``--device`` and, with ``quantize``,
    ``--quantize`` (:func:`quantize_model` applies it; without, :func:`refuse_quantize` refuses it)."""
    parser.add_argument("source", help=SOURCE_HELP)
    parser.add_argument("--revision", help="for a Hub source: branch, tag or commit (default main)")
    parser.add_argument("--device", type=device_argument, default="auto", help=DEVICE_HELP)
    if quantize:
        parser.add_argument("--quantize", choices=QUANTIZE_MODES, help=QUANTIZE_HELP)
    else:
        refuse_quantize(parser)


class _NoQuantize(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        mode = values if values in QUANTIZE_MODES else QUANTIZE_MODES[0]
        raise ConfigError(
            f"{parser.prog} has no --quantize: an int8 model is not stored (an export holds float32 or float16 "
            f"weights) but made in memory by lm-zoo {', '.join(QUANTIZING[:-1])} or {QUANTIZING[-1]} --quantize "
            f"{mode} --device cpu; drop --quantize here"
        )


def refuse_quantize(parser: argparse.ArgumentParser) -> None:
    """``--quantize`` (hidden from ``--help``) on a command that takes a model but runs no int8 copy of it: one line
    saying which commands make one (:data:`QUANTIZING`), where argparse would only call the flag unrecognized."""
    parser.add_argument("--quantize", nargs="?", action=_NoQuantize, help=argparse.SUPPRESS)


def quantize_model(loaded: Any, quantize: str | None, device: str) -> None:
    """``--quantize``: replace ``loaded.model`` with its int8 copy (:func:`zoo.quantization.quantize_int8`), all of it
    (``int8``) or its output layer alone (``int8-head``).

    Raises:
        ConfigError: a device other than the CPU, a kind of model that has no int8 copy (music), or a model the
            quantization does not apply to.
    """
    if quantize is None:
        return
    loaded.refuse(QUANTIZE)  # a music model has no int8 copy
    if not str(device).startswith("cpu"):
        raise ConfigError(f"--quantize {quantize} runs on the CPU (PyTorch's int8 kernels): add --device cpu")
    from zoo.quantization import quantize_int8  # deferred: most commands never quantize

    loaded.model = quantize_int8(loaded.model, recurrent=quantize == "int8")


def device_argument(text: str) -> str:
    """``--device``: ``auto`` (the GPU where there is one), or a device PyTorch knows and this machine has."""
    import torch  # deferred: `lm-zoo --help` and the commands without a model should not wait for it

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is no device: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: PyTorch sees no CUDA GPU on this machine: use --device cpu")
    return text


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


# errno values that say something about the user's paths (missing, permissions, a file where a directory should be,
# a full disk), not about lm-zoo: these become one line too.
_PATH_ERRNOS = {
    errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
}  # fmt: skip


# The packages only one feature needs (pyproject.toml's extras): a missing one is one line naming the extra to install.
EXTRAS = {"optuna": "tune", "grpc": "search", "nltk": "parse", "scipy": "music", "mido": "music"}


def user_error(err: BaseException) -> LMZooError | None:
    """The one-line error for ``err``, or ``None`` for a bug (which keeps its traceback).

    This is the one place where exceptions become messages: lm-zoo's own errors (also when jsonargparse or Lightning
    re-raised them wrapped in one of theirs), Lightning's verdicts on a configuration, operating-system errors about
    the user's paths, and an optional package (:data:`EXTRAS`) that is not installed.
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    chain = _chain(err)
    ours = next((e for e in chain if isinstance(e, LMZooError)), None)
    if ours is not None:
        return ours
    for current in chain:
        if isinstance(current, MisconfigurationException):
            text = " ".join(str(current).split())
            return ConfigError(f"Lightning: {text}")
        if isinstance(current, OSError) and not current.filename and current.errno in (errno.ENOSPC, errno.EDQUOT):
            # A write refused inside a library (torch.save, safetensors) names no file.
            return DataError(f"{current.strerror.lower()}: free some space, then run the command again")
        if isinstance(current, OSError) and current.filename and current.errno in _PATH_ERRNOS:
            path = Path(current.filename)
            cache = cache_root()
            hint = "set LM_ZOO_CACHE to a writable directory" if path.is_relative_to(cache) else "check the path"
            return DataError(f"{path}: {current.strerror.lower()}: {hint}")
        storage = _storage_error(current)
        if storage is not None:
            return storage
        mismatch = _launcher_mismatch(current)
        if mismatch is not None:
            return mismatch
        missing = current.name.split(".")[0] if isinstance(current, ModuleNotFoundError) and current.name else None
        if missing in EXTRAS:
            return ConfigError(f'this needs {missing}, which is not installed: pip install "lm-zoo[{EXTRAS[missing]}]"')
    return None


def _launcher_mismatch(err: BaseException) -> LMZooError | None:
    """Lightning's check that ``trainer.devices`` and ``trainer.num_nodes`` match the processes torchrun or SLURM
    started (a plain ``ValueError`` from a cluster environment's ``validate_settings``), as one line."""
    trace = err.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next  # the innermost frame: where it was raised
    if not isinstance(err, ValueError) or trace is None or trace.tb_frame.f_code.co_name != "validate_settings":
        return None
    if not str(trace.tb_frame.f_globals.get("__name__")).startswith("lightning.fabric.plugins.environments"):
        return None
    text = " ".join(str(err).split())
    return ConfigError(f"Lightning: {text} Set trainer.devices and trainer.num_nodes to what the launcher started.")


STORAGE_FORMS = (
    "sqlite:///FILE.db, postgresql://USER@HOST/DB, mysql+pymysql://USER@HOST/DB, a journal FILE.log or grpc://HOST:PORT"
)


def _storage_error(err: BaseException) -> LMZooError | None:
    """An Optuna storage URL (``--storage`` of tune and search) that SQLAlchemy cannot parse or open, or whose database
    driver is not installed, as one line. Recognised by the exception's module and Optuna's own message, so that
    SQLAlchemy is never imported here."""
    module = type(err).__module__
    if module.startswith("grpc") and callable(getattr(err, "code", None)):  # a grpc:// storage's server, mid-run
        details = err.details() if callable(getattr(err, "details", None)) else ""  # type: ignore[attr-defined]
        return DataError(
            f"--storage: the storage server stopped answering ({err.code().name}: {details}): "  # type: ignore[attr-defined]
            "restart lm-zoo search serve on the same database and run the command again"
        )
    if isinstance(err, ImportError) and "DB access module for the specified storage URL" in str(err):
        return ConfigError(
            "--storage: the database driver for this URL is not installed (postgresql:// needs psycopg2, "
            "mysql+pymysql:// needs pymysql): pip install it, or use sqlite:///FILE.db"
        )
    if module.startswith("sqlalchemy") and type(err).__name__ == "ArgumentError":
        return ConfigError(f"--storage: {str(err).splitlines()[0]}: use {STORAGE_FORMS}")
    if module.startswith("sqlalchemy") and type(err).__name__ == "OperationalError":
        reason = str(getattr(err, "orig", None) or err).splitlines()[0]
        return DataError(f"--storage: the storage cannot be opened ({reason}): check the URL, the server and the path")
    return None
