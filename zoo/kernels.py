"""Fast paths for the matmuls of the per-step loops, measured in ``benchmarks/cells.py``.

A custom cell spends its time in two kinds of matmul: the input projection, one GEMM over every step of the window
(``hoist``), and the recurrent matmuls, one small GEMM per step. On CPU, PyTorch sends fp32 ``F.linear`` to MKL, while
the fused ``nn.LSTM`` and convolutions go through oneDNN. On the AMD EPYC machines this project is developed and tested
on, MKL runs its AVX2 code path and oneDNN its AVX-512 one, and MKL repacks the weight at every call. Measured there
(2 threads): the window GEMM (700 x 650 by 650 x 2600) takes 13 ms as ``linear`` and 6.5 ms as a 1-wide
convolution; the step product (20 x 650 by 650 x 2600) 0.60 ms with ``addmm`` and 0.27 ms with oneDNN's linear on a
weight reordered once per window. The numbers are exact fp32 either way; only the kernel differs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _use_onednn(x: Tensor) -> bool:
    # With one thread PyTorch sends a batch-1 convolution to its slow reference kernel instead of oneDNN.
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.get_num_threads() > 1
    )


def window_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for a whole window at once, through oneDNN on CPU.

    Args:
        x: ``(B, T, I)``.
        weight: ``(O, I)``.
        bias: ``(O,)`` or ``None``.

    Returns:
        ``(B, T, O)``, laid out time-major in memory so that each step's slice ``[:, t]`` is contiguous (the per-step
        loop reads it T times; a strided slice would be copied at every step).
    """
    time_major = x.transpose(0, 1)  # (T, B, I)
    if not _use_onednn(x):
        return F.linear(time_major, weight, bias).transpose(0, 1)  # (B, T, O) view of (T, B, O)
    steps, batch, _ = time_major.shape
    # A kernel-1 convolution over a single "sequence" whose length is every (t, b) position is exactly one GEMM.
    rows = time_major.reshape(steps * batch, -1).t().unsqueeze(0)  # (1, I, T*B)
    y = F.conv1d(rows, weight.unsqueeze(2), bias)  # (1, O, T*B)
    return y.squeeze(0).t().contiguous().view(steps, batch, -1).transpose(0, 1)  # (B, T, O) view of (T, B, O)


def _gemm_tn(a: Tensor, b: Tensor) -> Tensor:
    """``a.T @ b`` for ``a: (N, O)``, ``b: (N, I)``, through oneDNN on CPU (see the module doc)."""
    if not _use_onednn(a):
        return a.t() @ b
    # conv1d over a "sequence" of length I with N input channels: out[o, i] = sum_n a[n, o] * b[n, i].
    return F.conv1d(b.unsqueeze(0), a.t().unsqueeze(2)).squeeze(0)  # (O, I)


#: Weights at least this large take the oneDNN per-step product (below it MKL's packing overhead is negligible).
ONEDNN_STEP_MIN_WEIGHT = 65_536


@functools.cache
def _onednn_step_product_works() -> bool:
    """Whether oneDNN's linear (a private PyTorch op) exists and computes ``x @ W.T`` in this PyTorch build.

    ``torch._C._nn.mkldnn_linear`` is not public API, so it is feature-tested once: if a PyTorch release renames or
    changes it, the per-step product quietly falls back to ``addmm`` (same numbers, MKL's speed).
    """
    try:
        x, w = torch.randn(3, 5), torch.randn(4, 5)
        y = torch._C._nn.mkldnn_linear(x.to_mkldnn(), w.to_mkldnn(), None).to_dense()
        return bool(torch.allclose(y, x @ w.t(), atol=1e-5))
    except (AttributeError, RuntimeError, TypeError):
        return False


class _OneDNNStepProduct(torch.autograd.Function):
    """``inp @ W.T`` for one step through oneDNN, with weights reordered once per window.

    MKL repacks the weight matrix at every small GEMM; for the per-step products of a recurrent cell (a few rows, a
    large weight) that packing is most of the cost. oneDNN takes the weight in its own layout, converted once per
    window, in both directions (``W`` for the product, ``W.T`` for the input's gradient).
    """

    @staticmethod
    def forward(ctx: Any, inp: Tensor, weight: Tensor, weight_t: Tensor) -> Tensor:
        ctx.weight_t = weight_t
        return torch._C._nn.mkldnn_linear(inp.contiguous().to_mkldnn(), weight, None).to_dense()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return torch._C._nn.mkldnn_linear(grad.contiguous().to_mkldnn(), ctx.weight_t, None).to_dense(), None, None


class _WindowWeightGrad(torch.autograd.Function):
    """A zero tensor whose backward turns the per-step output gradients into the weight's gradient in one GEMM."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, weight: Tensor, matmul: RecurrentMatmul, shape: tuple
    ) -> Tensor:
        ctx.matmul = matmul
        return weight.new_zeros(shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        inputs = torch.stack(ctx.matmul.inputs, dim=1)  # (B, T, I)
        if inputs.size(1) != grad.size(1):
            raise RuntimeError(f"RecurrentMatmul was called {inputs.size(1)} times in a window of {grad.size(1)} steps")
        ctx.matmul.inputs = []  # release the window's inputs once they have been used
        return _gemm_tn(grad.flatten(0, 1), inputs.flatten(0, 1)), None, None


class RecurrentMatmul:
    """``inp_t @ weight.T`` once per step of a window, with the weight's gradient computed once for the window.

    Left to autograd, a per-step matmul computes ``dW_t = g_t^T inp_t`` at every step of the backward pass (a GEMM
    each, then an accumulation into ``W.grad``), although BPTT needs only the sum ``G^T X`` over the window: one GEMM.
    So the per-step products use a detached weight (their backward computes the input's gradient only) and add a
    zero-valued tensor built by :class:`_WindowWeightGrad`, whose backward receives every ``g_t`` at once. This halves
    the GEMMs of the backward loop (``benchmarks/cells.py --loop``).

    Create one per weight and window, and call it exactly once per step, in order.

    Args:
        weight: ``(O, I)``; may be a non-leaf tensor (e.g. weight-dropped), its gradient flows back as usual.
        batch: ``B``.
        steps: ``T``, the number of calls to expect.
    """

    def __init__(self, weight: Tensor, batch: int, steps: int) -> None:
        self.weight_t = weight.detach().t()  # (I, O)
        self.inputs: list[Tensor] = []
        self._onednn: tuple[Tensor, Tensor] | None = None
        if _use_onednn(weight) and weight.numel() >= ONEDNN_STEP_MIN_WEIGHT and _onednn_step_product_works():
            detached = weight.detach()
            self._onednn = (detached.contiguous().to_mkldnn(), detached.t().contiguous().to_mkldnn())
        self._offsets: tuple[Tensor, ...] | None = None
        if torch.is_grad_enabled() and weight.requires_grad:
            zero = _WindowWeightGrad.apply(weight, self, (batch, steps, weight.size(0)))  # (B, T, O)
            self._offsets = zero.unbind(1)

    def __call__(self, inp: Tensor, add: Tensor | None = None) -> Tensor:
        """``add + inp @ weight.T`` for the next step.

        Args:
            inp: ``(B, I)``.
            add: ``(B, O)`` added to the product (e.g. the step's hoisted input projection), or ``None``.
        """
        if self._offsets is not None:
            offset = self._offsets[len(self.inputs)]
            self.inputs.append(inp.detach())  # the values, for the window GEMM; autograd saves nothing for W here
            add = offset if add is None else add + offset
        if self._onednn is not None:
            product = _OneDNNStepProduct.apply(inp, *self._onednn)  # (B, O)
            return product if add is None else product + add
        return torch.addmm(add, inp, self.weight_t) if add is not None else inp @ self.weight_t
