"""What every lm-zoo training module shares, whatever its data: the recurrent state carried from window to window,
the guards that stop a diverging run before it writes bad weights, and what a checkpoint keeps for an exact resume.

:class:`~lightning_modules.language_model.LanguageModel` (tokens) and :class:`~lightning_modules.music.MusicModel`
(piano-roll frames) subclass it. A subclass sets ``self.divergence_threshold`` and ``self.model`` (the plain network),
keeps each stage's state in ``self._state[stage]`` (zeroed here at every epoch start), implements
:meth:`StatefulTraining.window_nll` (validation and test steps are this module's) and
:meth:`StatefulTraining.log_epoch_figures`, updates ``self.metrics["train_nll"]`` and sets ``self._train_loss`` in its
training step for the divergence guard.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric

from lightning_modules.resume import RESUME_KEY, non_finite, rng_states, set_rng_states
from zoo.base import State
from zoo.errors import CheckpointError, TrainingDivergedError

STAGES = ("train", "val", "test")


class StatefulTraining(L.LightningModule):
    """Stateful truncated BPTT's bookkeeping: per-stage carried state, divergence guards and exact resume."""

    divergence_threshold: float  # nats per predicted unit; 0 turns the guard off
    model: nn.Module

    def __init__(self) -> None:
        super().__init__()
        self._state: dict[str, State | None] = dict.fromkeys(STAGES)
        self._resume: dict[str, Any] | None = None  # what a checkpoint kept for resuming fit, used by on_train_start
        self.metrics = nn.ModuleDict({f"{stage}_nll": MeanMetric() for stage in STAGES})

    def on_train_epoch_start(self) -> None:
        self._state["train"] = None

    def on_validation_epoch_start(self) -> None:
        self._state["val"] = None

    def on_test_epoch_start(self) -> None:
        self._state["test"] = None

    # ------------------------------------------------------------------------------------- evaluation and logging
    def window_nll(self, batch: Any, stage: str) -> tuple[Tensor, Tensor]:
        """Summed nats over a window's predicted units and how many there were, carrying ``stage``'s state."""
        raise NotImplementedError

    def log_epoch_figures(self, stage: str, loss: Tensor) -> None:
        """Log what ``stage``'s mean nats per unit ``loss`` mean for this kind of data (perplexity, per note, ...)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: Any, stage: str) -> None:
        total, count = self.window_nll(batch, stage)
        if count > 0:
            self.metrics[f"{stage}_nll"].update(total / count, weight=count)

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def _log_epoch(self, stage: str) -> None:
        """Log the stage's mean nats per unit (``val_loss`` is what ``best.ckpt`` keeps), then its figures."""
        metric = self.metrics[f"{stage}_nll"]
        if metric.weight == 0:  # nothing seen (e.g. no validation batches)
            return
        loss = metric.compute()
        metric.reset()
        self.log(f"{stage}_loss_epoch" if stage == "train" else f"{stage}_loss", loss)
        self.log_epoch_figures(stage, loss)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, in one line, a checkpoint whose tensors have other shapes than this module's; keep what it holds
        for resuming ``fit`` until training starts (evaluation never uses it, older checkpoints lack it).

        Raises:
            CheckpointError: e.g. ``--model.init_args.hidden_size`` changed on resume.
        """
        stored = checkpoint.get("state_dict", {})
        expected = self.state_dict()
        different = [name for name in stored if name in expected and stored[name].shape != expected[name].shape]
        if different:  # say so before Lightning's traceback
            name = different[0]
            raise CheckpointError(
                f"the checkpoint's {name} has shape {tuple(stored[name].shape)} but this model's is "
                f"{tuple(expected[name].shape)} ({len(different)} tensors differ): use the model settings it was "
                "trained with (its run's config.yaml), or start a new run without --ckpt_path"
            )
        self._resume = checkpoint.get(RESUME_KEY)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Never write non-finite weights (the previous checkpoint stays the last good one); add what an exact resume
        needs: the carried training state, the epoch's training-loss accumulator and the random number generators."""
        parameters = {name for name, _ in self.named_parameters(remove_duplicate=False)}  # not buffers
        bad = [
            name
            for weights in (checkpoint.get("state_dict", {}), checkpoint.get("current_model_state", {}))  # avg, live
            for name in non_finite({k: weights[k] for k in sorted(parameters & weights.keys())})
        ]
        if bad:
            raise TrainingDivergedError(
                f"the weights became NaN or infinite by step {self.global_step} (epoch {self.current_epoch}; "
                f"{', '.join(bad[:3])}), so no checkpoint was written: lower the learning rate or set "
                "--trainer.gradient_clip_val, then resume from the last checkpoint"
            )
        train_nll = self.metrics["train_nll"]
        checkpoint[RESUME_KEY] = {
            "train_state": self._state["train"],
            "train_nll": {"mean_value": train_nll.mean_value.detach(), "weight": train_nll.weight.detach()},
            "rng": rng_states(),
        }

    def on_train_start(self) -> None:
        """Resuming: put back the carried state, the loss accumulator and the generators saved with the checkpoint.

        Here, after Lightning's restore and the loader's first fetch, so the next dropout mask is the one the
        interrupted run would have drawn. (A checkpoint taken between epochs resets the state at the epoch start.)
        """
        resume, self._resume = self._resume, None
        if resume is None:
            return
        state = resume.get("train_state")
        self._state["train"] = None if state is None else tuple(s.to(self.device) for s in state)
        train_nll = self.metrics["train_nll"]
        for name, value in resume.get("train_nll", {}).items():
            setattr(train_nll, name, value.to(self.device))
        # An update that adds nothing: torchmetrics counts updates and warns when an epoch that resumes at its very
        # end (no window left) computes a restored accumulator without one.
        train_nll.update(torch.zeros((), device=self.device), weight=torch.zeros((), device=self.device))
        set_rng_states(resume["rng"])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Stop before the optimizer writes a diverged step into the weights: a training loss that is NaN, infinite
        or above ``divergence_threshold``, or a NaN or infinite gradient (a finite loss can still give one, e.g.
        through an overflowing cell). Both in one host copy, the training step's only synchronisation of its own.
        Gradients are not checked under a gradient scaler (16-bit mixed precision), which itself skips the steps whose
        scaled gradients overflowed."""
        loss = getattr(self, "_train_loss", None)
        trainer = self._trainer
        scaled = trainer is not None and getattr(trainer.precision_plugin, "scaler", None) is not None
        # A sum is NaN or infinite iff some element is (short of ~1e38 gradients), with no per-element temporary.
        sums = [] if scaled else [p.grad.sum(dtype=torch.float32) for p in self.parameters() if p.grad is not None]
        checked = ([loss.float()] if loss is not None else []) + ([torch.stack(sums).sum()] if sums else [])
        if not checked:
            return
        values = torch.stack(checked).tolist()  # one host copy
        if loss is not None:
            self._check_loss(values.pop(0))
        if values and not math.isfinite(values[0]):
            raise TrainingDivergedError(
                f"a gradient became NaN or infinite at step {self.global_step} (epoch {self.current_epoch}) with a "
                "finite loss; lower the learning rate or set --trainer.gradient_clip_val, then resume from the last "
                "checkpoint"
            )

    def _check_loss(self, value: float) -> None:
        if not math.isfinite(value) or 0 < self.divergence_threshold < value:
            limit = f" > model.init_args.divergence_threshold {self.divergence_threshold:.4g}" * math.isfinite(value)
            raise TrainingDivergedError(
                f"training loss became {value:.4g}{limit} at step {self.global_step} (epoch "
                f"{self.current_epoch}); lower the learning rate or set --trainer.gradient_clip_val, then resume from "
                "the last checkpoint"
            )
