"""``--quantize int8`` (zoo.quantization): the int8 network is PyTorch's dynamic quantization of the same weights,
stays close to the float model, runs windows with resets, leaves the float model alone, and refuses in one line what it
does not apply to."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.ao.quantization import quantize_dynamic

import checkpoints
import cli
from checkpoints import registry
from commands.common import quantize_model
from tests.conftest import needs_data
from zoo import RecurrentLM
from zoo.errors import ConfigError
from zoo.quantization import Int8SoftmaxHead, quantize_int8

ENTRIES = registry.load_registry(registry.DEFAULT_PATH)
# The reference path below calls torch.ao's quantize_dynamic itself, which warns that torchao will replace it.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _model(architecture: str = "lstm", head: str = "softmax", seed: int = 0, tie_weights: bool = False) -> RecurrentLM:
    torch.manual_seed(seed)
    return RecurrentLM(50, architecture, 16, 24, 2, head=head, tie_weights=tie_weights).eval()


def _ids(batch: int = 3, steps: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(50, (batch, steps), generator=torch.Generator().manual_seed(seed))  # (B, T)


def test_the_int8_network_is_torchs_dynamic_quantization_of_the_same_weights() -> None:
    """The same numbers as quantize_dynamic applied to a plain embedding -> nn.LSTM -> nn.LSTM -> nn.Linear built here
    from the model's state dict: lm-zoo adds no arithmetic of its own."""
    model = _model()
    weights = model.state_dict()
    plain = nn.ModuleDict(
        {
            "lstm0": nn.LSTM(16, 24, batch_first=True),
            "lstm1": nn.LSTM(24, 24, batch_first=True),
            "decoder": nn.Linear(24, 50),
        }
    )
    for i in range(2):
        plain[f"lstm{i}"].load_state_dict(
            {k.split(".rnn.")[-1]: v for k, v in weights.items() if k.startswith(f"rnn.layers.{i}.rnn.")}
        )
    plain["decoder"].load_state_dict({"weight": weights["decoder.weight"], "bias": weights["decoder.bias"]})
    plain = quantize_dynamic(plain, {nn.LSTM, nn.Linear}, dtype=torch.qint8)
    ids = _ids()
    with torch.no_grad():
        x = weights["embedding.weight"][ids]  # (B, T, E)
        for i in range(2):
            x, _ = plain[f"lstm{i}"](x)
        expected = plain["decoder"](x)  # (B, T, V)
        logits, _ = quantize_int8(model)(ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("architecture", "head", "tie_weights"),
    [
        ("lstm", "softmax", False),
        ("gru", "softmax", False),
        ("lstm", "adaptive", False),
        # Trained by a sampled objective, scored by the full softmax; tied through a projection (embedding 16 < 24).
        ("lstm", "sampled_softmax", True),
        ("lstm", "nce", False),
    ],
)
def test_int8_log_probabilities_stay_close_to_the_float_models(architecture: str, head: str, tie_weights: bool) -> None:
    model = _model(architecture, head, tie_weights=tie_weights)
    quantized = quantize_int8(model)
    assert all(layer.int8 for layer in quantized.rnn.layers) and not any(layer.int8 for layer in model.rnn.layers)
    ids = _ids()
    with torch.no_grad():
        exact = model.token_nll(ids[:, :-1], ids[:, 1:])[0]  # (B, T) nats
        approx = quantized.token_nll(ids[:, :-1], ids[:, 1:])[0]
    assert not torch.equal(exact, approx)  # it did run in int8
    torch.testing.assert_close(approx, exact, rtol=0.02, atol=0.02)


def test_the_int8_head_scores_targets_as_its_logits_say_at_any_temperature() -> None:
    """Rows scored in one call give exactly the log-softmax of that call's logits. Scored a few rows at a time (a
    small ``chunk_logits``), each call quantizes its own rows with their own scale, so the figures move a little."""
    head = quantize_int8(_model()).decoder
    assert isinstance(head, Int8SoftmaxHead)
    h = torch.randn(2, 5, 24)  # (B, T, H): the untied head reads the hidden width
    targets = _ids(2, 5)
    targets[0, 2] = -100
    for temperature in (1.0, 0.7):
        expected = -torch.log_softmax(head(h) / temperature, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
        expected = expected.squeeze(-1).masked_fill(targets == -100, 0.0)  # (B, T)
        torch.testing.assert_close(head.token_nll(h, targets, temperature), expected)
        head.chunk_logits = 100  # two rows of 50 logits at a time
        torch.testing.assert_close(head.token_nll(h, targets, temperature), expected, rtol=0.01, atol=0.02)
        head.chunk_logits = 10**6


def test_an_int8_sentence_score_depends_only_slightly_on_its_batch() -> None:
    """int8 quantizes each activation tensor with one scale, so, unlike the float model's, a sentence's score moves
    with the sentences scored beside it: by well under a percent here; batch 1 gives each sentence its own."""
    quantized = quantize_int8(_model())
    rows = [_ids(1, 6, seed)[0].tolist() for seed in range(4)] + [_ids(1, 20, 9)[0].tolist()]
    alone = [quantized.score([row], batch_size=1)[0].sum().item() for row in rows]
    together = [scores.sum().item() for scores in quantized.score(rows, batch_size=len(rows))]
    assert together == pytest.approx(alone, rel=0.01)


def test_a_window_with_resets_runs_the_int8_kernel_on_its_segments() -> None:
    """GBW-style resets inside a window: an int8 layer has no float weights for the per-step loop, so the window runs
    as packed segments; the result stays close to the float model's per-step loop."""
    model = _model()
    reset = torch.zeros(3, 9, dtype=torch.bool)
    reset[0, 4] = reset[2, 6] = True
    ids = _ids()
    with torch.no_grad():
        exact, _ = model(ids, reset=reset)
        approx, _ = quantize_int8(model)(ids, reset=reset)
    torch.testing.assert_close(torch.log_softmax(approx, -1), torch.log_softmax(exact, -1), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("architecture", ["lstm", "mogrifier", "on_lstm"])
def test_int8_head_quantizes_the_output_layer_alone_for_any_cell(architecture: str) -> None:
    """``--quantize int8-head``: the recurrent layers keep their float weights and compute exactly the float model's
    states; only the head is int8, so the logits move a little and the log-probabilities stay close."""
    torch.manual_seed(0)
    model = RecurrentLM(50, architecture, 16, 24, 2).eval()
    quantized = quantize_int8(model, recurrent=False)
    assert isinstance(quantized.decoder, Int8SoftmaxHead)
    assert not any(getattr(layer, "int8", False) for layer in quantized.rnn.layers)
    ids = _ids()
    with torch.no_grad():
        exact_states, _ = model.rnn(model.embedding(ids))  # (B, T, H)
        states, _ = quantized.rnn(quantized.embedding(ids))
        exact = model.token_nll(ids[:, :-1], ids[:, 1:])[0]  # (B, T) nats
        approx = quantized.token_nll(ids[:, :-1], ids[:, 1:])[0]
    torch.testing.assert_close(states, exact_states, rtol=0, atol=0)
    assert not torch.equal(exact, approx)  # the head did run in int8
    torch.testing.assert_close(approx, exact, rtol=0.02, atol=0.02)


def test_the_cli_modes_are_the_quantization_modules() -> None:
    """commands.common keeps its own copy, so that ``--help`` does not import torch; the two must not drift."""
    from commands.common import QUANTIZE_MODES
    from zoo.quantization import MODES

    assert QUANTIZE_MODES == MODES


def test_the_float_model_is_left_as_it_was() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_int8(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.float32 for k in before)


@pytest.mark.parametrize(
    ("architecture", "head", "message"),
    [("on_lstm", "softmax", "ONLSTMLayer"), ("mogrifier", "softmax", "MogrifierLayer"), ("lstm", "mos", "heads")],
)
def test_what_dynamic_quantization_does_not_cover_is_refused_in_one_line(
    architecture: str, head: str, message: str
) -> None:
    torch.manual_seed(0)
    model = RecurrentLM(50, architecture, 16, 24, 1, head=head)
    with pytest.raises(ConfigError, match=message):
        quantize_int8(model)
    if head == "softmax":  # the output layer alone is what --quantize int8-head takes, and the message says so
        with pytest.raises(ConfigError, match="int8-head"):
            quantize_int8(model)
        assert isinstance(quantize_int8(model, recurrent=False).decoder, Int8SoftmaxHead)


def test_int8_runs_on_the_cpu_only() -> None:
    loaded = checkpoints.load("ptb-lstm-small")
    with pytest.raises(ConfigError, match="--device cpu"):
        quantize_model(loaded, "int8", "cuda")


def test_the_cli_refuses_quantizing_a_music_model_or_a_procedure_that_trains(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", "nottingham-gru", "--quantize", "int8", "--device", "cpu", "--out", "x"]) == 2
    assert "text models" in capsys.readouterr().err
    assert cli.main(["evaluate", "ptb-lstm-small", "--quantize", "int8", "--device", "cpu", "--dynamic"]) == 2
    assert "--dynamic" in capsys.readouterr().err


@pytest.mark.slow
@needs_data("ptb", "ptb.test.txt")
def test_the_registered_int8_figure_reproduces(capsys: pytest.CaptureFixture) -> None:
    """ptb-lstm-small's int8 test perplexity at eval batch 1 (benchmarks/quantize.py measured all three); the others'
    are re-measured by make verify-pretrained."""
    expected = ENTRIES["ptb-lstm-small"].int8_results["test"]
    argv = ["evaluate", "ptb-lstm-small", "--quantize", "int8", "--device", "cpu", "--json"]
    assert cli.main([*argv, "--batch-size", str(expected["eval_batch_size"]), "--bptt", str(expected["bptt"])]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["quantize"] == "int8" and measured["tokens"] == expected["tokens"]
    assert measured["ppl"] == pytest.approx(expected["ppl"], rel=1e-4)
    assert measured["ppl"] != pytest.approx(ENTRIES["ptb-lstm-small"].results["test"]["ppl"], rel=1e-4)  # not float


@pytest.mark.slow
@pytest.mark.verify_pretrained
@needs_data()
@pytest.mark.parametrize("name", [name for name, entry in ENTRIES.items() if entry.int8_results])
def test_every_registered_int8_figure_reproduces(name: str, capsys: pytest.CaptureFixture) -> None:
    expected = ENTRIES[name].int8_results["test"]
    argv = ["evaluate", name, "--quantize", "int8", "--device", "cpu", "--json", "--batch-size", "1"]
    assert cli.main([*argv, "--bptt", str(expected["bptt"])]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] == pytest.approx(expected["ppl"], rel=1e-4)
