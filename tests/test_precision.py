"""Mixed precision: every architecture and head trains under bf16 autocast on CPU (the same non-oneDNN route a CUDA
tensor takes through the hand-written kernels), close to float32, with the recurrent state kept in float32; and the
low-precision dtype is what actually ran where the README says it runs (the products autograd runs, in every layer and
head), while lm-zoo's hand-written kernels (the Mogrifier window) and the adaptive head compute in float32."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import zoo
from benchmarks.autocast_dtypes import DtypesRan
from datamodules import TextDataModule
from lightning_modules import LanguageModel
from tests.conftest import quiet_trainer
from zoo import RecurrentLM

B, T = 3, 9
# bf16 keeps 8 bits of mantissa: a relative error of ~0.4% per rounding, a few of them per step and layer.
OUTPUT_TOLERANCE = 0.05  # largest |bf16 - fp32| of an output, relative to the fp32 outputs' largest magnitude
GRADIENT_COSINE = 0.98  # every parameter's bf16 gradient points where the fp32 one does
# Architectures whose whole window is one of lm-zoo's hand-written kernels on the fast path (zoo/mogrifier.py's
# _MogrifierWindow, under zoo.kernels.autocast_off): every product of the layer runs in the weights' dtype.
WINDOW_KERNELS = {"mogrifier"}


def _run(
    stack: torch.nn.Module, x: torch.Tensor, reset: torch.Tensor, dtype: torch.dtype | None
) -> tuple[tuple[torch.Tensor, ...], DtypesRan]:
    stack.zero_grad()
    torch.manual_seed(5)  # the same dropout masks in both precisions
    ran = DtypesRan({f"layer {i}": layer for i, layer in enumerate(stack.layers)})
    with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        with ran:  # the forward only: autocast does not cover the backward
            y, state = stack(x, reset=reset)
        loss = y.float().sin().sum()
    loss.backward()
    return (y.float(), state, tuple(p.grad.clone() for p in stack.parameters())), ran


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


def check_architecture_under_autocast(name: str, dtype: torch.dtype, fast: bool, device: str) -> None:
    """Train-mode forward and backward of ``name``'s tiny stack under ``dtype`` autocast on ``device``: close to
    float32, the state kept in float32, every layer's products in the autocast dtype (float32 in the hand-written
    window kernels on the fast path). The GPU suite runs the same on CUDA."""
    options = dict(zoo.preset(name, "tiny"))
    size, hidden, layers = options.pop("input_size"), options.pop("hidden_size"), options.pop("num_layers")
    torch.manual_seed(0)
    # Training mode with the recurrent regularisers on, and a reset mid-window: the per-step loops, not only the
    # fused kernels, run under autocast.
    stack = zoo.build(name, size, hidden, max(layers, 2), dropout=0.2, state_dropout=0.2, **options).train()
    stack.to(device)
    x = torch.randn(B, T, size, device=device)
    reset = torch.zeros(B, T, dtype=torch.bool, device=device)
    reset[1, 4] = True
    (y32, state32, grads32), _ = _run(stack, x, reset, None)
    (y16, state16, grads16), ran = _run(stack, x, reset, dtype)
    assert all(s.dtype == torch.float32 for s in state16), "the carried state stays in the weights' dtype"
    for layer in range(len(stack.layers)):
        scope = f"layer {layer}"
        assert ran.products(scope), f"{scope} ran no product: the recorder missed the layer"
        if fast and name in WINDOW_KERNELS:  # the hand-written window computes in float32
            assert ran.products(scope) == {torch.float32}, (scope, ran.ran[scope])
        else:  # the input products (and, on the plain path, the recurrent ones) ran in the autocast dtype
            assert dtype in ran.products(scope), (scope, ran.ran[scope])
    assert torch.isfinite(y16).all() and all(torch.isfinite(g).all() for g in grads16)
    assert (y16 - y32).abs().max() <= OUTPUT_TOLERANCE * y32.abs().max()
    for (parameter, _), g16, g32 in zip(stack.named_parameters(), grads16, grads32, strict=True):
        if g32.abs().max() > 0:
            cosine = torch.nn.functional.cosine_similarity(g16.flatten(), g32.flatten(), dim=0)
            assert cosine >= GRADIENT_COSINE, (parameter, float(cosine))


# The architectures whose layers wrap a fused nn.LSTM / nn.GRU / nn.RNN (zoo.base.FusedLayer).
FUSED = ("lstm", "gru", "rnn_tanh")
AUTOCAST_MODES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def fused_layer_dtypes(name: str, mode: str, device: str = "cpu") -> dict[str, Any]:
    """What a fused architecture's layers computed in under one autocast mode, on ``device``: the dtypes of every
    product inside each layer, the output's and the carried state's, and how often the fused kernel was called.

    The GPU suite (``tests/test_gpu.py``) asks the same of CUDA, where autocast's own rule for cuDNN's RNNs is
    float16 whatever the autocast dtype.
    """
    dtype = AUTOCAST_MODES[mode]
    options = dict(zoo.preset(name, "tiny"))
    size, hidden = options.pop("input_size"), options.pop("hidden_size")
    options.pop("num_layers")
    torch.manual_seed(0)
    stack = zoo.build(name, size, hidden, 2, dropout=0.2, **options).train().to(device)
    calls = []
    hooks = [layer.rnn.register_forward_pre_hook(lambda m, a: calls.append(m)) for layer in stack.layers]
    ran = DtypesRan({f"layer {i}": layer for i, layer in enumerate(stack.layers)})
    with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None), ran:
        y, state = stack(torch.randn(B, T, size, device=device))
    (y.float().sum() + sum(s.sum() for s in state)).backward()
    for hook in hooks:
        hook.remove()
    return {
        "products": [ran.products(f"layer {i}") for i in range(len(stack.layers))],
        "output": y.dtype,
        "state": {s.dtype for s in state},
        "fused_calls": len(calls),
        "gradients": {p.grad.dtype for p in stack.parameters()},
    }


@pytest.mark.parametrize("mode", AUTOCAST_MODES)
@pytest.mark.parametrize("name", FUSED)
def test_the_fused_layers_compute_in_the_autocast_dtype(name: str, mode: str) -> None:
    """bf16 autocast runs the fused layers in bf16 and fp16 autocast in fp16, never one for the other, and the fused
    kernel (not the per-step loop) is what ran. On CPU autocast itself would leave nn.GRU in float32; on CUDA its RNN
    wrapper would run every one of them in float16 (zoo/base.py's module doc): lm-zoo casts explicitly."""
    ran = fused_layer_dtypes(name, mode)
    expected = AUTOCAST_MODES[mode] or torch.float32
    assert ran["fused_calls"] == 2, "each of the two layers ran its fused kernel once"
    assert ran["products"] == [{expected}, {expected}], ran["products"]
    assert ran["output"] == expected
    assert ran["state"] == {torch.float32}, "the carried state stays in the weights' dtype"
    assert ran["gradients"] == {torch.float32}


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


def _recorded(step: Callable[..., Any], ran: DtypesRan) -> Callable[..., Any]:
    """``step`` run inside ``ran``: each call's ops recorded."""

    def recorded(*args: Any, **kwargs: Any) -> Any:
        with ran:
            return step(*args, **kwargs)

    return recorded


def tiny_mixed_fit(
    tmp_path: Path, precision: str, architecture: str, accelerator: str = "cpu", **cell_options: Any
) -> tuple[list[float], DtypesRan, L.Trainer]:
    """50 steps of Lightning's ``precision`` on a learnable corpus (each word follows the one before): the losses,
    what the stack and the rest of the step computed in, and the trainer (its precision plugin). The GPU suite runs
    it on CUDA."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, lines in (("train", 400), ("valid", 20), ("test", 20)):
        text = "".join(" ".join(f"w{(start + i) % 12}" for i in range(8)) + "\n" for start in range(lines))
        (corpus / f"{split}.txt").write_text(text)
    data = TextDataModule(str(corpus), batch_size=4, bptt=10)
    data.prepare_data()

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.values.append(float(outputs["loss"]))

    losses = Losses()
    torch.manual_seed(0)
    model = LanguageModel(
        vocab_size=data.vocab_size,
        architecture=architecture,
        embedding_size=16,
        hidden_size=16,
        num_layers=1,
        cell_options=cell_options or None,
    )
    model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=1e-2)  # LightningCLI's job in lm-zoo
    ran = DtypesRan({"stack": model.model.rnn})
    model.training_step = _recorded(model.training_step, ran)  # Lightning calls the step inside its autocast
    trainer = quiet_trainer(
        max_steps=50, precision=precision, callbacks=[losses], limit_val_batches=0, accelerator=accelerator, devices=1
    )
    trainer.fit(model, datamodule=data)
    assert len(losses.values) == 50 and all(torch.isfinite(torch.tensor(losses.values)))
    first, last = sum(losses.values[:5]) / 5, sum(losses.values[-5:]) / 5
    print(f"{precision} on {accelerator}: mean loss of steps 1-5 {first:.3f}, of steps 46-50 {last:.3f}")
    assert last < first - 0.3, (first, last)
    return losses.values, ran, trainer


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
