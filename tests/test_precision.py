"""Mixed precision: every architecture and head trains under bf16 autocast on CPU (the same non-oneDNN route a CUDA
tensor takes through the hand-written kernels), close to float32, with the recurrent state kept in float32; and the
low-precision dtype is what actually ran where the README says it runs (the products autograd runs, in every layer and
head), while lm-zoo's hand-written kernels (the Mogrifier window) and the adaptive head compute in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zoo
from benchmarks.autocast_dtypes import DtypesRan
from lightning_modules import LanguageModel
from tests.precision_checks import (
    AUTOCAST_MODES,
    FUSED,
    B,
    T,
    check_architecture_under_autocast,
    fused_layer_dtypes,
    tiny_mixed_fit,
)
from zoo import RecurrentLM


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
    check_architecture_under_autocast(name, dtype, kernels == "fast", "cpu")


@pytest.mark.parametrize("mode", AUTOCAST_MODES)
@pytest.mark.parametrize("name", FUSED)
def test_the_fused_layers_compute_in_the_autocast_dtype(name: str, mode: str) -> None:
    """bf16 autocast runs the fused layers in bf16 and fp16 autocast in fp16, never one for the other, and the fused
    kernel (not the per-step loop) is what ran. On CPU autocast itself would leave nn.GRU in float32; on CUDA its RNN
    wrapper would run every one of them in float16 (zoo/layers.py's module doc): lm-zoo casts explicitly."""
    ran = fused_layer_dtypes(name, mode)
    expected = AUTOCAST_MODES[mode] or torch.float32
    assert ran["fused_calls"] == 2, "each of the two layers ran its fused kernel once"
    assert ran["products"] == [{expected}, {expected}], ran["products"]
    assert ran["output"] == expected
    assert ran["state"] == {torch.float32}, "the carried state stays in the weights' dtype"
    assert ran["gradients"] == {torch.float32}


@pytest.mark.slow
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
    from datamodules.windows import LMBatch

    batch = LMBatch(ids[:, :-1], ids[:, 1:])
    losses = []
    for bf16 in (False, True):
        model.zero_grad()
        model._state["train"] = None
        torch.manual_seed(3)  # the same noise words
        ran = DtypesRan({"stack": model.model.rnn})
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), ran:
            total, count, _, _ = model._window(batch, "train")
            loss = total / count
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses.append(float(loss))
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    assert loss.dtype == torch.float32, "the loss is summed in float32 whatever the products ran in"
    # What ran under bf16 (the last pass): the stack's products in bf16, and the head's (the ops outside the stack)
    # too, except the adaptive head's, which runs its few small products without autocast (zoo.heads._full_precision).
    assert torch.bfloat16 in ran.products("stack"), ran.ran["stack"]
    if head == "adaptive":
        assert ran.products("outside") == {torch.float32}, ran.ran["outside"]
    else:
        assert torch.bfloat16 in ran.products("outside"), ran.ran["outside"]


@pytest.mark.slow
def test_bf16_mixed_fit_lowers_the_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's ``bf16-mixed`` precision, 50 steps of a tiny Mogrifier (the most hand-written kernels)."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    _, ran, _ = tiny_mixed_fit(tmp_path, "bf16-mixed", "mogrifier", rounds=2, rank=4)
    # bf16-mixed ran in bf16: the head's products (outside the stack) did; the Mogrifier's window kernel, by design,
    # computed in float32.
    assert torch.bfloat16 in ran.products("outside"), ran.ran["outside"]
    assert ran.products("stack") == {torch.float32}, ran.ran["stack"]


def test_plain_module_generates_under_autocast() -> None:
    torch.manual_seed(0)
    model = RecurrentLM(vocab_size=30, embedding_size=8, hidden_size=8, architecture="gru_paper").eval()
    ran = DtypesRan()
    with torch.autocast("cpu", dtype=torch.bfloat16), ran:
        samples = model.generate(torch.zeros(2, 1, dtype=torch.long), 5, generator=torch.Generator().manual_seed(0))
    assert [len(s) for s in samples] == [5, 5]
    assert torch.bfloat16 in ran.products("outside"), "sampling ran its products in bf16"


def test_a_loss_scaled_fp16_step_with_nce_and_sparse_gradients() -> None:
    """The 16-mixed route (on a GPU: Lightning's GradScaler): scaled loss, unscaled row-sparse gradients, lm-zoo's
    sparse clipping, the scaler's step. Written with torch's own scaler, since Lightning runs 16-mixed on CPU as bf16
    (and the LSTM's per-step path, since oneDNN has no float16 LSTM)."""
    from datamodules.windows import LMBatch
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
    ran = DtypesRan()
    with torch.autocast("cpu", dtype=torch.float16), ran:
        total, count, _, _ = model._window(LMBatch(ids[:, :-1], ids[:, 1:]), "train")
    assert torch.float16 in ran.products("outside"), "the window's products ran in fp16"
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
