"""Learning-rate schedules: each one's sequence against its paper's rule written out here.

Jozefowicz et al. 2015 §3.6 (halve after a plateau, four times, then stop; the music schedule: x0.8 after each
10 checks without improvement until the rate is below a floor), the GBW linear decay (Léonard 2016) and
reduce-on-plateau, each also configured from YAML through ``lm-zoo fit``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.optim.lr_scheduler import LinearLR
from torch.utils.data import DataLoader, TensorDataset

import cli
from lightning_modules import CosineDecay, DecayOnPlateau, HalveOnPlateau, LinearDecay
from tests.conftest import one_line_error, quiet_trainer, write_tiny_recipe, write_word_corpus


class LearningRates(Callback):
    """The learning rate of every optimizer step, the monitored loss of every check, and the steps taken."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.per_step: list[float] = []
        self.val_losses: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.per_step.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path:
            torch.save({"per_step": self.per_step, "val_losses": self.val_losses}, self.path)


# -------------------------------------------------------------------------------- Jozefowicz et al. 2015 §3.6
class Scripted(L.LightningModule):
    """A weight trained by SGD with a scripted validation loss, one check per epoch of two steps."""

    def __init__(self, val_losses: list[float], lr: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.val_losses, self.lr, self.checks = val_losses, lr, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return ((self.w - batch[0]) ** 2).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.checks += 1
        self.log("val_loss", self.val_losses[self.checks - 1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def jozefowicz_rates(val_losses: list[float], lr: float, patience: int = 3, halvings: int = 4) -> list[float]:
    """§3.6 written out: the learning rate of each epoch until training stops (one check per epoch)."""
    rates, best, bad, halved = [], float("inf"), 0, 0
    for loss in val_losses:
        rates.append(lr)  # this epoch trained at lr; its check decides the next epoch's
        if halved == halvings:
            return rates  # "for four additional epochs. Learning would then stop."
        if halved == 0:
            best, bad = (loss, 0) if loss < best else (best, bad + 1)
            if bad < patience:  # "no improvement in three consecutive epochs"
                continue
        halved += 1
        lr /= 2  # "lowering the learning rate by a factor of 2 at each epoch"
    return rates


def test_halve_on_plateau_follows_section_3_6(tmp_path: Path) -> None:
    # best 3.0 at epoch 3; epochs 4-6 do not beat it -> halve after epoch 6; the improvement at epoch 8 changes
    # nothing; the fourth halved epoch is 10, then training stops although max_epochs is 20.
    val_losses = [5.0, 4.0, 3.0, 3.5, 3.2, 3.0, 2.9, 1.0, 2.0, 2.0] + [9.0] * 10
    expected = jozefowicz_rates(val_losses, lr=0.8)
    assert expected == [0.8] * 6 + [0.4, 0.2, 0.1, 0.05]  # the rule's outcome on this script, by hand
    rates = LearningRates()
    trainer = quiet_trainer(max_epochs=20, callbacks=[HalveOnPlateau(), rates], num_sanity_val_steps=0)
    data = DataLoader(TensorDataset(torch.randn(2, 2)), batch_size=1)
    trainer.fit(Scripted(val_losses, lr=0.8), data, DataLoader(TensorDataset(torch.zeros(1, 2)), batch_size=1))
    per_epoch = rates.per_step[::2]
    assert per_epoch == pytest.approx(expected)
    assert rates.per_step[1::2] == rates.per_step[::2]  # constant within an epoch
    assert trainer.current_epoch == 10  # stopped after 10 epochs, not max_epochs


def test_halve_on_plateau_with_another_scheduler_is_refused(tmp_path: Path) -> None:
    class WithScheduler(Scripted):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
            return [optimizer], [LinearLR(optimizer)]

    trainer = L.Trainer(
        max_epochs=1, callbacks=[HalveOnPlateau()], logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    data = DataLoader(TensorDataset(torch.randn(2, 2)), batch_size=1)
    with pytest.raises(Exception, match="remove the config's lr_scheduler"):
        trainer.fit(WithScheduler([1.0], lr=0.1), data)


def music_rates(val_losses: list[float], lr: float, patience: int, factor: float, min_lr: float) -> list[float]:
    """§3.6's "MUSIC schedule for evaluation" written out: the learning rate of each epoch until training stops."""
    rates, best, bad = [], float("inf"), 0
    for loss in val_losses:
        rates.append(lr)
        if loss < best:
            best, bad = loss, 0
            continue
        bad += 1
        if bad == patience:  # "no improvement over 10 consecutive epochs"
            lr, bad = lr * factor, 0  # "reduced the learning rate by a factor of 0.8 ... reset the counter"
            if lr < min_lr:  # "We stopped learning once the learning rate became smaller than 10^-3"
                return rates
    return rates


def test_decay_on_plateau_follows_the_music_schedule(tmp_path: Path) -> None:
    # patience 2, factor 0.5, floor 0.15 from lr 0.8: best 3.0 at epoch 2; epochs 3-4 do not beat it -> 0.4; the
    # counter restarts: 2.5 at epoch 6 is a new best; epochs 7-8 not -> 0.2; 9-10 not -> 0.1 < 0.15: stop at 10.
    val_losses = [4.0, 3.0, 3.5, 3.0, 3.1, 2.5, 2.6, 2.5, 2.7, 2.8] + [9.0] * 10
    expected = music_rates(val_losses, lr=0.8, patience=2, factor=0.5, min_lr=0.15)
    assert expected == [0.8] * 4 + [0.4] * 4 + [0.2] * 2  # the rule's outcome on this script, by hand
    rates = LearningRates()
    callback = DecayOnPlateau(patience=2, factor=0.5, min_lr=0.15)
    trainer = quiet_trainer(max_epochs=20, callbacks=[callback, rates], num_sanity_val_steps=0)
    data = DataLoader(TensorDataset(torch.randn(2, 2)), batch_size=1)
    trainer.fit(Scripted(val_losses, lr=0.8), data, DataLoader(TensorDataset(torch.zeros(1, 2)), batch_size=1))
    assert rates.per_step[::2] == pytest.approx(expected)
    assert rates.per_step[1::2] == rates.per_step[::2]  # constant within an epoch
    assert trainer.current_epoch == 10  # stopped by the floor, not max_epochs
    assert callback.state_dict() == {"best": 2.5, "checks_without_improvement": 0, "reductions": 3}


@pytest.mark.parametrize("options", [{"patience": 0}, {"factor": 1.0}, {"min_lr": 0.0}])
def test_decay_on_plateau_refuses_settings_that_cannot_work(options: dict[str, Any]) -> None:
    with pytest.raises(Exception, match="must be"):
        DecayOnPlateau(**options)


# --------------------------------------------------------------------------------- the GBW recipe's linear decay
def gbw_rates(startlr: float, minlr: float, saturate: int, epochs: int) -> list[float]:
    """Element-Research/rnn noise-contrastive-estimate.lua: after each epoch
    ``lr = max(minlr, lr + (minlr - startlr) / saturate)``; the rate of each epoch."""
    rates, lr = [], startlr
    for _ in range(epochs):
        rates.append(lr)
        lr = max(minlr, lr + (minlr - startlr) / saturate)
    return rates


@pytest.mark.parametrize(("startlr", "minlr", "saturate"), [(1.0, 0.001, 300), (0.7, 0.001, 300), (0.05, 1e-5, 400)])
def test_linear_lr_per_epoch_is_the_gbw_recipe(startlr: float, minlr: float, saturate: int) -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=startlr)
    schedule = LinearLR(optimizer, start_factor=1.0, end_factor=minlr / startlr, total_iters=saturate)
    rates = []
    for _ in range(saturate + 20):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx(gbw_rates(startlr, minlr, saturate, saturate + 20), rel=1e-9, abs=1e-12)


def write_recipe(
    tmp_path: Path, max_epochs: int, steps: int, lr: float, lr_scheduler: str = "", callbacks: str = ""
) -> Path:
    """The tiny fit under ``tmp_path`` recording its learning rates (``rates.pt``), 3 validation batches a check;
    ``lr_scheduler`` a YAML section, ``callbacks`` YAML list items after the recorder."""
    corpus = write_word_corpus(tmp_path / "corpus", "schedules")
    recorder = {"class_path": "tests.test_schedules.LearningRates", "init_args": {"path": "{root}/rates.pt"}}
    trainer = {
        "max_epochs": max_epochs,
        "limit_train_batches": steps,
        "limit_val_batches": 3,
        "num_sanity_val_steps": 0,
        "callbacks": [recorder, *(yaml.safe_load(callbacks) or [])],
    }
    sections = {"trainer": trainer, "optimizer": {"init_args": {"lr": lr}}, **(yaml.safe_load(lr_scheduler) or {})}
    return write_tiny_recipe(tmp_path / "run.yaml", corpus, tmp_path, **sections)


def fit_tiny(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    max_epochs: int,
    steps: int,
    lr: float,
    lr_scheduler: str = "",
    callbacks: str = "",
) -> dict[str, list[float]]:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    config = write_recipe(tmp_path, max_epochs, steps, lr, lr_scheduler, callbacks)
    assert cli.main(["fit", "--config", str(config)]) == 0
    return torch.load(tmp_path / "rates.pt")


def test_linear_decay_per_step_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The GBW recipe scaled down: lr 1 -> 0.001 over saturate = 3 "epochs" of 2 optimizer steps each.
    scheduler = """lr_scheduler:
  class_path: lightning_modules.LinearDecay
  init_args: {end_factor: 0.001, total_iters: 3, interval: step, frequency: 2}"""
    record = fit_tiny(tmp_path, monkeypatch, max_epochs=1, steps=10, lr=1.0, lr_scheduler=scheduler)
    expected = [rate for rate in gbw_rates(1.0, 0.001, 3, 5) for _ in range(2)]  # each "epoch" is 2 steps
    assert expected[:8] == pytest.approx([1.0, 1.0, 0.667, 0.667, 0.334, 0.334, 0.001, 0.001])
    assert record["per_step"] == pytest.approx(expected, rel=1e-6)


def test_cosine_decay_per_step_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One cosine from lr 1 to 0.1 over the run's 10 optimizer steps: the rate of step t (0-based) is
    # eta_min + (lr - eta_min) (1 + cos(pi t / T_max)) / 2, not a stair per epoch.
    scheduler = """lr_scheduler:
  class_path: lightning_modules.CosineDecay
  init_args: {T_max: 10, eta_min: 0.1, interval: step}"""
    record = fit_tiny(tmp_path, monkeypatch, max_epochs=1, steps=10, lr=1.0, lr_scheduler=scheduler)
    expected = [0.1 + 0.9 * (1 + math.cos(math.pi * t / 10)) / 2 for t in range(10)]
    assert record["per_step"] == pytest.approx(expected, rel=1e-6)


def test_reduce_on_plateau_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = """lr_scheduler:
  class_path: lightning.pytorch.cli.ReduceLROnPlateau
  init_args: {monitor: val_loss, factor: 0.5, patience: 0, threshold: 0.0}"""
    record = fit_tiny(tmp_path, monkeypatch, max_epochs=6, steps=2, lr=4.0, lr_scheduler=scheduler)
    losses, per_epoch = record["val_losses"], record["per_step"][::2]
    # torch's rule with threshold 0 and patience 0: after each epoch's check, lr *= factor unless the loss is a
    # strict new best.
    expected, lr, best = [], 4.0, float("inf")
    for loss in losses:
        expected.append(lr)
        best, lr = (loss, lr) if loss < best else (best, lr * 0.5)
    assert per_epoch == pytest.approx(expected)
    assert min(per_epoch) < 4.0, losses  # the run did reach a plateau, so the rule was exercised


def test_torch_reduce_on_plateau_without_monitor_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    scheduler = "lr_scheduler:\n  class_path: torch.optim.lr_scheduler.ReduceLROnPlateau"
    config = write_recipe(tmp_path, max_epochs=1, steps=2, lr=1.0, lr_scheduler=scheduler)
    one_line_error(capsys, cli.main(["fit", "--config", str(config)]), "lightning.pytorch.cli.ReduceLROnPlateau")


def test_halve_on_plateau_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    callback = """    - class_path: lightning_modules.HalveOnPlateau
      init_args: {patience: 1}"""
    record = fit_tiny(tmp_path, monkeypatch, max_epochs=12, steps=2, lr=4.0, callbacks=callback)
    per_epoch = record["per_step"][::2]
    expected = jozefowicz_rates(record["val_losses"], lr=4.0, patience=1)
    assert per_epoch == pytest.approx(expected)
    assert per_epoch[-1] == pytest.approx(4.0 / 16) and len(per_epoch) < 12  # four halvings, then it stopped


def test_linear_and_cosine_decay_reject_an_unknown_interval() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(Exception, match="interval must be"):
        LinearDecay(optimizer, end_factor=0.1, total_iters=3, interval="batch")  # type: ignore[arg-type]
    with pytest.raises(Exception, match="frequency must be"):
        CosineDecay(optimizer, T_max=3, interval="step", frequency=0)
