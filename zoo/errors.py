"""The errors lm-zoo reports to a user as one line.

Every part of lm-zoo raises a subclass of :class:`LMZooError` for bad input; ``cli.main`` prints its message on one line
(no traceback unless ``--debug``) and exits with :attr:`LMZooError.exit_code`. The message names the problem and what
to do about it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def clip(text: str, limit: int = 200) -> str:
    """``text``'s first line, cut at a word boundary with `` ...`` when longer than ``limit``: a quoted reason inside
    a one-line error that never ends mid-word."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


class LMZooError(Exception):
    """Base class of errors that are shown to the user as one line."""

    exit_code: int = 2  # bad input


class ConfigError(LMZooError):
    """A configuration names something that does not exist or cannot work (e.g. an unknown architecture)."""


class DataError(LMZooError):
    """A corpus is missing, empty, unreadable or not UTF-8."""


class CheckpointError(LMZooError):
    """A checkpoint is corrupt, incomplete, or does not match the model or vocabulary it is used with."""


class TrainingDivergedError(LMZooError):
    """The training loss became NaN or infinite."""

    exit_code = 1  # a failed run, not bad input


class PeerLost(LMZooError):
    """Another process of a multi-process run stopped (an error, a kill), so this one cannot go on."""

    exit_code = 1  # a failed run, not bad input


class Interrupted(LMZooError):
    """Training was stopped by SIGINT (Ctrl-C) or SIGTERM; the work up to ``checkpoint`` is kept.

    Attributes:
        checkpoint: the ``last.ckpt`` that resumes the run, or ``None`` if none was written.
        exit_code: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a killed process.
    """

    def __init__(self, message: str, signal_number: int, checkpoint: str | None) -> None:
        super().__init__(message)
        self.exit_code = 128 + signal_number
        self.checkpoint = checkpoint


def number_flag(flag: str, kind: type[int] | type[float], minimum: float, above: bool = False) -> Callable[[str], Any]:
    """An argparse ``type`` for a number ``>= minimum`` (``> minimum`` if ``above``) that refuses anything else with
    one :class:`ConfigError` line naming ``flag`` (argparse's own error would print the usage too)."""
    bound = f"> {minimum:g}" if above else f">= {minimum:g}"
    what = f"an integer {bound}" if kind is int else f"a number {bound}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ConfigError(f"{flag} must be {what}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise ConfigError(f"{flag} must be {what}, got {text!r}")
        return value

    return parse
