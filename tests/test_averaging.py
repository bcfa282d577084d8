"""Weight averaging switched on at a plateau (Melis et al. 2020 §3.3) or by NT-ASGD's rule (Merity et al. 2017).

The trigger rules against sequences worked out by hand; a scripted-loss module through a real Trainer (the switch
happens at the right check, at 80% at the latest, validation sees the live weights before and the average after);
and a real tiny LanguageModel through ``lm-zoo fit`` whose saved checkpoint must be the plain mean of the weights
recorded after every step from the switch on.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, Timer
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import cli
from lightning_modules.averaging import WeightAveragingOnPlateau, non_monotonic, patience_exhausted
from tests.conftest import write_tiny_recipe, write_word_corpus


def first_trigger(rule, history: list[float], n: int) -> int | None:
    """The 1-based check at which ``rule`` first fires on the growing history."""
    return next((k for k in range(1, len(history) + 1) if rule(history[:k], n)), None)


# ------------------------------------------------------------------------------------------- the rules by hand
def test_patience_counts_checks_since_the_best() -> None:
    # best 1.0 at check 3; checks 4, 5, 6 do not go below it (6 ties it: not an improvement) -> fires at check 6.
    history = [3.0, 2.0, 1.0, 1.5, 1.2, 1.0, 0.5]
    assert first_trigger(patience_exhausted, history, 3) == 6
    assert first_trigger(patience_exhausted, history, 4) is None  # check 7 improves before a 4th bad check
    # an improvement restarts the count: best 0.9 at check 5, then 3 checks above it -> check 8.
    assert first_trigger(patience_exhausted, [3.0, 2.0, 1.0, 1.5, 0.9, 1.0, 1.0, 0.95], 3) == 8
    assert first_trigger(patience_exhausted, [5.0, 4.0, 3.0, 2.0, 1.0], 1) is None  # always improving


def test_nt_asgd_compares_with_the_best_of_the_older_checks() -> None:
    # AWD-LSTM, nonmono = 2, at check k: more than 2 earlier checks and loss_k > min(loss_1 .. loss_{k-3}).
    history = [5.0, 4.0, 3.0, 2.0, 2.5, 3.5, 2.1]
    # k=4: 2 > min(5) no; k=5: 2.5 > min(5, 4) no; k=6: 3.5 > min(5, 4, 3) = 3 yes.
    assert first_trigger(non_monotonic, history, 2) == 6
    # with nonmono = 5 the first candidate is check 7: 2.1 > min(5) no -> never on this history.
    assert first_trigger(non_monotonic, history, 5) is None
    # a worse loss right away does not count before nonmono + 1 earlier checks exist.
    assert first_trigger(non_monotonic, [1.0, 9.0, 9.0, 9.0], 2) == 4
    # patience on the same history fires one check later than NT-ASGD here (best 2.0 at check 4; 5, 6, 7 above).
    assert first_trigger(patience_exhausted, history, 3) == 7


def test_bad_options_are_one_line_errors() -> None:
    with pytest.raises(Exception, match="trigger must be"):
        WeightAveragingOnPlateau(trigger="asgd")  # type: ignore[arg-type]
    with pytest.raises(Exception, match="start_fraction"):
        WeightAveragingOnPlateau(start_fraction=1.5)
    with pytest.raises(Exception, match="at least 1"):
        WeightAveragingOnPlateau(patience=0)


# ------------------------------------------------------------------------------- a scripted run through Trainer
class Scripted(L.LightningModule):
    """One weight vector pulled by SGD towards random targets (every step moves it), logging a scripted val_loss."""

    def __init__(self, val_losses: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))
        self.val_losses = val_losses
        self.seen_at_validation: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return ((self.w - batch[0]) ** 2).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen_at_validation.append(self.w.detach().clone())  # the weights validation runs with
        self.log("val_loss", self.val_losses[len(self.seen_at_validation) - 1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3)


class Unsized(IterableDataset):
    """Two batches per epoch with no ``__len__`` (like ``variable_bptt`` streams)."""

    def __iter__(self):
        yield from torch.randn(2, 1, 3).unbind(0)


class Iterates(Callback):
    """The live weights after every optimizer step (index i: after step i + 1)."""

    def __init__(self) -> None:
        self.after_step: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.after_step.append(pl_module.w.detach().clone())


def fit_scripted(
    tmp_path: Path, val_losses: list[float], averaging: WeightAveragingOnPlateau, unsized: bool = False, **bounds: int
) -> tuple[Scripted, Iterates, Path]:
    """Two steps per epoch, one validation check per epoch; every check's checkpoint is kept."""
    L.seed_everything(0)
    model, iterates = Scripted(val_losses), Iterates()
    train = Unsized() if unsized else TensorDataset(torch.randn(2, 3))
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, save_last=True)
    trainer = L.Trainer(
        callbacks=[averaging, iterates, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **bounds,
    )
    loader = DataLoader(train, batch_size=None if unsized else 1)
    trainer.fit(model, loader, DataLoader(TensorDataset(torch.zeros(1, 3)), batch_size=1))
    return model, iterates, tmp_path


def mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).double().mean(0).float()


@pytest.mark.parametrize(
    ("trigger", "option", "switch_check"),
    [("patience", {"patience": 3}, 7), ("nt-asgd", {"nonmono": 2}, 6)],
)
def test_switches_on_at_the_right_check(
    tmp_path: Path, trigger: str, option: dict[str, int], switch_check: int
) -> None:
    val_losses = [5.0, 4.0, 3.0, 2.0, 2.5, 3.5, 2.1, 2.2, 2.3, 2.4]  # the NT-ASGD history above, then 3 more checks
    averaging = WeightAveragingOnPlateau(trigger=trigger, start_fraction=None, **option)  # type: ignore[arg-type]
    model, iterates, ckpts = fit_scripted(tmp_path, val_losses, averaging, max_epochs=10)
    switch_step = 2 * switch_check  # two steps per epoch, a check at the end of each
    assert averaging.switched_on_at_step == switch_step
    assert averaging.history == pytest.approx(val_losses)
    after = iterates.after_step  # after[i]: the weights after step i + 1
    for check, seen in enumerate(model.seen_at_validation, start=1):
        step = 2 * check
        if check <= switch_check:  # the live weights (Lightning 2.6 alone would show the initial zeros here)
            torch.testing.assert_close(seen, after[step - 1], rtol=0, atol=0)
        else:  # the plain mean of the weights after steps switch_step + 1 .. step
            torch.testing.assert_close(seen, mean(after[switch_step:step]))
    torch.testing.assert_close(model.w.detach(), mean(after[switch_step:]))  # fit ends with the average
    # Checkpoints: plain live weights before the switch; after it, the average with the live weights beside it.
    before = torch.load(ckpts / f"step={switch_step}.ckpt", weights_only=False)
    assert "current_model_state" not in before
    torch.testing.assert_close(before["state_dict"]["w"], after[switch_step - 1], rtol=0, atol=0)
    last = torch.load(ckpts / "last.ckpt", weights_only=False)
    torch.testing.assert_close(last["state_dict"]["w"], mean(after[switch_step:]))
    torch.testing.assert_close(last["current_model_state"]["w"], after[-1], rtol=0, atol=0)
    assert last["callbacks"]["WeightAveragingOnPlateau"]["switched_on_at_step"] == switch_step


def test_checks_every_n_steps_across_epochs_count_as_lambs_turns(tmp_path: Path) -> None:
    """lamb validates every 200 steps (a "turn") whatever the epoch length, and its averaging trigger counts turns: the
    Melis recipes set ``val_check_interval: 200`` with ``check_val_every_n_epoch: null``. Here a check every 3 steps of
    2-step epochs, patience 2: the switch comes at the 4th check, step 12, and later checks see the mean from there."""
    val_losses = [5.0, 4.0, 4.5, 4.6, 4.7, 4.8]
    averaging = WeightAveragingOnPlateau(patience=2, start_fraction=None)
    model, iterates, _ = fit_scripted(
        tmp_path, val_losses, averaging, max_steps=18, val_check_interval=3, check_val_every_n_epoch=None
    )
    assert averaging.history == pytest.approx(val_losses)  # a check at steps 3, 6, ..., 18, across epoch ends
    assert averaging.switched_on_at_step == 12
    after = iterates.after_step
    torch.testing.assert_close(model.seen_at_validation[3], after[11], rtol=0, atol=0)
    torch.testing.assert_close(model.seen_at_validation[4], mean(after[12:15]))
    torch.testing.assert_close(model.seen_at_validation[5], mean(after[12:18]))


@pytest.mark.parametrize(
    ("bounds", "unsized"),
    [({"max_steps": 10}, False), ({"max_epochs": 5}, False), ({"max_epochs": 5}, True)],
    ids=["max_steps", "max_epochs", "max_epochs-unknown-epoch-length"],
)
def test_switches_on_at_80_percent_at_the_latest(tmp_path: Path, bounds: dict[str, int], unsized: bool) -> None:
    improving = [5.0 - k for k in range(5)]  # never a plateau
    averaging = WeightAveragingOnPlateau(patience=2, start_fraction=0.8)
    model, iterates, _ = fit_scripted(tmp_path, improving, averaging, unsized=unsized, **bounds)
    # 10 steps in all: on after step floor(0.8 * 10) = 8 (with an unknown epoch length: at the start of epoch
    # floor(0.8 * 5) = 4, also after step 8); the average holds the weights after steps 9 and 10.
    assert averaging.switched_on_at_step == 8
    assert "80%" in averaging.switch_reason
    assert len(iterates.after_step) == 10
    torch.testing.assert_close(model.w.detach(), mean(iterates.after_step[8:]))


class Clock(Callback):
    """The train stage's elapsed time (Lightning's Timer) at every validation check's end, read where this callback
    stands among the callbacks."""

    def __init__(self) -> None:
        self.elapsed: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        time.sleep(0.05)  # every step takes time, so that a time budget ends the run after some 15 of them

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
        self.elapsed.append(timer.time_elapsed("train"))


def test_a_run_bounded_by_time_switches_on_at_that_fraction_of_its_time(tmp_path: Path) -> None:
    """lamb's "at 80% of the training time at the latest", for a run that --trainer.max_time ends (a GPU's minutes):
    on at the first validation check past the fraction of the time (a check after every step here, where no step
    pays for the ranks' agreement); its epochs (1,000) would end far later."""
    L.seed_everything(0)
    model, iterates = Scripted([5.0 - k for k in range(10_000)]), Iterates()  # always improving: never a plateau
    averaging = WeightAveragingOnPlateau(patience=2, start_fraction=0.5)
    before, after = Clock(), Clock()  # the clock read just before and just after the callback decides
    trainer = L.Trainer(
        callbacks=[before, averaging, iterates, after],
        max_epochs=1000,
        max_time=timedelta(seconds=1.5),
        val_check_interval=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(TensorDataset(torch.randn(2, 3)), batch_size=1)
    trainer.fit(model, loader, DataLoader(TensorDataset(torch.zeros(1, 3)), batch_size=1))
    switch = averaging.switched_on_at_step
    assert switch is not None and "50% of the run's time" in averaging.switch_reason, averaging.switch_reason
    steps = len(iterates.after_step)
    assert 1 < switch < steps < 2000  # the time ended the run, and averaging had begun before
    half = 0.75  # seconds
    # The check after step `switch` (index switch - 1) is the first that ended past half the time; the one before not.
    assert after.elapsed[switch - 1] >= half > before.elapsed[switch - 2]
    torch.testing.assert_close(model.w.detach(), mean(iterates.after_step[switch:]))


# ----------------------------------------------------------------- a real LanguageModel through `lm-zoo fit`
class RecordRun(Callback):
    """Saves the live weights after every optimizer step and the monitored loss of every validation check."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.after_step: list[dict[str, torch.Tensor]] = []
        self.val_losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.after_step.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save({"after_step": self.after_step, "val_losses": self.val_losses}, self.path)


def test_lm_zoo_fit_saves_the_uniform_average(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = write_word_corpus(tmp_path / "corpus", "averaging")
    callbacks = [
        {
            "class_path": "lightning_modules.WeightAveragingOnPlateau",
            "init_args": {"patience": 2, "start_fraction": None},
        },
        {"class_path": "tests.test_averaging.RecordRun", "init_args": {"path": "{root}/record.pt"}},
    ]
    trainer = {"max_epochs": 2, "val_check_interval": 2, "limit_val_batches": 4, "num_sanity_val_steps": 0}
    config = write_tiny_recipe(
        tmp_path / "run.yaml",
        corpus,
        tmp_path,
        seed_everything=3,
        trainer={**trainer, "callbacks": callbacks},
        model={"init_args": {"tie_weights": True}},
        optimizer={"init_args": {"lr": 3.0}},
    )
    assert cli.main(["fit", "--config", str(config)]) == 0

    record = torch.load(tmp_path / "record.pt", weights_only=False)
    after, history = record["after_step"], record["val_losses"]
    assert len(after) == 16 and len(history) == 8  # 2 epochs x 8 steps, a check every 2 steps
    # The switch happens at the check where 2 checks in a row fail to beat the best (the rule written out here).
    best, bad, switch_check = float("inf"), 0, None
    for check, loss in enumerate(history, start=1):
        best, bad = (loss, 0) if loss < best else (best, bad + 1)
        if bad == 2:
            switch_check = check
            break
    assert switch_check is not None and switch_check < len(history), f"no plateau in {history}"
    switch_step = 2 * switch_check

    # Lightning writes last.ckpt only at checks that also write a top-k one, so a checkpoint's step can be any check.
    saved_after_switch = 0
    for name in ("last.ckpt", "best.ckpt"):
        ckpt = torch.load(tmp_path / "checkpoints" / name, weights_only=False)
        state, step = ckpt["callbacks"]["WeightAveragingOnPlateau"], ckpt["global_step"]
        assert state["history"] == pytest.approx(history[: step // 2])
        weights = ckpt["state_dict"]
        assert set(weights) == set(after[0])
        if step <= switch_step:  # a plain checkpoint of the live weights
            assert state["switched_on_at_step"] is None and "current_model_state" not in ckpt
            for key in weights:
                torch.testing.assert_close(weights[key], after[step - 1][key], rtol=0, atol=0, msg=key)
            continue
        saved_after_switch += 1
        assert state["switched_on_at_step"] == switch_step, (history, state)
        for key in weights:  # the plain mean of the weights after steps switch_step + 1 .. step
            expected = torch.stack([it[key].double() for it in after[switch_step:step]]).mean(0)
            torch.testing.assert_close(weights[key].double(), expected, rtol=1e-5, atol=1e-6, msg=key)
            torch.testing.assert_close(ckpt["current_model_state"][key], after[step - 1][key], rtol=0, atol=0)
        # The tied embedding and decoder stay one tensor in the average.
        assert torch.equal(weights["model.embedding.weight"], weights["model.decoder.weight"])
    assert saved_after_switch > 0


def test_torch_asgd_is_sgd_with_the_mean_of_its_iterates_from_its_second_step() -> None:
    # What NT-ASGD switches to in AWD-LSTM: ASGD(t0=0, lambd=0) takes SGD's steps, and its average `ax` is the plain
    # mean of the iterates after steps 2..k (the callback's mean, checked above, starts at step 1).
    targets = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def run(optimizer: type[torch.optim.Optimizer], **options: float) -> tuple[list[torch.Tensor], Any]:
        w = nn.Parameter(torch.zeros(4))
        opt = optimizer([w], lr=0.1, **options)
        iterates = []
        for target in targets:
            opt.zero_grad()
            ((w - target) ** 2).sum().backward()
            opt.step()
            iterates.append(w.detach().clone())
        return iterates, opt.state[w]

    sgd, _ = run(torch.optim.SGD)
    asgd, state = run(torch.optim.ASGD, t0=0, lambd=0.0)
    torch.testing.assert_close(torch.stack(asgd), torch.stack(sgd))
    torch.testing.assert_close(state["ax"], mean(sgd[1:]))
