"""``zoo.paths``: the one place that picks how a window runs, each choice pinned; the stack, its layers and the
capture follow it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import zoo
from zoo import paths, settings

CPU, CUDA = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(device=torch.device("cuda"))


def _path(architecture: str, x: SimpleNamespace, *, training: bool, resets: bool = False, **options) -> tuple:
    stack = zoo.build(architecture, 4, 4, 2, **options).train(training)
    with torch.set_grad_enabled(training):
        chosen = paths.window_path(stack, x, resets=resets)
    return chosen.stack, chosen.layers


FUSED, PER_STEP, PACKED = ("fused", "fused"), ("per-step", "per-step"), ("packed", "packed")


@pytest.mark.parametrize(
    ("case", "architecture", "x", "training", "resets", "options", "expected"),
    [
        ("inference on the CPU: one multi-layer call", "lstm", CPU, False, False, {}, ("merged", FUSED)),
        ("... but not over resets", "lstm", CPU, False, True, {}, ("layers", PER_STEP)),
        (
            "... nor summing the layers' outputs",
            "lstm",
            CPU,
            False,
            False,
            {"sum_layer_outputs": True},
            ("layers", FUSED),
        ),
        ("training on the CPU: cuDNN's or oneDNN's kernel", "lstm", CPU, True, False, {}, ("layers", FUSED)),
        ("training on CUDA: already one kernel a window", "lstm", CUDA, True, False, {}, ("layers", FUSED)),
        ("resets on CUDA: packed segments", "lstm", CUDA, True, True, {}, ("layers", PACKED)),
        (
            "state dropout: the loop, captured",
            "lstm",
            CUDA,
            True,
            False,
            {"state_dropout": 0.1},
            ("captured", PER_STEP),
        ),
        ("the loop asked for: captured", "lstm", CUDA, True, False, {"fused": False}, ("captured", PER_STEP)),
        ("a per-step cell on CUDA: captured", "mogrifier", CUDA, True, False, {}, ("captured", PER_STEP)),
        ("... with resets too (a keep mask each step)", "mogrifier", CUDA, True, True, {}, ("captured", PER_STEP)),
        ("a per-step cell on the CPU", "mogrifier", CPU, True, False, {}, ("layers", PER_STEP)),
        ("a per-step cell in inference", "mogrifier", CPU, False, False, {}, ("layers", PER_STEP)),
    ],
)
def test_each_window_path(case: str, architecture: str, x, training: bool, resets: bool, options, expected) -> None:
    assert _path(architecture, x, training=training, resets=resets, **options) == expected, case


def test_the_switches_and_an_int8_layer() -> None:
    with settings.overridden(plain_kernels=True):  # the reference path: every layer's loop, nothing captured
        assert _path("lstm", CPU, training=False) == ("layers", PER_STEP)
        assert _path("mogrifier", CUDA, training=True) == ("layers", PER_STEP)
    with settings.overridden(window_graphs=False):
        assert _path("mogrifier", CUDA, training=True) == ("layers", PER_STEP)
    stack = zoo.build("lstm", 4, 4, 2).eval()
    for layer in stack.layers:
        layer.int8 = True  # what zoo.quantization.quantize_int8 sets: no float weights for a loop
    with torch.no_grad():
        assert paths.window_path(stack, CPU, resets=True).layers == PACKED
        assert paths.window_path(stack, CPU, resets=False).layers == FUSED


def test_a_fused_layer_runs_the_path_it_is_given() -> None:
    """The layer follows layer_path: with a state-dropout mask it runs its loop (the same numbers as a loop layer's),
    without one its kernel."""
    torch.manual_seed(0)
    fused = zoo.build("lstm", 4, 4, 1).layers[0]
    loop = zoo.build("lstm", 4, 4, 1, fused=False).layers[0]
    loop.load_state_dict(fused.state_dict())
    x, state = torch.randn(2, 5, 4), (torch.zeros(2, 4), torch.zeros(2, 4))
    mask = torch.ones(2, 4)
    assert paths.layer_path(fused, x, resets=False, state_dropout=True) == "per-step"
    y, _ = fused(x, state, {}, mask)
    expected, _ = loop(x, state, {}, mask)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(fused(x, state, {})[0], expected, rtol=1e-6, atol=1e-6)
