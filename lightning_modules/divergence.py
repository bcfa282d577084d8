"""The divergence guard: a Lightning callback that stops a diverging run before any checkpoint holds its weights, and
that carries a stop signal noted on any rank to every rank at the same step.

Each optimizer step's check reads two figures:

- the window's training loss: ``outputs["window_loss"]`` where the training step returns it (lm-zoo's modules: the
  head's mean nats per predicted unit, before AR, TAR and the cells' own terms), else ``outputs["loss"]``;
- one scalar that is NaN or infinite iff some gradient is: the norm the gradient clipping computed where the step
  reports it (:meth:`DivergenceGuard.observe_gradients`, a second pass over every gradient saved), else the gradients'
  sum, taken here. Not under a gradient scaler (16-bit mixed precision), which itself skips the steps whose scaled
  gradients overflowed.

Reading them on the host at once would make the host wait for the GPU at every step, and Lightning's per-step Python
would then add to the GPU's time instead of overlapping it. So they are copied to the host without waiting
(:class:`PendingCheck`) and decided one step later, by when the copy has long landed. A diverged step's update has then
reached the weights, but no checkpoint is written from them: every save decides on the pending check first
(:meth:`DivergenceGuard.on_save_checkpoint`, before the module's own, which refuses non-finite weights), as do
validation and the end of training, and the error names the step that diverged.

Under DDP the decision is every rank's: the figures are gathered before the host copy, so every rank raises the same
error at the same step. A rank that raised alone would leave the others blocked in the next gradient all-reduce.

A signal noted on any rank (:meth:`DivergenceGuard.note_signal`, by :class:`checkpoints.ckpt_write.LastCheckpoint`)
travels in the same gather: every rank sets :attr:`DivergenceGuard.agreed_stop` at the same step (the step after the
gather, where it is read), and each writes ``last.ckpt`` and stops in step with the others
(:mod:`lightning_modules.faults`). One process stops at the step its signal came in.

:class:`~lightning_modules.stateful.StatefulTraining` returns one from ``configure_callbacks``, with its
``divergence_threshold``; any LightningModule's run can take one as a trainer callback.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_modules.resume import gathering_world_size
from zoo.errors import TrainingDivergedError

#: The training step's output the guard checks, where the step returns it beside ``loss`` (the objective).
WINDOW_LOSS = "window_loss"


class DivergenceGuard(L.Callback):
    """Stops training with one line when a step's training loss is non-finite or above ``threshold``, or a gradient
    is non-finite; and agrees across ranks on a stop signal (see the module's docstring).

    Args:
        threshold: nats per predicted unit above which the training loss counts as diverged; ``0``: only non-finite
            losses stop the run.
        threshold_option: the setting that holds ``threshold``, named in the error.
    """

    def __init__(self, threshold: float, threshold_option: str = "model.init_args.divergence_threshold") -> None:
        self.threshold, self.threshold_option = threshold, threshold_option
        # A signal noted on this rank, and the stop every rank agreed on at this step: (the lowest rank that noted
        # one, its signal).
        self.stop_signal: int | None = None
        self.agreed_stop: tuple[int, int] | None = None
        self._gradients: Tensor | None = None  # what the step's clipping (or lm-zoo's own step) reported
        self._steps_seen = 0
        self._pending: PendingCheck | None = None
        # The fit's, fixed from its start: whether a gradient scaler runs, how many ranks gather, and where (a
        # collective's tensors must be on the module's device: NCCL gathers no CPU tensor).
        self._scaled, self._world_size, self._device = False, 1, torch.device("cpu")

    # -------------------------------------------------------------------------------------- the public interface
    def note_signal(self, signum: int) -> None:
        """Note a signal on this rank: it travels with the next step's figures, and every rank stops together."""
        self.stop_signal = signum

    def observe_gradients(self, figure: Tensor | None) -> None:
        """This step's gradient figure, from whoever computed it (the clipping's norm, or lm-zoo's own step's norm or
        sum): NaN or infinite iff some gradient is. Read at the step's end, on the device, without waiting."""
        self._gradients = figure

    def settle(self) -> None:
        """Decide on the pending check now (waiting for its copy if it has not landed): before a checkpoint is
        written, before validation, at the end of training."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._decide(pending)

    # ------------------------------------------------------------------------------------------ Lightning's hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A module fitted again in this process starts with no stop and nothing pending.
        self.stop_signal, self.agreed_stop, self._pending, self._gradients = None, None, None, None
        self._steps_seen = trainer.global_step
        self._scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        self._world_size = gathering_world_size(trainer)
        self._device = pl_module.device

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Start this step's check and decide on the previous one's, where an optimizer step ran (once every
        ``accumulate_grad_batches`` batches: the last batch's loss is checked)."""
        if trainer.global_step == self._steps_seen:
            return
        self._steps_seen = trainer.global_step
        loss = _window_loss(outputs)
        gradients, self._gradients = self._gradients, None
        if self._scaled:
            gradients = None
        elif gradients is None:
            gradients = gradients_sum(pl_module.parameters())
        self.check(loss, gradients, self._steps_seen - 1, trainer.current_epoch, self._world_size)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.settle()  # no validation of a diverged step's weights

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.settle()  # a diverged step is named as such, before the module looks at its weights

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.settle()  # the last step's check

    # -------------------------------------------------------------------------------------------------- the check
    def check(
        self, loss: Tensor | None, gradients: Tensor | None, step: int, epoch: int = 0, world_size: int = 1
    ) -> None:
        """Start ``step``'s check and decide on the previous step's.

        Args:
            loss: the step's training loss (``None``: not checked).
            gradients: its gradient figure, NaN or infinite iff some gradient is (``None``: not checked).
            step: the optimizer step, and ``epoch`` its epoch, that the error names.
            world_size: the ranks that gather their figures (every one of them calls this at the same step).
        """
        checked = ([loss.float()] if loss is not None else []) + ([gradients.float()] if gradients is not None else [])
        device = checked[0].device if checked else self._device
        # The signal as a fill on the device, not torch.tensor(value, device=...), which is a copy the host waits for.
        signal = torch.full((), float(self.stop_signal or 0), device=device)
        values = torch.stack([*checked, signal])  # (1 to 3,): the loss, the gradients' figure, this rank's signal
        if world_size > 1:
            # all_gather into a list: all_gather_into_tensor is deprecated in torch 2.13 and its successor,
            # all_gather_single, is newer than the oldest torch lm-zoo supports.
            gathered = [torch.empty_like(values) for _ in range(world_size)]
            dist.all_gather(gathered, values)
            rows = torch.stack(gathered)  # (W, 1 to 3): every rank's values
        else:
            rows = values.unsqueeze(0)  # (1, 1 to 3)
            # One process has nothing to agree on: its own signal stops it at this step, not the next.
            self.agreed_stop = (0, self.stop_signal) if self.stop_signal else None
        previous = self._pending
        self._pending = PendingCheck(rows, step, epoch, loss is not None, bool(checked))
        if previous is not None:
            self._decide(previous)

    def _decide(self, pending: PendingCheck) -> None:
        rows = pending.rows()
        if len(rows) > 1:
            signalled = [(rank, int(row[-1])) for rank, row in enumerate(rows) if row[-1]]
            self.agreed_stop = signalled[0] if signalled else None
        rows = [row[:-1] for row in rows]
        if not pending.checked:
            return
        if pending.has_loss:
            for rank, row in enumerate(rows):  # the lowest failing rank names the step's failure, on every rank
                self._check_loss(row[0], pending.step, pending.epoch, rank if len(rows) > 1 else None)
        values = rows[0][1:] if pending.has_loss else rows[0]  # the all-reduced gradients: the same on every rank
        if values and not math.isfinite(values[0]):
            raise TrainingDivergedError(
                f"a gradient became NaN or infinite at step {pending.step} (epoch {pending.epoch}) with a "
                "finite loss; lower the learning rate or set --trainer.gradient_clip_val, then resume from the last "
                "checkpoint"
            )

    def _check_loss(self, value: float, step: int, epoch: int, rank: int | None = None) -> None:
        if not math.isfinite(value) or 0 < self.threshold < value:
            limit = f" > {self.threshold_option} {self.threshold:.4g}" * math.isfinite(value)
            where = "" if rank is None else f"rank {rank}'s "
            raise TrainingDivergedError(
                f"{where}training loss became {value:.4g}{limit} at step {step} (epoch {epoch}); lower the learning "
                "rate or set --trainer.gradient_clip_val, then resume from the last checkpoint"
            )


def divergence_guard(trainer: Any) -> DivergenceGuard | None:
    """The run's :class:`DivergenceGuard`, or ``None`` where it has none (a trainer without callbacks included)."""
    return next((c for c in getattr(trainer, "callbacks", ()) if isinstance(c, DivergenceGuard)), None)


def gradients_sum(parameters: Iterable[Tensor]) -> Tensor | None:
    """One scalar that is NaN or infinite iff some gradient is (short of ~1e38 gradients), with no per-element
    temporary: the guard's figure where no clipping computes the gradients' norm; ``None`` without any."""
    sums = [p.grad.sum(dtype=torch.float32) for p in parameters if p.grad is not None]
    return torch.stack(sums).sum() if sums else None


def _window_loss(outputs: Any) -> Tensor | None:
    if isinstance(outputs, Tensor):
        return outputs.detach()
    if isinstance(outputs, dict):
        loss = outputs.get(WINDOW_LOSS, outputs.get("loss"))
        return None if loss is None else loss.detach()
    return None


class PendingCheck:
    """A step's divergence figures on their way to the host: copied without waiting (into pinned memory on a GPU,
    so that the copy is truly asynchronous), and read once the copy has landed (:meth:`rows`).

    Args:
        rows: ``(W, k)`` on the device: each rank's loss, gradients' sum or norm, signal (those present).
        step: the step they belong to, for the message.
        epoch: its epoch.
        has_loss: whether the first column is the training loss.
        checked: whether anything but the signal is in them.
    """

    def __init__(self, rows: Tensor, step: int, epoch: int, has_loss: bool, checked: bool) -> None:
        self.step, self.epoch, self.has_loss, self.checked = step, epoch, has_loss, checked
        on_gpu = rows.device.type == "cuda"
        self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=on_gpu)
        self._host.copy_(rows, non_blocking=True)  # on the CPU, a copy like any other
        self._event: torch.cuda.Event | None = None
        if on_gpu:
            self._event = torch.cuda.Event()
            self._event.record()

    def rows(self) -> list[list[float]]:
        """The figures, per rank; waits for the copy only if it has not landed (a step later, it has)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
