"""The progress bar of ``lm-zoo fit``: Lightning's Rich bar, or a line every 30 s where stderr is no terminal
(:mod:`datamodules.progress` has the lines and the bar of the work outside ``fit``)."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from datamodules.progress import ProgressLines, interactive
from lightning_modules.lightning_private import OpenEndedEpochs

METRICS_SECONDS = 0.5  # how often a terminal's bar shows the training figures anew (Rich asks at every batch)


class FitProgressBar(OpenEndedEpochs, RichProgressBar):
    """Lightning's default bar for ``fit``, with four fixes.

    - A run without an epoch limit (the GBW recipes stop at ``max_steps``; ``max_epochs: -1``) reads "Epoch 3", not
      Rich's "Epoch 3/-2" (:class:`~lightning_modules.lightning_private.OpenEndedEpochs`).
    - The run version shows as the integer it is (Rich prints every number as ``0.000``).
    - Where stderr is not a terminal, Rich draws nothing; a line every 30 s (:class:`ProgressLines`) says where
      training and validation are, with the training loss.
    - The figures are read from the device only when they are shown (:meth:`get_metrics`), not at every batch.
    """

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The bar's figures. Reading them (Lightning turns the logged tensors into numbers) makes the host wait for a
        GPU: at a training batch's end, where Rich asks every batch, they are read at most every
        :data:`METRICS_SECONDS` and never without a terminal, where Rich draws nothing."""
        now = time.monotonic()
        if getattr(self, "_in_train_batch_end", False):
            if not interactive():
                return {}
            if now - getattr(self, "_metrics_at", -math.inf) < METRICS_SECONDS:
                return self._metrics
        items = super().get_metrics(trainer, pl_module)
        if "v_num" in items:
            items["v_num"] = str(items["v_num"])
        self._metrics, self._metrics_at = items, now
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
        self._in_train_batch_end = True  # get_metrics: read the figures only when they are shown
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._in_train_batch_end = False
        if not interactive() and getattr(self, "_train_lines_epoch", None) != trainer.current_epoch:
            # A run resumed mid-epoch: Lightning calls no on_train_epoch_start for the epoch it resumes.
            self._start_train_lines(trainer, done_before=batch_idx)
        lines = getattr(self, "_train_lines", None)
        if lines is not None and lines.due():  # reading the loss makes the host wait for the device: only to print
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
