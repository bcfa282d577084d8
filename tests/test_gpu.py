"""The GPU suite: ``pytest -m gpu`` (skipped without a CUDA GPU; first run on one H100, benchmarks/results/gpu-h100).

Every architecture on CUDA computes what it computes on CPU (TF32 off, so both are float32), the fused cuDNN kernels
are the ones taken where they apply, bf16 and fp16 training steps are finite, dynamic evaluation runs (cuDNN refuses an
RNN's backward in eval mode, which lm-zoo avoids), and a 2-GPU DDP fit trains like one GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import zoo
from tests.conftest import fused_kernel_calls, needs_data, tiny_stack
from zoo.settings import DEFAULT_MATMUL_PRECISION, matmul_precision_in_force

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU (pytest -m gpu runs these where there is)"),
]
FUSED = ("lstm", "gru", "rnn_tanh")  # nn.LSTM / nn.GRU / nn.RNN layers: cuDNN when no reset falls inside the window


@pytest.fixture(autouse=True)
def full_float32() -> Iterator[None]:
    """lm-zoo's default matmul precision, the one ``lm-zoo fit`` and ``evaluate`` set (``highest``: TF32 off, also in
    cuDNN's RNNs, which use it by default on Ampere and later): CUDA and CPU both compute in float32."""
    with matmul_precision_in_force(DEFAULT_MATMUL_PRECISION):
        yield


def _pass(stack: torch.nn.Module, x: torch.Tensor, reset: torch.Tensor | None) -> list[torch.Tensor]:
    stack.zero_grad()
    y, state = stack(x, reset=reset)
    (y.sin().sum() + sum(s.cos().sum() for s in state)).backward()
    return [y, *state, *(p.grad for p in stack.parameters())]


@pytest.mark.parametrize("name", zoo.names())
def test_every_architecture_on_cuda_equals_cpu(name: str) -> None:
    stack, size = tiny_stack(name)
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
    stack, size = tiny_stack(name)
    stack.cuda()
    for layer in stack.layers:
        monkeypatch.setattr(layer, "step", lambda *args: pytest.fail("the per-step loop ran where cuDNN applies"))
    _pass(stack, torch.randn(3, 8, size, device="cuda"), None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", zoo.names())
def test_mixed_precision_training_steps_are_finite(name: str, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    stack, size = tiny_stack(name)
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
    from evaluation.dynamic import DynamicEvaluation
    from evaluation.perplexity import evaluate
    from tests.conftest import write_word_corpus
    from zoo import RecurrentLM

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    data = TextDataModule(str(write_word_corpus(tmp_path / "corpus", "gpu")), batch_size=4, bptt=6)
    data.prepare_data()
    torch.manual_seed(0)
    model = RecurrentLM(vocab_size=data.vocab_size, embedding_size=8, hidden_size=8, architecture="lstm")
    settings = DynamicEvaluation(max_time_steps=6, stat_batches=4, stat_batch_size=4)
    on_cpu = evaluate(model, data, "test", procedure=settings, device="cpu").loss
    on_gpu = evaluate(model, data, "test", procedure=settings, device="cuda").loss
    assert on_gpu == pytest.approx(on_cpu, rel=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@needs_data("gbw-sample")
def test_two_gpu_ddp_matches_one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.gbw_runs import TOLERANCE, fit, validation_ppl

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    single = validation_ppl(fit(tmp_path, "single", devices=1, seed=1, accelerator="gpu"))
    ddp = validation_ppl(fit(tmp_path, "ddp", devices=2, seed=1, accelerator="gpu"))
    assert abs(ddp - single) / single < TOLERANCE, (ddp, single)


# ------------------------------------------------------------------------------------------------------------------
# Each test below fails if its path silently falls back: to float16 under bf16, to the per-step loop where the fused
# kernel applies, to the CPU, or to a deterministic model where dropout should sample.


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize("name", FUSED)
def test_the_fused_layers_compute_in_the_autocast_dtype_on_cuda(name: str, mode: str) -> None:
    """autocast's own wrapper for cuDNN's RNNs would run them in float16 under bf16 (zoo/layers.py's module doc)."""
    from tests.precision_checks import AUTOCAST_MODES, fused_layer_dtypes

    if mode == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    ran = fused_layer_dtypes(name, mode, device="cuda")
    expected = AUTOCAST_MODES[mode]
    assert ran["fused_calls"] == 2, "each layer ran its fused kernel"
    assert ran["products"] == [{expected}, {expected}], ran["products"]
    assert ran["output"] == expected
    assert ran["state"] == {torch.float32} and ran["gradients"] == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", zoo.names())
def test_every_architecture_computes_in_the_autocast_dtype_on_cuda(name: str, dtype: torch.dtype) -> None:
    """The CPU test's checks on CUDA: the per-step loops (state dropout and a mid-window reset force them) in the
    autocast dtype, the hand-written window kernels in float32, results close to float32."""
    from tests.precision_checks import check_architecture_under_autocast

    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    check_architecture_under_autocast(name, dtype, fast=True, device="cuda")


@pytest.mark.parametrize("name", FUSED)
def test_windows_with_resets_take_the_packed_kernel_on_cuda(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GBW's windows, with a sentence ending inside nearly every one, run cuDNN's packed kernel on CUDA (not the
    per-step loop), and it computes what the plain reference path computes."""
    from zoo import settings

    stack, size = tiny_stack(name)
    stack.cuda()
    x = torch.randn(3, 8, size, device="cuda")
    reset = torch.zeros(3, 8, dtype=torch.bool, device="cuda")
    reset[0, 3] = reset[2, 5] = reset[2, 6] = True
    with settings.overridden(plain_kernels=True):
        plain = [t.clone() for t in _pass(stack, x, reset)]
    packed = []
    for layer in stack.layers:
        monkeypatch.setattr(layer, "step", lambda *args: pytest.fail("the per-step loop ran where cuDNN applies"))
        original = layer._segments
        monkeypatch.setattr(
            layer, "_segments", lambda *args, run=original, **kwargs: packed.append(1) or run(*args, **kwargs)
        )
    fast = _pass(stack, x, reset)
    assert len(packed) == len(stack.layers), "every layer took the packed kernel"
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("regulariser", ["weight_drop", "state_dropout"])
@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_recurrent_regularisers_on_cuda_equal_the_plain_path(name: str, regulariser: str) -> None:
    """Weight-drop (through functional_call into the fused kernel) and state dropout (the per-step loop) on CUDA: the
    same masks give what the plain path computes, and the masks are really drawn (training differs from eval)."""
    from zoo import settings

    options = dict(zoo.preset(name, "tiny"))
    size, hidden = options.pop("input_size"), options.pop("hidden_size")
    options.pop("num_layers")
    torch.manual_seed(0)
    stack = zoo.build(name, size, hidden, 2, **{regulariser: 0.3}, **options).cuda().train()
    x = torch.randn(3, 8, size, device="cuda")
    torch.manual_seed(1)
    with fused_kernel_calls() as fused_calls:
        fast = [t.clone() for t in _pass(stack, x, None)]
    with settings.overridden(plain_kernels=True):
        torch.manual_seed(1)
        plain = [t.clone() for t in _pass(stack, x, None)]
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    # weight-drop keeps the fused kernel; state dropout (a mask on h_{t-1} inside the recurrence) cannot use it.
    assert len(fused_calls) == (2 if regulariser == "weight_drop" else 0)
    with torch.no_grad():  # cuDNN has no RNN backward in eval mode (the first GPU run failed here: the test's own pass)
        deterministic = stack.eval()(x)[0]
    assert not torch.allclose(fast[0], deterministic, atol=1e-3), "the regulariser drew no mask"


@pytest.mark.parametrize("head", ["nce", "sampled_softmax"])
def test_sampled_heads_train_with_sparse_gradients_on_cuda(head: str) -> None:
    from datamodules.windows import LMBatch
    from lightning_modules import LanguageModel
    from lightning_modules.sparse_gradients import clip_grad_norm

    torch.manual_seed(0)
    vocab = 60
    model = LanguageModel(
        vocab_size=vocab, embedding_size=8, hidden_size=8, num_layers=1, head=head, noise_samples=5,
        sparse_gradients=True,
    )  # fmt: skip
    model.model.set_noise_distribution(torch.arange(vocab, 0, -1))
    model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, vocab, (3, 11), device="cuda")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    total, count, _, _ = model._window(LMBatch(ids[:, :-1], ids[:, 1:]), "train")
    (total / count).backward()
    gradient = model.model.embedding.weight.grad
    assert gradient.is_sparse and gradient.device.type == "cuda"
    clip_grad_norm(list(model.parameters()), 0.25)
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {"model.embedding.weight", "model.decoder.weight"} <= changed, changed
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_mixed_precision_fit_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    """Lightning's mixed precision on CUDA: the fused LSTM in the autocast dtype, a gradient scaler with 16-mixed and
    none with bf16-mixed, and the loss falls (a scaler that skipped every step would leave it where it was)."""
    from tests.precision_checks import tiny_mixed_fit

    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    _, ran, trainer = tiny_mixed_fit(tmp_path, precision, "lstm", accelerator="gpu")
    expected = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    assert ran.products("stack") == {expected}, ran.ran["stack"]
    assert expected in ran.products("outside"), ran.ran["outside"]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    assert (scaler is not None) == (precision == "16-mixed")


def test_mc_dropout_samples_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datamodules import TextDataModule
    from evaluation.mc_dropout import MCDropout
    from evaluation.perplexity import evaluate
    from tests.conftest import write_word_corpus
    from zoo import RecurrentLM

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    data = TextDataModule(str(write_word_corpus(tmp_path / "corpus", "mc")), batch_size=4, bptt=6)
    data.prepare_data()
    torch.manual_seed(0)
    model = RecurrentLM(vocab_size=data.vocab_size, embedding_size=8, hidden_size=8, architecture="lstm", dropout=0.4)
    devices = set()
    model.rnn.register_forward_pre_hook(lambda m, args: devices.add(args[0].device.type))
    deterministic = evaluate(model, data, "test", device="cuda").loss
    unscaled = evaluate(model, data, "test", device="cuda", procedure=MCDropout(samples=4, dropout_scale=0)).loss
    sampled = evaluate(model, data, "test", device="cuda", procedure=MCDropout(samples=4)).loss
    assert devices == {"cuda"}
    assert unscaled == pytest.approx(deterministic, rel=1e-4), "scale 0 is the deterministic model"
    assert sampled != pytest.approx(deterministic, rel=1e-4), "MC dropout drew no mask"


def test_the_adaptive_head_on_cuda_equals_cpu() -> None:
    from datamodules.windows import LMBatch
    from lightning_modules import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(
        vocab_size=60, embedding_size=16, hidden_size=16, num_layers=1, head="adaptive", adaptive_cutoffs=[10, 30],
        adaptive_div_value=2.0,
    )  # fmt: skip
    ids = torch.randint(0, 60, (3, 11))
    results = []
    for device in ("cpu", "cuda"):
        model.to(device).zero_grad()
        model._state["train"] = None
        batch = LMBatch(ids[:, :-1].to(device), ids[:, 1:].to(device))
        total, count, _, _ = model._window(batch, "train")
        (total / count).backward()
        assert total.device.type == device
        # Copies: a CPU tensor's .cpu() is itself, and model.to("cuda") then moves the gradients it holds in place.
        grads = [p.grad.cpu().clone() for p in model.parameters() if p.grad is not None]
        results.append([total.detach().cpu().clone(), *grads])
    for on_gpu, on_cpu in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(on_gpu, on_cpu, atol=1e-4, rtol=1e-3)


# ------------------------------------------------------------------------------- captured windows (zoo/window.py)
CAPTURED = [name for name in zoo.names() if name not in FUSED]
PATHS = ("graph", "direct")  # lm-zoo's training step, captured and not


def _window_pass(stack: torch.nn.Module, x: torch.Tensor, state: tuple, reset: torch.Tensor | None) -> list:
    stack.zero_grad()
    x = x.detach().requires_grad_()  # as an embedding's output: the window's input needs its gradient
    y, final = stack(x, state, reset=reset)
    loss = y.sin().sum() + sum(s.cos().sum() for s in final)
    extra = stack.regularization_loss()
    (loss if extra is None else loss + extra).backward()
    # Values only: a result that kept its autograd graph alive would keep the parameters' gradient accumulators made
    # on the default stream, which a later capture (on its own stream) must not meet.
    return [
        t.detach().clone() for t in (y, *final, x.grad, *(p.grad for p in stack.parameters() if p.grad is not None))
    ]


@pytest.mark.parametrize("name", [*CAPTURED, "skip_lstm+budget"])
def test_a_captured_window_equals_the_plain_path_on_cuda(name: str) -> None:
    """Outputs, final state and every gradient, through the graph and through the plain per-step path, for the window
    that was captured and for later replays on other values, with and without resets; and nothing fell back."""
    from zoo import settings

    architecture, _, budget = name.partition("+")
    stack, size = tiny_stack(architecture)
    if budget:  # Skip RNN's budget loss: a term the graph returns beside the window's outputs
        stack = zoo.build("skip_lstm", size, size, 2, budget_weight=0.5)
    stack.cuda().train()
    reset = torch.zeros(3, 8, dtype=torch.bool, device="cuda")
    reset[1, 5] = reset[2, 0] = True
    for window_reset in (None, reset, reset.roll(1, 1)):
        for _ in range(2):
            x = torch.randn(3, 8, size, device="cuda")
            state = tuple(torch.randn_like(s) for s in stack.initial_state(3, x))
            with settings.overridden(window_graphs=False):
                plain = _window_pass(stack, x, state, window_reset)
            graphed = _window_pass(stack, x, state, window_reset)
            assert len(plain) == len(graphed)
            for a, b in zip(plain, graphed, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    graphs = stack._window_graphs()
    assert not graphs.failed
    assert len(graphs.graphs) == 2  # without resets, with them (any pattern: one graph)


def test_dropout_in_a_captured_window_draws_new_masks_at_each_replay() -> None:
    stack = zoo.build("mogrifier", 16, 16, 2, rounds=5, dropout=0.5, state_dropout=0.3, weight_drop=0.3).cuda().train()
    x = torch.randn(4, 6, 16, device="cuda", requires_grad=True)
    outputs = [stack(x)[0].detach().clone() for _ in range(3)]
    assert len(stack._window_graphs().graphs) == 1
    assert not torch.equal(outputs[1], outputs[2])
    with torch.no_grad():
        stack.eval()
        assert torch.equal(stack(x)[0], stack(x)[0])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_fit_of_a_per_step_cell_runs_captured_windows_on_cuda(tmp_path: Path, precision: str) -> None:
    """Lightning's automatic optimization around the graphed window: the loss falls, every window after the first of
    its shape was a replay, and no capture failed."""
    from tests.precision_checks import tiny_mixed_fit

    _, ran, trainer = tiny_mixed_fit(tmp_path, precision, "mogrifier", accelerator="gpu", rounds=3)
    graphs = trainer.lightning_module.model.rnn._window_graphs()
    assert not graphs.failed
    assert 1 <= len(graphs.graphs) <= 2  # the data module's last, shorter window may be a second shape
    print(f"{precision}: captured in {graphs.capture_seconds} s")


@pytest.mark.parametrize("name", ["lstm", "mogrifier", "on_lstm", "skip_lstm"])
def test_the_captured_sampling_step_equals_the_same_step_run_eagerly_on_cuda(name: str) -> None:
    """``generate`` on CUDA (zoo/sampling.py: one captured step a token) draws the ids the same step draws run
    eagerly with the same seed, with top-k and a stop id; the capture did not fall back (it would warn); and with
    top-k 1 both equal the plain path's."""
    import warnings

    from zoo import sampling

    torch.manual_seed(0)
    model = zoo.RecurrentLM(50, name, 16, 16, num_layers=2).cuda().eval()
    prompt = torch.randint(50, (3, 5), device="cuda")

    def eager(tokens: int, **options) -> list[list[int]]:
        with torch.no_grad():
            logits, state = model(prompt)
            step = model._sampling_step(prompt)
            return sampling.sample(step, logits[:, -1], state, tokens, capture=False, **options)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a capture that fell back warns
        for options in ({}, {"temperature": 0.7, "top_k": 10}, {"stop_id": 3}):
            captured = model.generate(prompt, 80, generator=torch.Generator().manual_seed(7), **options)
            assert captured == eager(80, generator=torch.Generator().manual_seed(7), **options), options
        greedy = model.generate(prompt, 40, top_k=1)
    from zoo import settings

    with settings.overridden(window_graphs=False):  # the plain path: CPU multinomial, a wait per token
        assert model.generate(prompt, 40, top_k=1) == greedy


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "adam"])
@pytest.mark.parametrize("architecture", ["lstm", "mogrifier"])
def test_the_captured_training_step_equals_the_uncaptured_one_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, architecture: str, optimizer: str
) -> None:
    """lm-zoo's whole training step replayed from CUDA graphs against the same step run uncaptured, over 50 steps of
    a fit (no dropout: a replay draws its masks at other offsets of the generator): the same losses and weights within
    float tolerance, every step after the warm-up a replay, no capture refused."""
    import warnings

    from lightning_modules.training_step import WARMUP_STEPS
    from tests.test_training_step import OPTIMIZERS, _fit

    options = {"dropout": 0.0, "ar": 1.0, "tar": 1.0}
    fits = {}
    for path in ("graph", "direct"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*could not be captured")
            fits[path] = _fit(
                tmp_path / path, path, monkeypatch, steps=50, optimizer=OPTIMIZERS[optimizer], stand_in=False,
                model_options={**options, "architecture": architecture}, accelerator="gpu", devices=1,
            )  # fmt: skip
    runner = fits["graph"]["runner"]
    assert runner["captures"] and not runner["failed"]
    assert runner["replays"] == len(fits["graph"]["losses"]) - WARMUP_STEPS
    assert fits["graph"]["losses"] == pytest.approx(fits["direct"]["losses"], rel=1e-4, abs=1e-5)
    graph, direct = fits["graph"]["model"].state_dict(), fits["direct"]["model"].state_dict()
    for name, weights in graph.items():
        torch.testing.assert_close(weights, direct[name], rtol=1e-4, atol=1e-5, msg=name)


def test_skip_rnns_update_fraction_after_each_replay_is_the_replayed_windows_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skip RNN keeps its gates from the last forward (``last_updates``), which a replay does not run: the captured
    step logs the update fraction from the graph's output, so each of 30 steps logs its own window's, as the
    uncaptured step does, and no capture was refused."""
    from tests.test_training_step import _fit

    skipping = {"architecture": "skip_lstm", "dropout": 0.0, "cell_options": {"update_bias": 0.0}}
    options = {"model_options": skipping, "accelerator": "gpu", "devices": 1}
    fits = {path: _fit(tmp_path / path, path, monkeypatch, steps=30, stand_in=False, **options) for path in PATHS}
    assert fits["graph"]["runner"]["replays"] and not fits["graph"]["runner"]["failed"]
    fractions = {path: [f["train_update_fraction"] for f in fitted["figures"]] for path, fitted in fits.items()}
    assert fractions["graph"] == pytest.approx(fractions["direct"], rel=1e-4, abs=1e-5)
    assert len(set(fractions["graph"])) > 3


def test_weight_drop_keeps_one_captured_step_per_window_shape_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWD-LSTM's weight drop on cuDNN's kernel: the layers' parameters keep their storage (zoo.layers.rnn_kernel), so
    the captured step holds one graph per window shape, where an H200 run at 522b546 captured anew at every step until
    it held 16."""
    from tests.test_training_step import _fit

    options = {"model_options": {"cell_options": {"weight_drop": 0.5}}, "accelerator": "gpu", "devices": 1}
    fitted = _fit(tmp_path, "graph", monkeypatch, epochs=2, stand_in=False, **options)
    assert fitted["runner"]["captured_for"] == {"a new window shape": len(set(fitted["shapes"]))}


def test_several_windows_a_step_replay_as_one_window_a_step_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``windows_per_step`` 4 on the captured step: every window after the warm-up a replay, several of one graph in a
    step (each window's figures taken before the next replay overwrites them), and the same losses and weights as the
    uncaptured step trained one window a step."""
    from lightning_modules.training_step import WARMUP_STEPS
    from tests.test_training_step import _fit

    options = {"model_options": {"dropout": 0.0, "architecture": "lstm"}, "accelerator": "gpu", "devices": 1}
    grouped = _fit(tmp_path / "graph", "graph", monkeypatch, steps=12, stand_in=False, windows_per_step=4, **options)
    single = _fit(tmp_path / "direct", "direct", monkeypatch, steps=48, stand_in=False, **options)
    assert grouped["shapes"] == single["shapes"]
    assert grouped["runner"]["replays"] == 48 - WARMUP_STEPS and not grouped["runner"]["failed"]
    assert grouped["losses"] == pytest.approx(single["losses"][3::4], rel=1e-4, abs=1e-5)
    expected = single["model"].state_dict()
    for name, weights in grouped["model"].state_dict().items():
        torch.testing.assert_close(weights, expected[name], rtol=1e-4, atol=1e-5, msg=name)
