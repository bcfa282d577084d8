"""The matmul fast paths of zoo.kernels against the plain PyTorch expressions they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zoo import kernels
from zoo.kernels import RecurrentMatmul, window_linear


@pytest.mark.parametrize("onednn", [False, True])
def test_window_linear_equals_linear_with_gradients(onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if onednn and not kernels._use_onednn(torch.ones(1)):
        pytest.skip("this PyTorch build has no working oneDNN packed linear")
    if not onednn:  # the plain route (GPU, float64, builds without oneDNN)
        monkeypatch.setattr(kernels, "_use_onednn", lambda x: False)
    _check_window_linear(with_bias=True)
    _check_window_linear(with_bias=False)


def _check_window_linear(with_bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, requires_grad=True)
    w = torch.randn(11, 7, requires_grad=True)
    b = torch.randn(11, requires_grad=True) if with_bias else None
    leaves = (x, w, b) if with_bias else (x, w)
    grad = torch.randn(3, 5, 11)
    expected = F.linear(x, w, b)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    got = window_linear(x, w, b)
    torch.testing.assert_close(got, expected)
    assert all(step.is_contiguous() for step in got.unbind(1))  # what the per-step loop reads
    for g, e in zip(torch.autograd.grad(got, leaves, grad), expected_grads):
        torch.testing.assert_close(g, e)


def _recurrence(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, add: str, deferred: bool) -> torch.Tensor:
    """h_t = tanh(x_t + h_{t-1} W^T + b), with the recurrent product done plainly or by RecurrentMatmul.

    ``add`` says what RecurrentMatmul adds inside its product: ``"step"`` the step's ``x_t + b`` ``(B, O)``,
    ``"bias"`` the vector ``b`` ``(O,)`` (then ``x_t`` is added outside), ``"none"`` nothing.
    """
    matmul = RecurrentMatmul(weight, x.size(0), x.size(1)) if deferred else None
    h = x.new_zeros(x.size(0), weight.size(1))
    outputs = []
    for x_t in x.unbind(1):
        if matmul is None:
            pre = x_t + h @ weight.t() + bias
        elif add == "step":
            pre = matmul(h, add=x_t + bias)
        elif add == "bias":
            pre = x_t + matmul(h, add=bias)
        else:
            pre = x_t + matmul(h) + bias
        h = torch.tanh(pre)
        outputs.append(h)
    return torch.stack(outputs, 1)


@pytest.mark.parametrize("add", ["step", "bias", "none"])
@pytest.mark.parametrize("onednn", [False, True])
def test_recurrent_matmul_matches_autograd_values_and_gradients(
    onednn: bool, add: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if onednn:  # the per-step oneDNN product, which normally starts at large weights and needs two threads
        if not kernels._packed_linear_works():
            pytest.skip("this PyTorch build has no working oneDNN packed linear")
        monkeypatch.setattr(kernels, "ONEDNN_STEP_MIN_WEIGHT", 0)
        monkeypatch.setattr(kernels, "_use_onednn", lambda x: x.dtype == torch.float32)
    torch.manual_seed(1)
    raw = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(2, 7, 6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    grad = torch.randn(2, 7, 6)
    leaves = (raw, x, bias)
    expected = _recurrence(raw * 0.5, x, bias, add, deferred=False)  # a non-leaf weight, as with weight drop
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    got = _recurrence(raw * 0.5, x, bias, add, deferred=True)
    assert (RecurrentMatmul(raw, 2, 7)._packed is not None) == onednn
    torch.testing.assert_close(got, expected)
    for g, e in zip(torch.autograd.grad(got, leaves, grad), expected_grads):
        torch.testing.assert_close(g, e)
    with torch.no_grad():
        torch.testing.assert_close(_recurrence(raw * 0.5, x, bias, add, deferred=True), expected)


def test_recurrent_matmul_must_be_called_once_per_step() -> None:
    weight = torch.randn(4, 4, requires_grad=True)
    matmul = RecurrentMatmul(weight, 2, 3)
    y = matmul(torch.randn(2, 4)) + matmul(torch.randn(2, 4))  # two of three steps
    with pytest.raises(RuntimeError, match="called 2 times in a window of 3 steps"):
        y.sum().backward()
