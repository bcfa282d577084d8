"""The GPU suite, for the day a CUDA GPU is available: ``pytest -m gpu`` (skipped without one; no GPU has run it yet).

Every architecture on CUDA computes what it computes on CPU (TF32 off, so both are float32), the fused cuDNN kernels
are the ones taken where they apply, bf16 and fp16 training steps are finite, dynamic evaluation runs (cuDNN refuses an
RNN's backward in eval mode, which lm-zoo avoids), and a 2-GPU DDP fit trains like one GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zoo
from tests.conftest import needs_data

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (pytest -m gpu runs these where there is)"),
]
FUSED = ("lstm", "gru", "rnn_tanh")  # nn.LSTM / nn.GRU / nn.RNN layers: cuDNN when no reset falls inside the window


@pytest.fixture(autouse=True)
def full_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """TF32 off (cuDNN's RNNs use it by default on Ampere and later): CUDA and CPU both compute in float32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _stack(name: str) -> tuple[torch.nn.Module, int]:
    options = dict(zoo.preset(name, "tiny"))
    size, hidden = options.pop("input_size"), options.pop("hidden_size")
    options.pop("num_layers")
    torch.manual_seed(0)
    return zoo.build(name, size, hidden, 2, **options), size


def _pass(stack: torch.nn.Module, x: torch.Tensor, reset: torch.Tensor | None) -> list[torch.Tensor]:
    stack.zero_grad()
    y, state = stack(x, reset=reset)
    (y.sin().sum() + sum(s.cos().sum() for s in state)).backward()
    return [y, *state, *(p.grad for p in stack.parameters())]


@pytest.mark.parametrize("name", zoo.names())
def test_every_architecture_on_cuda_equals_cpu(name: str) -> None:
    stack, size = _stack(name)
    x = torch.randn(3, 8, size)
    reset = torch.zeros(3, 8, dtype=torch.bool)
    reset[1, 5] = True
    for window_reset in (None, reset):
        on_cpu = [t.clone() for t in _pass(stack.train(), x, window_reset)]
        stack.cuda()
        on_gpu = _pass(stack, x.cuda(), None if window_reset is None else window_reset.cuda())
        stack.cpu()
        for cpu, gpu in zip(on_cpu, on_gpu, strict=True):
            torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", FUSED)
def test_the_fused_cudnn_kernel_is_taken_without_a_reset(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stack, size = _stack(name)
    stack.cuda()
    for layer in stack.layers:
        monkeypatch.setattr(layer, "step", lambda *args: pytest.fail("the per-step loop ran where cuDNN applies"))
    _pass(stack, torch.randn(3, 8, size, device="cuda"), None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", zoo.names())
def test_mixed_precision_training_steps_are_finite(name: str, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    stack, size = _stack(name)
    stack.cuda().train()
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    x = torch.randn(3, 8, size, device="cuda")
    for _ in range(3):
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            y, state = stack(x)
            loss = y.float().pow(2).mean()
        assert torch.isfinite(loss) and all(s.dtype == torch.float32 for s in state)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert all(torch.isfinite(p).all() for p in stack.parameters())


def test_dynamic_evaluation_runs_on_cuda_and_equals_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datamodules import TextDataModule
    from lightning_modules.evaluation.dynamic import DynamicEvaluation
    from lightning_modules.evaluation.perplexity import evaluate
    from tests.conftest import write_word_corpus
    from zoo import RecurrentLM

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    data = TextDataModule(str(write_word_corpus(tmp_path / "corpus", "gpu")), batch_size=4, bptt=6)
    data.prepare_data()
    torch.manual_seed(0)
    model = RecurrentLM(vocab_size=data.vocab_size, embedding_size=8, hidden_size=8, architecture="lstm")
    settings = DynamicEvaluation(max_time_steps=6, stat_batches=4, stat_batch_size=4)
    on_cpu = evaluate(model, data, "test", dynamic=settings, device="cpu")["loss"]
    on_gpu = evaluate(model, data, "test", dynamic=settings, device="cuda")["loss"]
    assert on_gpu == pytest.approx(on_cpu, rel=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@needs_data("gbw-sample")
def test_two_gpu_ddp_matches_one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_gbw_ddp import TOLERANCE, fit, validation_ppl

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    single = validation_ppl(fit(tmp_path, "single", devices=1, seed=1, accelerator="gpu"))
    ddp = validation_ppl(fit(tmp_path, "ddp", devices=2, seed=1, accelerator="gpu"))
    assert abs(ddp - single) / single < TOLERANCE, (ddp, single)
