"""Checks of what ran in which dtype under autocast, shared by the CPU suite (``tests/test_precision.py``) and the GPU
suite (``tests/test_gpu.py``), which ask them of CUDA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

import zoo
from benchmarks.autocast_dtypes import DtypesRan
from datamodules import TextDataModule
from lightning_modules import LanguageModel
from tests.conftest import fused_kernel_calls, quiet_trainer

B, T = 3, 9  # the windows the stacks run


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


# The architectures whose layers wrap a fused nn.LSTM / nn.GRU / nn.RNN (zoo.layers.FusedLayer).
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
    ran = DtypesRan({f"layer {i}": layer for i, layer in enumerate(stack.layers)})
    with fused_kernel_calls() as calls:
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None), ran:
            y, state = stack(torch.randn(B, T, size, device=device))
    (y.float().sum() + sum(s.sum() for s in state)).backward()
    return {
        "products": [ran.products(f"layer {i}") for i in range(len(stack.layers))],
        "output": y.dtype,
        "state": {s.dtype for s in state},
        "fused_calls": len(calls),
        "gradients": {p.grad.dtype for p in stack.parameters()},
    }


def recorded_in(step: Callable[..., Any], ran: DtypesRan) -> Callable[..., Any]:
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
    model.training_step = recorded_in(model.training_step, ran)  # Lightning calls the step inside its autocast
    trainer = quiet_trainer(
        max_steps=50, precision=precision, callbacks=[losses], limit_val_batches=0, accelerator=accelerator, devices=1
    )
    trainer.fit(model, datamodule=data)
    assert len(losses.values) == 50 and all(torch.isfinite(torch.tensor(losses.values)))
    first, last = sum(losses.values[:5]) / 5, sum(losses.values[-5:]) / 5
    print(f"{precision} on {accelerator}: mean loss of steps 1-5 {first:.3f}, of steps 46-50 {last:.3f}")
    assert last < first - 0.3, (first, last)
    return losses.values, ran, trainer
