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
