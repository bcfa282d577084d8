"""Progress for work that takes more than a few seconds: a bar on a terminal, a line every 30 s in a log.

On a terminal, lm-zoo shows Rich's progress bar, the library of Lightning's default bar (``RichProgressBar``), for
``fit`` and for everything outside it (:class:`Progress`: evaluation procedures, dynamic evaluation's statistics and
tuning, ...). When stderr is not a terminal (a log file, CI, ``nohup``), a live bar prints nothing useful, so a line
like ``lm-zoo: test: 4,120/8,243 windows (50%), 2:01 elapsed, ~2:01 left`` goes to stderr every
``$LM_ZOO_PROGRESS_SECONDS`` seconds (default 30) instead: a log shows that the work is moving and how far it is.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

DEFAULT_PERIOD_SECONDS = 30.0


def period_seconds() -> float:
    """Seconds between two progress lines where there is no terminal (``$LM_ZOO_PROGRESS_SECONDS``, default 30)."""
    try:
        return max(0.0, float(os.environ.get("LM_ZOO_PROGRESS_SECONDS", DEFAULT_PERIOD_SECONDS)))
    except ValueError:
        return DEFAULT_PERIOD_SECONDS


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


class FitProgressBar(RichProgressBar):
    """Lightning's default bar for ``fit``, with three fixes.

    - A run without an epoch limit (the GBW recipes stop at ``max_steps``; ``max_epochs: -1``) reads "Epoch 3", not
      Rich's "Epoch 3/-2".
    - The run version shows as the integer it is (Rich prints every number as ``0.000``).
    - Where stderr is not a terminal, Rich draws nothing; a line every 30 s (:class:`ProgressLines`) says where
      training and validation are, with the training loss.
    """

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        if "v_num" in items:
            items["v_num"] = str(items["v_num"])
        return items

    # ------------------------------------------------------------------------------------- without a terminal
    def _start_train_lines(self, trainer: L.Trainer, done_before: int = 0) -> None:
        total = self.total_train_batches
        self._train_lines = ProgressLines(
            f"epoch {trainer.current_epoch}", int(total) if total != float("inf") else None, "batches", done_before
        )
        self._train_lines_epoch = trainer.current_epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if not interactive():
            self._start_train_lines(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not interactive() and getattr(self, "_train_lines_epoch", None) != trainer.current_epoch:
            # A run resumed mid-epoch: Lightning calls no on_train_epoch_start for the epoch it resumes.
            self._start_train_lines(trainer, done_before=batch_idx)
        lines = getattr(self, "_train_lines", None)
        if lines is not None:
            loss = trainer.callback_metrics.get("train_loss")
            extra = f", train_loss {float(loss):.4f}" if loss is not None else ""
            lines.update(batch_idx + 1, f"{extra}, step {trainer.global_step:,}")

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_epoch_start(trainer, pl_module)
        if not interactive() and not trainer.sanity_checking:
            total = sum(int(n) for n in trainer.num_val_batches if n != float("inf")) or None
            self._val_lines = ProgressLines("validation", total, "batches")

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        lines = getattr(self, "_val_lines", None)
        if lines is not None and not trainer.sanity_checking:
            lines.update(batch_idx + 1)
