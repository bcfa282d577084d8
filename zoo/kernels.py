"""Fast paths for the matmuls of the per-step loops, measured in ``benchmarks/cells.py``.

A custom cell spends its time in two kinds of matmul: the input projection, one GEMM over every step of the window
(``hoist``), and the recurrent matmuls, one small GEMM per step. On CPU, PyTorch sends fp32 ``F.linear`` to MKL, while
the fused ``nn.LSTM`` and convolutions go through oneDNN. On the AMD EPYC machines this project is developed and tested
on, MKL runs its AVX2 code path and oneDNN its AVX-512 one, and MKL repacks the weight at every call. Measured there
(2 threads): the window GEMM (700 x 650 by 650 x 2600) takes 13 ms as ``linear`` and 6.5 ms as a 1-wide
convolution; the step product (20 x 650 by 650 x 2600) 0.60 ms with ``addmm`` and 0.20 ms with oneDNN's linear on a
weight reordered into its blocked layout once per window. The numbers are fp32 either way (equal to rounding); only
the kernel differs.
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
def _packed_linear_works() -> bool:
    """Whether oneDNN's packed linear (private PyTorch ops) exists and computes ``x @ W.T + add`` in this build.

    ``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise`` are the ops ``torch.compile`` emits for a
    CPU linear. They are not public API, so they are feature-tested once: if a PyTorch release renames or changes
    them, the per-step product quietly falls back to ``addmm`` (same numbers, MKL's speed).
    """
    try:
        x, w, add, bias = torch.randn(3, 5), torch.randn(4, 5), torch.randn(3, 4), torch.randn(4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
        y = torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, None, "add")
        z = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return bool(torch.allclose(y, x @ w.t() + add, atol=1e-5) and torch.allclose(z, x @ w.t() + bias, atol=1e-5))
    except (AttributeError, RuntimeError, TypeError):
        return False


class _StepProduct(torch.autograd.Function):
    """``inp @ W.T + add`` for one step, as one autograd node; the gradient reaches ``inp``, ``add`` and ``offset``.

    ``offset`` is the step's slice of :class:`_WindowWeightGrad`'s zero tensor. It is not added (it is zero), but it
    receives the step's output gradient, which is how that gradient reaches the window's weight-gradient GEMM. The
    product, the addition and the offset used to be three nodes (and two additions) per step.
    """

    @staticmethod
    def forward(ctx: Any, inp: Tensor, add: Tensor | None, offset: Tensor | None, matmul: RecurrentMatmul) -> Tensor:
        ctx.matmul = matmul
        ctx.add_is_bias = add is not None and add.dim() == 1
        return matmul.product(inp, add)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        need_inp, need_add, need_offset, _ = ctx.needs_input_grad
        grad_inp = ctx.matmul.input_grad(grad) if need_inp else None
        grad_add = (grad.sum(0) if ctx.add_is_bias else grad) if need_add else None
        return grad_inp, grad_add, grad if need_offset else None, None


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
    So the per-step products use a detached weight (their backward computes the input's gradient only) and pass on
    their output gradient to a zero-valued tensor built by :class:`_WindowWeightGrad`, whose backward receives every
    ``g_t`` at once. This halves the GEMMs of the backward loop (``benchmarks/cells.py --loop``).

    Create one per weight and window, and call it exactly once per step, in order.

    Args:
        weight: ``(O, I)``; may be a non-leaf tensor (e.g. weight-dropped), its gradient flows back as usual.
        batch: ``B``.
        steps: ``T``, the number of calls to expect.
    """

    def __init__(self, weight: Tensor, batch: int, steps: int) -> None:
        detached = weight.detach()
        self.weight = detached  # (O, I)
        self.inputs: list[Tensor] = []
        self._packed: tuple[Tensor, Tensor] | None = None
        if _use_onednn(weight) and weight.numel() >= ONEDNN_STEP_MIN_WEIGHT and _packed_linear_works():
            # oneDNN's blocked layout for this batch size, once per window, in both directions (W for the product,
            # W.T for the input's gradient). Measured (2 threads, 20 x 650 by 650 x 2600): 0.20 ms per product,
            # against 0.34 ms with the plain layout of to_mkldnn() and its input/output conversions, 0.62 ms addmm.
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self._packed = (reorder(detached, batch), reorder(detached.t().contiguous(), batch))
        self._offsets: tuple[Tensor, ...] | None = None
        if torch.is_grad_enabled() and weight.requires_grad:
            zero = _WindowWeightGrad.apply(weight, self, (batch, steps, weight.size(0)))  # (B, T, O)
            self._offsets = zero.unbind(1)

    def product(self, inp: Tensor, add: Tensor | None = None) -> Tensor:
        """``add + inp @ weight.T`` without autograd; ``add`` is ``(B, O)``, ``(O,)`` or ``None``."""
        if self._packed is not None:
            linear = torch.ops.mkldnn._linear_pointwise
            if add is None or add.dim() == 1:  # a bias goes into the GEMM
                return linear(inp, self._packed[0], add, "none", [], "")
            return linear.binary(inp, add, self._packed[0], None, "add")
        return inp @ self.weight.t() if add is None else torch.addmm(add, inp, self.weight.t())

    def input_grad(self, grad: Tensor) -> Tensor:
        """``grad @ weight``: the gradient of ``inp`` for a step's output gradient ``grad`` ``(B, O)``."""
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(grad, self._packed[1], None, "none", [], "")
        return grad @ self.weight

    def __call__(self, inp: Tensor, add: Tensor | None = None) -> Tensor:
        """``add + inp @ weight.T`` for the next step.

        Args:
            inp: ``(B, I)``.
            add: ``(B, O)`` added to the product (e.g. the step's hoisted input projection), ``(O,)`` (a bias), or
                ``None``.
        """
        offset = None
        if self._offsets is not None:
            offset = self._offsets[len(self.inputs)]
            self.inputs.append(inp.detach())  # the values, for the window GEMM; autograd saves nothing for W here
        elif not torch.is_grad_enabled():
            return self.product(inp, add)
        return _StepProduct.apply(inp, add, offset, self)
