"""``checkpoints.callbacks.InitialWeights``: a fresh fit starts from an export's weights, a resumed one from its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import checkpoints
import cli
from tests.conftest import write_tiny_recipe, write_word_corpus


class RecordStart(Callback):
    """Saves the network's weights as the first training step sees them."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}, self.path)


def _fit(root: Path, corpus: Path, source: str, *args: str, **model: Any) -> int:
    callbacks = [
        {"class_path": "checkpoints.callbacks.InitialWeights", "init_args": {"source": source}},
        {"class_path": "tests.test_initial_weights.RecordStart", "init_args": {"path": "{root}/start.pt"}},
    ]
    config = write_tiny_recipe(
        root / "run.yaml",
        corpus,
        root,
        trainer={"max_steps": 2, "callbacks": callbacks},
        model={"init_args": {"tie_weights": True, **model}},
    )
    return cli.main(["fit", "--config", str(config), *args])


def test_a_fresh_fit_starts_from_the_exports_weights(
    exported_run: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = exported_run / "export"
    # The same corpus (seed "export": the same vocabulary) written afresh, as another user's copy would be.
    corpus = write_word_corpus(workdir / "corpus", "export")
    assert _fit(workdir / "run", corpus, str(export)) == 0

    start = torch.load(workdir / "run" / "start.pt", weights_only=True)
    expected = checkpoints.load(export).model.state_dict()
    assert start.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(start[name], tensor.float(), rtol=0, atol=0, msg=name)
    assert f"lm-zoo: the run starts from the initial weights ({export})\n" in capsys.readouterr().err

    # Without the callback the same seed starts elsewhere: what the test compares is the source's doing.
    fresh = checkpoints.load(workdir / "run" / "checkpoints" / "last.ckpt").model.state_dict()
    assert any(not torch.equal(fresh[k], expected[k].float()) for k in expected)  # and then it trained


def test_a_resumed_fit_keeps_its_checkpoints_weights(exported_run: Path, workdir: Path) -> None:
    corpus = write_word_corpus(workdir / "corpus", "export")
    assert _fit(workdir / "run", corpus, str(exported_run / "export")) == 0
    last = workdir / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=False)["state_dict"]
    (workdir / "run" / "start.pt").unlink()
    config = str(workdir / "run" / "run.yaml")
    assert (
        cli.main(
            [
                "fit",
                "--config",
                config,
                "--trainer.max_steps",
                "4",
                "--trainer.max_epochs",
                "2",
                "--ckpt_path",
                str(last),
            ]
        )
        == 0
    )
    start = torch.load(workdir / "run" / "start.pt", weights_only=True)
    for name, tensor in start.items():
        torch.testing.assert_close(tensor, saved[f"model.{name}"], rtol=0, atol=0, msg=name)


def test_an_average_listed_before_the_initial_weights_is_refused(
    exported_run: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.EMAWeightAveraging", "init_args": {"decay": 0.5}},
        {"class_path": "checkpoints.callbacks.InitialWeights", "init_args": {"source": str(exported_run / "export")}},
    ]
    corpus = write_word_corpus(workdir / "corpus", "export")
    config = write_tiny_recipe(
        workdir / "run.yaml", corpus, trainer={"callbacks": callbacks}, model={"init_args": {"tie_weights": True}}
    )
    assert cli.main(["fit", "--config", str(config)]) == 2
    assert "list InitialWeights first" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("corpus_seed", "model", "message"),
    [
        ("other", {}, "were trained with another vocabulary"),
        ("export", {"hidden_size": 12}, "hidden_size 8 where this run has 12"),
    ],
)
def test_weights_that_do_not_fit_are_one_line_refusals(
    exported_run: Path,
    workdir: Path,
    capsys: pytest.CaptureFixture[str],
    corpus_seed: str,
    model: dict[str, Any],
    message: str,
) -> None:
    corpus = write_word_corpus(workdir / "corpus", corpus_seed, words=41 if corpus_seed == "other" else 40)
    assert _fit(workdir / "run", corpus, str(exported_run / "export"), **model) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "initial weights" in err[-1], err[-3:]
    assert not (workdir / "run" / "checkpoints").exists()  # refused before anything was trained or written


class RecordHopStart(Callback):
    """Saves where the first training step starts: the loops' counters, the rates, the averaging and the weights."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_modules.averaging import WeightAveragingOnPlateau

        averaging = [c for c in trainer.callbacks if isinstance(c, WeightAveragingOnPlateau)]
        torch.save(
            {
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "lr": [group["lr"] for optimizer in trainer.optimizers for group in optimizer.param_groups],
                "averaging": [callback.active for callback in averaging],
                "weights": {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()},
            },
            self.path,
        )


def test_two_hops_in_a_row_the_second_carrying_on_where_the_firsts_export_left_off(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One run trained in two sittings: the first's export (its averaged weights, with its record), then a fit of the
    same recipe with the export and carry_on given on the command line. The second hop starts at the epoch and step
    after the first's chosen checkpoint, at its learning rate, averaging from its first step, from the export's
    weights, and counts on from there."""
    corpus = write_word_corpus(workdir / "corpus", "hops")
    averaging = {
        "class_path": "lightning_modules.WeightAveragingOnPlateau",
        "init_args": {"trigger": "patience", "patience": 50, "start_fraction": 0.5},
    }
    start = {"class_path": "tests.test_initial_weights.RecordHopStart", "init_args": {"path": "start.pt"}}
    trainer = {"max_epochs": 2, "limit_val_batches": 2, "callbacks": [averaging, start]}
    recipe = write_tiny_recipe(workdir / "hop.yaml", corpus, workdir / "{hop}", trainer=trainer)
    recipe.write_text(recipe.read_text().replace("{hop}", "${hop}"))

    def fit(hop: str, *args: str) -> int:
        config = workdir / f"{hop}.yaml"
        config.write_text(recipe.read_text().replace("${hop}", hop).replace("start.pt", f"{hop}-start.pt"))
        return cli.main(["fit", "--config", str(config), *args])

    assert fit("hop1") == 0
    assert cli.main(["export", str(workdir / "hop1" / "checkpoints" / "best.ckpt"), "--out", "hop1-export"]) == 0
    first = checkpoints.load(workdir / "hop1-export")
    assert first.training["weight_averaged"] and first.training["global_step"] > 0
    capsys.readouterr()

    carry = ["--trainer.callbacks+=checkpoints.callbacks.InitialWeights"]
    carry += ["--trainer.callbacks.source=hop1-export", "--trainer.callbacks.carry_on=true"]
    assert fit("hop2", *carry, "--trainer.max_epochs=4") == 0  # max_epochs counts from the run's start
    began = torch.load(workdir / "hop2-start.pt", weights_only=True)
    assert (began["epoch"], began["step"]) == (first.training["epoch"] + 1, first.training["global_step"])
    assert began["lr"] == [g["lr"] for o in first.training["optimizers"] for g in o["param_groups"]]
    assert began["averaging"] == [True]
    for name, tensor in first.model.state_dict().items():
        torch.testing.assert_close(began["weights"][name], tensor.float(), rtol=0, atol=0, msg=name)
    err = capsys.readouterr().err
    assert f"lm-zoo: the run carries on from epoch {began['epoch']} and step {began['step']:,}" in err

    second = checkpoints.load(workdir / "hop2" / "checkpoints" / "last.ckpt")
    assert second.training["epoch"] == 3  # max_epochs 4, counted from the run's start
    assert second.training["global_step"] > first.training["global_step"]
