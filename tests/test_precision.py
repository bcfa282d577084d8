"""Mixed precision: every architecture and head trains under bf16 autocast on CPU (the same non-oneDNN route a CUDA
tensor takes through the hand-written kernels), close to float32, with the recurrent state kept in float32."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

import zoo
from datamodules import TextDataModule
from lightning_modules import LanguageModel
from tests.conftest import quiet_trainer
from zoo import RecurrentLM

B, T = 3, 9
# bf16 keeps 8 bits of mantissa: a relative error of ~0.4% per rounding, a few of them per step and layer.
OUTPUT_TOLERANCE = 0.05  # largest |bf16 - fp32| of an output, relative to the fp32 outputs' largest magnitude
GRADIENT_COSINE = 0.98  # every parameter's bf16 gradient points where the fp32 one does


def _run(
    stack: torch.nn.Module, x: torch.Tensor, reset: torch.Tensor, dtype: torch.dtype | None
) -> tuple[torch.Tensor, ...]:
    stack.zero_grad()
    torch.manual_seed(5)  # the same dropout masks in both precisions
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y, state = stack(x, reset=reset)
        loss = y.float().sin().sum()
    loss.backward()
    return y.float(), state, tuple(p.grad.clone() for p in stack.parameters())


@pytest.mark.parametrize(
    ("dtype", "kernels"),
    [(torch.bfloat16, "fast"), (torch.float16, "fast"), (torch.bfloat16, "plain")],
    ids=["bf16", "fp16", "bf16-plain"],
)
@pytest.mark.parametrize("name", zoo.names())
def test_every_architecture_trains_under_autocast_close_to_float32(
    name: str, dtype: torch.dtype, kernels: str, zoo_settings
) -> None:
    zoo_settings(plain_kernels=kernels == "plain")  # the fast paths, and the plain reference path
    if dtype == torch.float16 and name == "lstm":
        pytest.skip("oneDNN has no float16 LSTM on CPU (cuDNN has one; Lightning runs 16-mixed on CPU as bf16)")
    options = dict(zoo.preset(name, "tiny"))
    size, hidden, layers = options.pop("input_size"), options.pop("hidden_size"), options.pop("num_layers")
    torch.manual_seed(0)
    # Training mode with the recurrent regularisers on, and a reset mid-window: the per-step loops, not only the
    # fused kernels, run under autocast.
    stack = zoo.build(name, size, hidden, max(layers, 2), dropout=0.2, state_dropout=0.2, **options).train()
    x = torch.randn(B, T, size)
    reset = torch.zeros(B, T, dtype=torch.bool)
    reset[1, 4] = True
    y32, state32, grads32 = _run(stack, x, reset, None)
    y16, state16, grads16 = _run(stack, x, reset, dtype)
    assert all(s.dtype == torch.float32 for s in state16), "the carried state stays in the weights' dtype"
    assert torch.isfinite(y16).all() and all(torch.isfinite(g).all() for g in grads16)
    assert (y16 - y32).abs().max() <= OUTPUT_TOLERANCE * y32.abs().max()
    for (parameter, _), g16, g32 in zip(stack.named_parameters(), grads16, grads32, strict=True):
        if g32.abs().max() > 0:
            cosine = torch.nn.functional.cosine_similarity(g16.flatten(), g32.flatten(), dim=0)
            assert cosine >= GRADIENT_COSINE, (parameter, float(cosine))


@pytest.mark.parametrize("head", ["softmax", "mos", "nce", "sampled_softmax", "adaptive"])
def test_every_head_trains_under_bf16_autocast(head: str) -> None:
    torch.manual_seed(0)
    vocab = 50
    model = LanguageModel(
        vocab_size=vocab, embedding_size=16, hidden_size=16, num_layers=2, head=head, mos_components=2, noise_samples=5
    )
    if head in ("nce", "sampled_softmax"):
        model.model.set_noise_distribution(torch.arange(vocab, 0, -1))
    ids = torch.randint(0, vocab, (B, T + 1))
    from datamodules.streams import LMBatch

    batch = LMBatch(ids[:, :-1], ids[:, 1:])
    losses = []
    for bf16 in (False, True):
        model.zero_grad()
        model._state["train"] = None
        torch.manual_seed(3)  # the same noise words
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            total, count, _, _ = model._window(batch, "train")
            loss = total / count
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses.append(float(loss))
    assert losses[1] == pytest.approx(losses[0], rel=0.02)


def test_bf16_mixed_fit_lowers_the_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's ``bf16-mixed`` precision, 50 steps of a tiny Mogrifier (the most hand-written kernels)."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, lines in (("train", 400), ("valid", 20), ("test", 20)):  # learnable: each word follows the one before
        text = "".join(" ".join(f"w{(start + i) % 12}" for i in range(8)) + "\n" for start in range(lines))
        (corpus / f"{split}.txt").write_text(text)
    data = TextDataModule(str(corpus), batch_size=4, bptt=10)
    data.prepare_data()

    class Losses(L.Callback):
        values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.values.append(float(outputs["loss"]))

    losses = Losses()
    torch.manual_seed(0)
    model = LanguageModel(
        vocab_size=data.vocab_size,
        architecture="mogrifier",
        embedding_size=16,
        hidden_size=16,
        num_layers=1,
        cell_options={"rounds": 2, "rank": 4},
    )
    model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=1e-2)  # LightningCLI's job in lm-zoo
    trainer = quiet_trainer(max_steps=50, precision="bf16-mixed", callbacks=[losses], limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    assert len(losses.values) == 50 and all(torch.isfinite(torch.tensor(losses.values)))
    first, last = sum(losses.values[:5]) / 5, sum(losses.values[-5:]) / 5
    print(f"bf16-mixed: mean loss of steps 1-5 {first:.3f}, of steps 46-50 {last:.3f}")
    assert last < first - 0.3, (first, last)


def test_plain_module_generates_under_autocast() -> None:
    torch.manual_seed(0)
    model = RecurrentLM(vocab_size=30, embedding_size=8, hidden_size=8, architecture="gru_paper").eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        samples = model.generate(torch.zeros(2, 1, dtype=torch.long), 5, generator=torch.Generator().manual_seed(0))
    assert [len(s) for s in samples] == [5, 5]


def test_a_loss_scaled_fp16_step_with_nce_and_sparse_gradients() -> None:
    """The 16-mixed route (on a GPU: Lightning's GradScaler): scaled loss, unscaled row-sparse gradients, lm-zoo's
    sparse clipping, the scaler's step. Written with torch's own scaler, since Lightning runs 16-mixed on CPU as bf16
    (and the LSTM's per-step path, since oneDNN has no float16 LSTM)."""
    from datamodules.streams import LMBatch
    from lightning_modules.sparse_gradients import clip_grad_norm

    torch.manual_seed(0)
    vocab = 40
    model = LanguageModel(
        vocab_size=vocab,
        embedding_size=8,
        hidden_size=8,
        num_layers=1,
        head="nce",
        noise_samples=5,
        sparse_gradients=True,
        cell_options={"fused": False},
    )
    model.model.set_noise_distribution(torch.arange(vocab, 0, -1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    ids = torch.randint(0, vocab, (B, T + 1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.float16):
        total, count, _, _ = model._window(LMBatch(ids[:, :-1], ids[:, 1:]), "train")
    scaler.scale(total / count).backward()
    assert model.model.embedding.weight.grad.is_sparse
    scaler.unscale_(optimizer)
    clip_grad_norm(list(model.parameters()), 0.25)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**10  # no overflow: the step was taken, not skipped
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "model.embedding.weight" in changed and "model.decoder.weight" in changed
    assert all(torch.isfinite(p).all() for p in model.parameters())
