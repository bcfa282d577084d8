"""Weight averaging switched on when validation stops improving (Melis et al. 2020 §3.3; Merity et al. 2017's NT-ASGD).

Melis et al.: "We switch to averaging weights similarly to Merity et al. (2017) after a certain number of checkpoints
with no improvement in validation cross-entropy or at 80% of the training time at the latest." Their code (deepmind
lamb, ``training.py``) evaluates every "turn" (200 steps on PTB, about one epoch) and turns averaging on once
``turn - best_turn >= trigger_averaging_turns`` (50) or ``turn >= trigger_averaging_at_the_latest`` (800 of 1000);
from then on every optimisation step adds the new weights to an equal-weight running mean (``averaged.py``), and
evaluation and the saved model use that mean.

Merity et al. 2017 (AWD-LSTM ``main.py``) switch SGD to ``ASGD(t0=0, lambd=0)`` when
``len(history) > nonmono and val_loss > min(history[:-nonmono])`` (``history`` holding the earlier checks' losses),
i.e. when the loss is worse than the best of the checks older than ``nonmono``; ASGD with ``t0=0, lambd=0`` takes
plain SGD steps and keeps the equal-weight mean of the iterates from then on, which is what this callback keeps when
the optimizer is SGD -- except that torch's ASGD (then and now) starts its mean at its second step (its ``mu`` is 1
for two steps), this callback at the first step after the switch: one iterate in the mean, 1/k of it after k steps.

Both are Lightning's ``WeightAveraging`` (an equal-weight ``torch.optim.swa_utils.AveragedModel``, updated after
every optimizer step for which ``should_update`` says yes, swapped in for validation and written as the checkpoint's
``state_dict``) with a trigger. The subclass also fixes what ``WeightAveraging`` 2.6 does *before* its first update
(Lightning issue #21724, open): its ``AveragedModel`` is then the setup-time copy of the untrained model, and the base
class would validate that copy, save it as the checkpoint's weights and copy it over the trained model at the end of
fit. Here, until averaging is on, validation, checkpoints and the final model are the live weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import Timer, WeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_modules.lightning_private import averaged_model
from zoo.errors import ConfigError

Trigger = Literal["patience", "nt-asgd"]


def patience_exhausted(history: Sequence[float], patience: int) -> bool:
    """Whether the last ``patience`` checks all failed to improve on the best loss before them.

    The same as counting checks since the best one (lamb's ``turn - best_turn >= trigger_averaging_turns``): the best
    so far is ``min(history[:-patience])`` exactly when none of the last ``patience`` checks went below it.

    Args:
        history: the monitored loss of every validation check so far, oldest first (the latest last).
        patience: checks without a strict improvement that switch averaging on.
    """
    if len(history) <= patience:
        return False
    return min(history[-patience:]) >= min(history[:-patience])


def non_monotonic(history: Sequence[float], nonmono: int) -> bool:
    """Merity et al. 2017's NT-ASGD trigger: the latest loss is worse than the best of the checks before the last
    ``nonmono`` ones.

    AWD-LSTM tests ``len(best_val_loss) > nonmono and val_loss > min(best_val_loss[:-nonmono])`` before appending
    ``val_loss`` to ``best_val_loss`` (which, despite its name, holds every earlier check's loss).

    Args:
        history: the monitored loss of every validation check so far, oldest first (the latest last).
        nonmono: AWD-LSTM's ``--nonmono`` (5).
    """
    earlier, latest = history[:-1], history[-1] if history else math.nan
    return len(earlier) > nonmono and latest > min(earlier[:-nonmono])


class WeightAveragingOnPlateau(WeightAveraging):
    """An equal-weight average of the weights after every optimizer step from the moment validation stops improving,
    or from ``start_fraction`` of the run at the latest.

    Validation and checkpoints use the averaged weights once averaging is on (the live ones stay in the checkpoint as
    ``current_model_state`` for resuming), and the model holds them when ``fit`` ends. The switch is logged once
    (step and reason) and kept in ``switched_on_at_step`` (optimizer steps done at the switch: the average holds the
    weights after each later step) and ``switch_reason``.

    Args:
        monitor: the logged validation metric (lower is better).
        trigger: ``"patience"``: after ``patience`` validation checks without a strict improvement (Melis et al.
            2020, lamb's ``trigger_averaging_turns``); ``"nt-asgd"``: when the loss is worse than the best of the
            checks older than ``nonmono`` (Merity et al. 2017; with ``torch.optim.SGD`` this is their NT-ASGD).
        patience: checks without improvement for ``trigger: patience``.
        nonmono: Merity et al.'s non-monotone interval for ``trigger: nt-asgd``.
        start_fraction: switch on at this fraction of the run at the latest (0.8 in the paper; ``None``: never on
            this account). The run's length is the trainer's bound in optimizer steps (``max_steps``, or
            ``max_epochs`` times the batches per epoch, whichever ends first); when the epoch length is unknown
            (``variable_bptt``) it is ``max_steps`` if set, else ``max_epochs``, and averaging then starts with epoch
            ``floor(start_fraction * max_epochs)``. A run with ``max_time`` (lamb's "80% of the training time") also
            switches on at the first validation check past that fraction of its time, whichever mark comes first;
            rank 0's clock decides for every rank, as it does for Lightning's stop.
        device: where the average lives (default: the model's device); ``"cpu"`` saves accelerator memory.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        trigger: Trigger = "patience",
        patience: int = 5,
        nonmono: int = 5,
        start_fraction: float | None = 0.8,
        device: str | None = None,
    ) -> None:
        if trigger not in ("patience", "nt-asgd"):
            raise ConfigError(f"weight averaging trigger must be 'patience' or 'nt-asgd', got {trigger!r}")
        if patience < 1 or nonmono < 1:
            raise ConfigError(f"patience and nonmono must be at least 1, got {patience} and {nonmono}")
        if start_fraction is not None and not 0.0 <= start_fraction <= 1.0:
            raise ConfigError(f"start_fraction must be in [0, 1] (or null), got {start_fraction}")
        # No avg_fn: AveragedModel's default is the equal-weight running mean p_avg += (p - p_avg) / (n + 1).
        super().__init__(device=device, use_buffers=True)
        self.monitor = monitor
        self.trigger = trigger
        self.patience = patience
        self.nonmono = nonmono
        self.start_fraction = start_fraction
        self.history: list[float] = []
        self.switched_on_at_step: int | None = None
        self.switch_reason: str | None = None
        self._start_step: int | None = None  # averaging includes the weights after step start_step + 1 onwards
        self._start_epoch: int | None = None  # ... or from the first step of this epoch (epoch length unknown)
        self._epoch = 0
        self._trainer: L.Trainer | None = None
        self._timer: Timer | None = None

    @property
    def active(self) -> bool:
        """Whether averaging has been switched on."""
        return self.switched_on_at_step is not None

    @property
    def averaged(self) -> bool:
        """Whether the average holds at least one update (before that it is a stale copy of the initial model)."""
        average = averaged_model(self)
        return average is not None and int(average.n_averaged) > 0

    # ---------------------------------------------------------------------------------------------- the trigger
    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Average after every optimizer step once switched on; switch on here when the run reaches
        ``start_fraction``."""
        if step_idx is None:  # the base class also asks at epoch ends: the average is per step
            return False
        if not self.active and self._fraction_reached(step_idx + 1):
            # Detected after the first step past the mark, which is the first one averaged.
            self.switch_on(step_idx, f"{self.start_fraction:.0%} of the run")
        return self.active

    def _fraction_reached(self, steps_done: int) -> bool:
        if self._start_step is not None:
            return steps_done > self._start_step
        return self._start_epoch is not None and self._epoch >= self._start_epoch

    def _time_fraction_reached(self) -> bool:
        if self._timer is None or self._trainer is None or self.start_fraction is None:
            return False
        elapsed, remaining = self._timer.time_elapsed("train"), self._timer.time_remaining("train")
        reached = remaining is not None and elapsed >= self.start_fraction * (elapsed + remaining)
        # The clocks of the ranks differ; the average must start at the same step on all of them. Asked at validation
        # checks only (lamb checks its triggers at its turns too), so that no step pays for this collective.
        return bool(self._trainer.strategy.broadcast(reached))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        if self.start_fraction is None:
            return
        # Lightning's --trainer.max_time is a Timer callback it adds itself.
        self._timer = next(
            (c for c in trainer.callbacks if isinstance(c, Timer) and c.time_remaining() is not None), None
        )
        total = trainer.estimated_stepping_batches  # -1 (max_steps unset) when the epoch length is unknown
        if math.isfinite(total) and total >= 0:
            self._start_step = math.floor(self.start_fraction * total)
        elif trainer.max_epochs is not None and trainer.max_epochs > 0:
            self._start_epoch = math.floor(self.start_fraction * trainer.max_epochs)
        elif self._timer is None:
            rank_zero_info(
                f"weight averaging: the run has no max_steps, max_epochs or max_time, so start_fraction="
                f"{self.start_fraction} cannot apply; averaging starts only when validation stops improving"
            )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch = trainer.current_epoch

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Record the check's loss; switch on when the trigger fires (the next step is the first one averaged)."""
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            logged = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
            raise ConfigError(
                f"weight averaging monitors {self.monitor!r} but validation logged {logged}: set monitor to one of them"
            )
        self.history.append(float(value))
        if self.active:
            return
        step = trainer.global_step
        if self.trigger == "patience" and patience_exhausted(self.history, self.patience):
            self.switch_on(step, f"{self.patience} validation checks without improvement of {self.monitor}")
        elif self.trigger == "nt-asgd" and non_monotonic(self.history, self.nonmono):
            self.switch_on(step, f"{self.monitor} above the best of the checks older than {self.nonmono}")
        elif self._time_fraction_reached():
            self.switch_on(step, f"{self.start_fraction:.0%} of the run's time")

    def switch_on(self, steps_done: int, reason: str) -> None:
        """Switch on after ``steps_done`` optimizer steps: the weights after the next step are the first ones
        averaged, as after AWD-LSTM's switch to ASGD and lamb's ``set_averaging_triggered``."""
        self.switched_on_at_step, self.switch_reason = steps_done, reason
        rank_zero_info(f"weight averaging switched on after step {steps_done}: {reason}")
        trainer = self._trainer
        if trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics({"weight_averaging_switched_on": float(steps_done)}, step=steps_done)

    # ------------------------------------------------ the base class's hooks, guarded until the first update
    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # n_averaged cannot change during validation, so the swap back in on_validation_epoch_end is symmetric.
        if self.averaged:
            super().on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.averaged:
            super().on_validation_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.averaged:
            super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Before the first update the checkpoint is a plain one: the live weights, no averaging keys (so
        # checkpoints.load does not report it as averaged).
        if self.averaged:
            super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if "current_model_state" in checkpoint or averaged_model(self) is None:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
        # else: saved before averaging began; the average (n_averaged = 0) starts from whatever it holds at its first
        # update, so there is nothing to restore and nothing to warn about.

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "history": list(self.history),
            "switched_on_at_step": self.switched_on_at_step,
            "switch_reason": self.switch_reason,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.history = list(state_dict.get("history", []))
        self.switched_on_at_step = state_dict.get("switched_on_at_step")
        self.switch_reason = state_dict.get("switch_reason")
