"""Progress for work that takes more than a few seconds: a bar on a terminal, a line every 30 s in a log.

On a terminal, lm-zoo shows Rich's progress bar, the library of Lightning's default bar (``RichProgressBar``), for
``fit`` (:class:`lightning_modules.progress.FitProgressBar`) and for everything outside it (:class:`Progress`: corpus
preparation, evaluation procedures, dynamic evaluation's statistics and tuning, ...). When stderr is not a terminal (a
log file, CI, ``nohup``), a live bar prints nothing useful, so a line like ``lm-zoo: test: 4,120/8,243 windows (50%),
2:01 elapsed, ~2:01 left`` goes to stderr every ``$LM_ZOO_PROGRESS_SECONDS`` seconds (default 30) instead: a log shows
that the work is moving and how far it is.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from zoo import settings


def period_seconds() -> float:
    """Seconds between two progress lines where there is no terminal (``$LM_ZOO_PROGRESS_SECONDS``, default 30;
    :mod:`zoo.settings`)."""
    return settings.current().progress_seconds


def interactive() -> bool:
    """Whether stderr is a terminal, where a live bar can be drawn."""
    return sys.stderr.isatty()


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class ProgressLines:
    """The non-terminal form of a bar: :meth:`update` prints a line when ``period_seconds()`` have passed."""

    def __init__(self, description: str, total: int | None, unit: str, done_before: int = 0) -> None:
        """``done_before``: units done before these lines started (a resumed epoch), left out of the rate."""
        self.description, self.total, self.unit = description, total, unit
        self.done_before = done_before
        self.period = period_seconds()
        self.start = self.last = time.monotonic()

    def due(self) -> bool:
        """Whether the next :meth:`update` prints: a caller whose ``extra`` costs something (a loss on a GPU, read
        back to the host) asks first."""
        return time.monotonic() - self.last >= self.period

    def update(self, done: int, extra: str = "") -> None:
        now = time.monotonic()
        if now - self.last < self.period:
            return
        self.last = now
        elapsed = now - self.start
        if self.total:
            left = elapsed * (self.total - done) / max(done - self.done_before, 1)
            share = f"{done:,}/{self.total:,} {self.unit} ({done / self.total:.0%})"
            where = f"{share}, {_clock(elapsed)} elapsed, ~{_clock(left)} left"
        else:
            where = f"{done:,} {self.unit}, {_clock(elapsed)} elapsed"
        print(f"lm-zoo: {self.description}: {where}{extra}", file=sys.stderr, flush=True)


class Progress:
    """``iterable``'s items, with progress shown as they are taken; every other attribute is the iterable's own.

    Args:
        iterable: what to go through (its ``len`` is the total, if it has one).
        description: what the work is, e.g. ``"test"``.
        unit: what an item is, e.g. ``"windows"``.
        total: the number of items, if ``len(iterable)`` is not it.
    """

    def __init__(self, iterable: Iterable[Any], description: str, unit: str = "windows", total: int | None = None):
        self.iterable, self.description, self.unit = iterable, description, unit
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.iterable, name)

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if interactive():
            from rich.progress import Progress as RichProgress

            with RichProgress(transient=True) as bar:
                task = bar.add_task(self.description, total=self.total)
                for item in self.iterable:
                    yield item
                    bar.advance(task)
            return
        lines = ProgressLines(self.description, self.total, self.unit)
        for done, item in enumerate(self.iterable, start=1):
            yield item
            lines.update(done)
