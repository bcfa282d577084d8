"""Row-sparse gradients for the vocabulary-sized matrices (``sparse_gradients``): the same numbers as the dense path
with no ``(V, D)`` tensor in the step, clipping by the coalesced norm, and one-line refusals of what cannot apply them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import cli
from datamodules import TextDataModule
from evaluation.dynamic import DynamicEvaluation, adapting, dynamic_nll, mean_squared_gradients
from lightning_modules import LanguageModel
from lightning_modules.sparse_gradients import check_optimizer, clip_grad_norm
from tests.conftest import LargestTensor, one_line_error, quiet_trainer, write_tiny_recipe, write_word_corpus
from zoo.errors import ConfigError
from zoo.nce import NCEHead

B, T, D, V, K = 3, 4, 5, 200, 6


def _nce_head(sparse: bool) -> NCEHead:
    torch.manual_seed(0)
    head = NCEHead(D, V, K, sparse_gradient=sparse).double()
    head.set_noise_distribution(torch.arange(1, V + 1).double().reciprocal())
    return head


@pytest.mark.parametrize("objective", ["nce", "sampled_softmax"])
def test_sparse_head_gradient_equals_the_dense_one_and_no_vocabulary_sized_tensor_is_made(objective: str) -> None:
    dense, sparse = _nce_head(False), _nce_head(True)
    dense.objective = sparse.objective = objective
    h = torch.randn(B, T, D, dtype=torch.float64)
    targets = torch.randint(0, 20, (B, T))  # a small range, so that words repeat within the step
    targets[0, 0] = -100
    noise = dense.sample_noise(B, T)  # (T, K)
    dense.training_loss(h, targets, noise)[0].backward()
    with LargestTensor() as watch:
        sparse.training_loss(h, targets, noise)[0].backward()
    assert sparse.weight.grad.is_sparse
    assert sparse.weight.grad._nnz() == B * T + T * K  # one row per lookup, nothing else
    assert watch.largest < V * D / 4  # the largest tensor of the whole step: nothing (V, D) was built
    torch.testing.assert_close(sparse.weight.grad.to_dense(), dense.weight.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(sparse.bias.grad, dense.bias.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipping_uses_the_norm_of_the_summed_rows(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(10, 3, dtype=dtype))
    other = torch.nn.Parameter(torch.randn(4, dtype=dtype))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in (weight, other)]
    ids = torch.tensor([1, 1, 1, 4, 7])  # word 1 three times: its rows must be summed before squaring
    positions = torch.arange(5, dtype=dtype)
    (F.embedding(ids, weight, sparse=True).sum(1) * positions).sum().add((other**2).sum()).backward()
    (F.embedding(ids, twins[0]).sum(1) * positions).sum().add((twins[1] ** 2).sum()).backward()
    uncoalesced = weight.grad._values().square().sum().add(other.grad.square().sum()).sqrt()
    norm = clip_grad_norm([weight, other], 1.0)
    expected = torch.nn.utils.clip_grad_norm_(twins, 1.0)
    # To the last bits of the gradients' own precision (a norm taken in float32 would be off by ~1e-7 in float64).
    exact = {"rtol": 4 * torch.finfo(dtype).eps, "atol": 0.0}
    torch.testing.assert_close(norm, expected, **exact)
    assert norm.dtype == dtype
    assert not torch.isclose(uncoalesced, expected)  # the trap the coalescing avoids
    torch.testing.assert_close(weight.grad.to_dense(), twins[0].grad, **exact)
    torch.testing.assert_close(other.grad, twins[1].grad, **exact)
    assert torch.linalg.vector_norm(torch.cat([weight.grad.to_dense().flatten(), other.grad])) < 1.0 + 1e-5


def _fit(tmp_path: Path, sparse: bool, tie: bool, algorithm: str = "norm") -> tuple[LanguageModel, TextDataModule]:
    """Eight SGD steps of a tiny NCE model with clipping that binds; the same seed, data and noise for both paths."""
    dm = TextDataModule(str(write_word_corpus(tmp_path, "s", words=60)), batch_size=4, bptt=6, eval_batch_size=2)
    L.seed_everything(0, verbose=False)
    model = LanguageModel(
        dm.vocab_size, embedding_size=8, hidden_size=8, num_layers=1, head="nce", noise_samples=7,
        tie_weights=tie, sparse_gradients=sparse,
    )  # fmt: skip
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.5)  # LightningCLI's job in lm-zoo
    # gradient_clip_val far below this model's gradient norms: every step is clipped
    trainer = quiet_trainer(max_steps=8, limit_val_batches=0, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about data loader workers
        trainer.fit(model, dm)
    return model, dm


def test_clipping_sparse_gradients_by_value_is_refused_before_the_first_step(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gradient_clip_algorithm 'value' with sparse_gradients: only norm clipping"):
        _fit(tmp_path, sparse=True, tie=False, algorithm="value")


@pytest.mark.parametrize("tie", [False, True])
def test_training_with_sparse_gradients_equals_dense_training(tmp_path: Path, tie: bool) -> None:
    dense, _ = _fit(tmp_path / "dense", sparse=False, tie=tie)
    sparse, dm = _fit(tmp_path / "sparse", sparse=True, tie=tie)
    batch = next(iter(dm.train_dataloader()))
    sparse.model.decoder.training_loss(sparse.model.features(batch.inputs)[0], batch.targets)[0].backward()
    assert (
        sparse.model.embedding.weight.grad.is_sparse and sparse.model.decoder.weight.grad.is_sparse
    )  # the path under test
    weights = dict(sparse.named_parameters())
    for name, expected in dense.named_parameters():
        torch.testing.assert_close(weights[name], expected, atol=1e-6, rtol=0, msg=name)
    L.seed_everything(0, verbose=False)
    initial = LanguageModel(**dense.hparams)  # the weights both runs started from
    assert (
        dense.model.decoder.weight - initial.model.decoder.weight
    ).abs().max() > 1e-3  # it trained: not two untouched models


def test_dynamic_evaluation_of_a_sparse_model_equals_the_dense_one(tmp_path: Path) -> None:
    """Dynamic evaluation differentiates the embedding, which is sparse here; its statistics and update are dense."""
    dense, dm = _fit(tmp_path / "dense", sparse=False, tie=False)
    sparse = LanguageModel(**{**dense.hparams, "sparse_gradients": True})
    sparse.load_state_dict(dense.state_dict())
    training, segments = list(dm.stream("train", 4, 6)), list(dm.stream("valid", 1, 3))
    scores = []
    for model, learning_rate in ((dense, 1e-2), (sparse, 1e-2), (dense, 0.0)):
        settings = DynamicEvaluation(learning_rate=learning_rate, max_time_steps=3)
        with adapting(model, mean_squared_gradients(model, training, 3), settings) as adaptation:
            scores.append(torch.cat([nll.flatten() for nll, _ in dynamic_nll(model, segments, adaptation)]))
    torch.testing.assert_close(scores[1], scores[0])
    assert (scores[0] - scores[2]).abs().max() > 1e-4  # the steps changed the scores: the weights did adapt


@pytest.mark.parametrize(
    ("optimizer", "fragment"),
    [
        (lambda p: torch.optim.Adam(p), "with Adam"),
        (lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9), "momentum"),
        (lambda p: torch.optim.SGD(p, lr=1.0, weight_decay=1e-4), "weight decay"),
        (lambda p: torch.optim.Adagrad(p, weight_decay=1e-4), "Adagrad weight decay"),
    ],
)
def test_optimizers_that_cannot_apply_sparse_gradients_are_refused(optimizer, fragment: str) -> None:  # noqa: ANN001
    parameters = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ConfigError, match=fragment) as refused:
        check_optimizer(optimizer(parameters))
    assert "\n" not in str(refused.value) and "sparse_gradients false" in str(refused.value)
    check_optimizer(torch.optim.SGD(parameters, lr=1.0))
    check_optimizer(torch.optim.Adagrad(parameters))


def test_fit_with_sparse_gradients_trains_with_sgd_and_refuses_adam_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = write_word_corpus(tmp_path / "corpus", "a")
    config = write_tiny_recipe(tmp_path / "run.yaml", corpus)  # SGD, lr 1, no momentum
    args = ["--model.init_args.head", "nce", "--model.init_args.sparse_gradients", "true", "--trainer.logger", "false"]
    assert cli.main(["fit", "--config", str(config), *args, "--trainer.gradient_clip_val", "0.5"]) == 0
    assert list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    root = tmp_path / "adam"
    args += ["--optimizer", "torch.optim.Adam", "--trainer.default_root_dir", str(root)]
    code = cli.main(["fit", "--config", str(config), *args, "--checkpoint.dirpath", str(root / "checkpoints")])
    one_line_error(capsys, code, "sparse_gradients with Adam", "SGD without momentum")
    assert not (root / "checkpoints").exists()  # refused before the first step
