"""Learning-rate schedules from the papers, usable from YAML.

LightningCLI builds ``lr_scheduler: {class_path: ..., init_args: ...}`` with the optimizer as first argument and steps
it once per epoch (:class:`ZarembaDecay`, ``torch.optim.lr_scheduler.LinearLR``), or, for :class:`LinearDecay` and
:class:`CosineDecay`, at the ``interval`` / ``frequency`` it names (:func:`scheduler_config`). Reduce-on-plateau is
Lightning's ``lightning.pytorch.cli.ReduceLROnPlateau`` (torch's, plus the ``monitor`` Lightning needs). Jozefowicz
et al.'s halve-then-stop schedule must stop the trainer, so it is a callback (:class:`HalveOnPlateau`, under
``trainer.callbacks``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, LRScheduler, ReduceLROnPlateau

from zoo.errors import ConfigError


class ZarembaDecay(LambdaLR):
    """Constant for ``constant_epochs`` epochs, then multiplied by ``decay`` every epoch (Zaremba et al. 2014).

    The learning rate of 0-based epoch ``e`` is ``lr * decay ** max(e + 1 - constant_epochs, 0)``: the "max-epoch"
    schedule that Jozefowicz et al. 2015 §3.6 also use for PTB (max-epoch in {4, 7, 11}, decay in {0.5, 0.65, 0.8}).

    Args:
        optimizer: the optimizer.
        constant_epochs: epochs at the initial learning rate ("max_epoch" in Zaremba's code).
        decay: factor per epoch after that.
        last_epoch: for resuming.
    """

    def __init__(
        self, optimizer: Optimizer, constant_epochs: int = 4, decay: float = 0.5, last_epoch: int = -1
    ) -> None:
        if not 0 < decay <= 1:
            raise ConfigError(f"ZarembaDecay's decay must be in (0, 1], got {decay}")
        self.constant_epochs = constant_epochs
        self.decay = decay
        super().__init__(optimizer, self._factor, last_epoch)

    def _factor(self, epoch: int) -> float:
        return self.decay ** max(epoch + 1 - self.constant_epochs, 0)


class LinearDecay(LinearLR):
    """``torch.optim.lr_scheduler.LinearLR`` that also says how often Lightning steps it: the GBW recipe.

    Léonard 2016 ("Language modeling a billion words"; Element-Research/rnn ``noise-contrastive-estimate.lua``) starts
    at ``startlr`` and after every "epoch" adds ``(minlr - startlr) / saturate``, clamped at ``minlr``: 1 -> 0.001 over
    ``saturate = 300`` epochs, where an epoch is ``--trainsize 400000`` time steps of ``--seqlen 50``, i.e. 8,000
    batches, not a pass over the corpus. ``LinearLR(start_factor=1, end_factor=minlr / startlr, total_iters=saturate)``
    is exactly that sequence; what LightningCLI's ``lr_scheduler`` cannot say is "step it every 8,000 batches", which
    ``interval`` and ``frequency`` do here (``lm-zoo fit`` passes them to Lightning's scheduler config). With
    ``interval: epoch`` (the default) it is plain ``LinearLR``, which YAML can name directly.

    Args:
        optimizer: the optimizer.
        end_factor: the last learning rate as a fraction of the initial one (``minlr / startlr``).
        total_iters: scheduler steps to get there (``saturate``).
        start_factor: the first learning rate as a fraction of the optimizer's.
        interval: ``"epoch"`` or ``"step"`` (optimizer steps).
        frequency: step the schedule every this many intervals.
        last_epoch: for resuming.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        end_factor: float,
        total_iters: int,
        start_factor: float = 1.0,
        interval: Literal["epoch", "step"] = "epoch",
        frequency: int = 1,
        last_epoch: int = -1,
    ) -> None:
        self.interval, self.frequency = _stepping(interval, frequency)
        super().__init__(optimizer, start_factor, end_factor, total_iters, last_epoch)


class CosineDecay(CosineAnnealingLR):
    """``torch.optim.lr_scheduler.CosineAnnealingLR`` that also says how often Lightning steps it.

    LightningCLI steps a YAML-named scheduler once per epoch, so a cosine over a run of a few epochs falls in a few
    coarse stairs; ``interval: step`` with ``T_max`` = the run's optimizer steps gives the smooth curve (the CPU-scale
    Mogrifier comparisons, configs/ptb-char/mogrifier-cpu.yaml).

    Args:
        optimizer: the optimizer.
        T_max: scheduler steps from the initial learning rate down to ``eta_min``.
        eta_min: the last learning rate.
        interval: ``"epoch"`` or ``"step"`` (optimizer steps).
        frequency: step the schedule every this many intervals.
        last_epoch: for resuming.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        T_max: int,  # noqa: N803 (torch's name, so a config can switch class_path and keep its init_args)
        eta_min: float = 0.0,
        interval: Literal["epoch", "step"] = "epoch",
        frequency: int = 1,
        last_epoch: int = -1,
    ) -> None:
        self.interval, self.frequency = _stepping(interval, frequency)
        super().__init__(optimizer, T_max, eta_min, last_epoch)


def _stepping(interval: str, frequency: int) -> tuple[str, int]:
    """The checked ``interval`` and ``frequency`` that :func:`scheduler_config` hands Lightning."""
    if interval not in ("epoch", "step"):
        raise ConfigError(f"interval must be 'epoch' or 'step', got {interval!r}")
    if frequency < 1:
        raise ConfigError(f"frequency must be at least 1, got {frequency}")
    return interval, frequency


def scheduler_config(optimizer: Optimizer, lr_scheduler: LRScheduler | ReduceLROnPlateau | None) -> Any:
    """What ``configure_optimizers`` returns for the YAML's ``optimizer`` and ``lr_scheduler``.

    LightningCLI's own version passes ``monitor`` for ``lightning.pytorch.cli.ReduceLROnPlateau`` and nothing else;
    this one also passes a scheduler's ``interval`` / ``frequency`` attributes (:class:`LinearDecay`,
    :class:`CosineDecay`), and turns torch's ``ReduceLROnPlateau``, which has no ``monitor`` and which Lightning then
    rejects with a long message, into one line saying what to write instead.
    """
    if lr_scheduler is None:
        return optimizer
    config: dict[str, Any] = {"scheduler": lr_scheduler}
    if isinstance(lr_scheduler, ReduceLROnPlateau):
        if not getattr(lr_scheduler, "monitor", None):
            raise ConfigError(
                "lr_scheduler ReduceLROnPlateau needs the metric to watch: use class_path "
                "lightning.pytorch.cli.ReduceLROnPlateau with init_args.monitor: val_loss"
            )
        config["monitor"] = lr_scheduler.monitor
    for key in ("interval", "frequency"):
        if hasattr(lr_scheduler, key):
            config[key] = getattr(lr_scheduler, key)
    return {"optimizer": optimizer, "lr_scheduler": config}


class _OwnPlateauSchedule(Callback):
    """What the papers' plateau schedules share as callbacks: they own the learning rate (a config that also sets
    ``lr_scheduler`` is refused), read the monitored validation figure after each check of ``fit``, multiply every
    parameter group's rate, and save their counters in the checkpoint (``_STATE``) so a resumed run goes on."""

    _STATE: tuple[str, ...] = ("best", "checks_without_improvement")

    def __init__(self, monitor: str, patience: int, factor: float) -> None:
        if patience < 1:
            raise ConfigError(f"patience must be at least 1, got {patience}")
        if not 0 < factor < 1:
            raise ConfigError(f"factor must be in (0, 1), got {factor}")
        self.monitor, self.patience, self.factor = monitor, patience, factor
        self.best = math.inf
        self.checks_without_improvement = 0

    def plateaued(self, value: float) -> bool:
        """Count ``value`` against the best so far: whether ``patience`` checks in a row have not beaten it."""
        if value < self.best:
            self.best, self.checks_without_improvement = value, 0
            return False
        self.checks_without_improvement += 1
        return self.checks_without_improvement >= self.patience

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.lr_scheduler_configs:
            raise ConfigError(f"{type(self).__name__} sets the learning rate itself: remove the config's lr_scheduler")

    def checked_value(self, trainer: L.Trainer) -> float | None:
        """The monitored figure of a training validation check; ``None`` outside ``fit`` and for the sanity check."""
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return None
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise ConfigError(f"{type(self).__name__} monitors {self.monitor!r}, which validation did not log")
        return float(value)

    def multiply_learning_rate(self, trainer: L.Trainer, factor: float) -> list[float]:
        """Every parameter group's learning rate times ``factor``, said in one log line; the new rates."""
        rates = []
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
                rates.append(group["lr"])
        shown = ", ".join(f"{rate:.4g}" for rate in rates)
        rank_zero_info(f"{type(self).__name__}: learning rate x {factor} -> {shown} (step {trainer.global_step})")
        return rates

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._STATE}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name in self._STATE:
            setattr(self, name, state_dict[name])


class HalveOnPlateau(_OwnPlateauSchedule):
    """Jozefowicz et al. 2015 §3.6, the "schedule for architecture search": halve the learning rate once validation
    has not improved for ``patience`` checks, and again at each check after that, ``decays`` times in all; stop after
    the check that ends the last halved period.

    The paper: "If we would observe no improvement in three consecutive epochs on the validation set, we would start
    lowering the learning rate by a factor of 2 at each epoch, for four additional epochs. Learning would then stop."
    With a validation check per epoch (Lightning's default) the learning rate of epochs ``1 .. t`` is ``lr``, where
    check ``t`` is the third in a row without a strict improvement, then ``lr/2, lr/4, lr/8, lr/16`` for epochs
    ``t+1 .. t+4``, and training stops at check ``t+4`` (improvements during the halving change nothing). With
    ``val_check_interval`` every check counts as an "epoch".

    It is a callback, not an ``lr_scheduler``, because stopping needs the trainer; it owns the learning rate, so a
    config that also sets ``lr_scheduler`` is refused.

    Args:
        monitor: the logged validation metric (lower is better).
        patience: checks without improvement before the first halving (3).
        factor: the multiplier (0.5).
        decays: halvings before stopping (4).
    """

    _STATE = (*_OwnPlateauSchedule._STATE, "decays_done")

    def __init__(self, monitor: str = "val_loss", patience: int = 3, factor: float = 0.5, decays: int = 4) -> None:
        if decays < 1:
            raise ConfigError(f"decays must be at least 1, got {decays}")
        super().__init__(monitor, patience, factor)
        self.decays = decays
        self.decays_done = 0

    def step(self, value: float) -> Literal["keep", "halve", "stop"]:
        """Count one check's ``value`` (lower is better): keep the rate, halve it (``factor``), or stop training.

        Needs no trainer, so a plain training loop (the architecture search's, :mod:`search.tasks`)
        follows the same schedule as ``fit``.
        """
        if self.decays_done == 0:  # waiting for the plateau
            if not self.plateaued(value):
                return "keep"
        elif self.decays_done == self.decays:  # the last halved period is over
            return "stop"
        self.decays_done += 1
        return "halve"

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = self.checked_value(trainer)
        if value is None:
            return
        action = self.step(value)
        if action == "stop":
            rank_zero_info(f"HalveOnPlateau: stopping after {self.decays} halvings (step {trainer.global_step})")
            trainer.should_stop = True
        elif action == "halve":
            self.multiply_learning_rate(trainer, self.factor)


class DecayOnPlateau(_OwnPlateauSchedule):
    """Jozefowicz et al. 2015 §3.6, the "MUSIC schedule for evaluation": multiply the learning rate by ``factor`` after
    ``patience`` consecutive checks without a validation improvement, start counting afresh, and stop training once
    the learning rate falls below ``min_lr``.

    The paper: "If we observed no improvement over 10 consecutive epochs, we reduced the learning rate by a factor of
    0.8. We would then 'reset the counter' [...] We stopped learning once the learning rate became smaller than 10^-3,
    or when learning would progress beyond 800 epochs" (the 800 is ``trainer.max_epochs``). The best value is kept
    across reductions, so a check counts as an improvement only if it beats every check before it.

    torch's ``ReduceLROnPlateau`` decays the same way (its ``patience`` is one less: it reduces when the count
    *exceeds* it), but stopping needs the trainer, and Lightning steps schedulers after the epoch-end hooks, too late
    for a callback to see the new rate in the same epoch; so, like :class:`HalveOnPlateau`, this callback owns the
    learning rate and a config that also sets ``lr_scheduler`` is refused.

    Args:
        monitor: the logged validation metric (lower is better).
        patience: consecutive checks without improvement before each reduction (10).
        factor: the multiplier (0.8).
        min_lr: stop after the check whose reduction takes the learning rate below this (the paper's 10^-3, times
            the factor by which the config's learning rate was scaled, e.g. x35 for a per-step mean loss).
    """

    _STATE = (*_OwnPlateauSchedule._STATE, "reductions")

    def __init__(
        self, monitor: str = "val_loss", patience: int = 10, factor: float = 0.8, min_lr: float = 1e-3
    ) -> None:
        if min_lr <= 0:
            raise ConfigError(f"min_lr must be > 0, got {min_lr}")
        super().__init__(monitor, patience, factor)
        self.min_lr = min_lr
        self.reductions = 0

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = self.checked_value(trainer)
        if value is None or not self.plateaued(value):
            return
        self.checks_without_improvement = 0  # "reset the counter"
        self.reductions += 1
        if max(self.multiply_learning_rate(trainer, self.factor)) < self.min_lr:
            rank_zero_info(f"DecayOnPlateau: stopping, the learning rate is below {self.min_lr:g}")
            trainer.should_stop = True
