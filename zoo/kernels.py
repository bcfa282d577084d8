"""Fast paths for the matmuls of the per-step loops, measured in ``benchmarks/cells.py``.

A custom cell spends its time in two kinds of matmul: the window GEMMs (the input projection over every step of the
window, ``hoist``, its input gradient and the weight gradients) and the recurrent matmuls, one small GEMM per step. On
CPU, PyTorch sends fp32 ``F.linear``/``mm`` to MKL, while the fused ``nn.LSTM`` goes through oneDNN. On the AMD EPYC
machines this project is developed and tested on, MKL runs its AVX2 code path and oneDNN its AVX-512 one, and MKL
repacks the weight at every call. So every large product here goes through oneDNN's linear on a weight reordered into
its blocked layout (the ops ``torch.compile`` emits for a CPU linear). Measured there (2 threads): the window GEMM
(700 x 650 by 650 x 2600) 23 ms as ``F.linear``, 21 ms as a 1-wide convolution (this module's earlier route), 13 ms
packed, reorder included; the step product (20 x 650 by 650 x 2600) 0.62 ms with ``addmm``, 0.34 ms with oneDNN on a
plain-layout weight, 0.20 ms packed. The numbers are fp32 either way (equal to rounding); only the kernel differs.

``LM_ZOO_KERNELS=plain`` selects the reference path instead, everywhere: plain autograd ops (``F.linear`` per step,
the Mogrifier's rounds as written), no oneDNN private op, no C++ extension, no fused ``nn.LSTM``/``nn.GRU`` kernel.
It is what to fall back on when a fast path misbehaves on new hardware or a new PyTorch, and what the tests hold
every fast path equal to (``tests/test_kernels.py``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo import settings


def plain_kernels() -> bool:
    """Whether the reference path of plain autograd ops runs (``LM_ZOO_KERNELS=plain``, :mod:`zoo.settings`)."""
    return settings.current().plain_kernels


def in_dtype(tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``tensor`` in ``dtype`` (``None`` stays ``None``): what a kernel here computes in, the weights' dtype."""
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


def autocast_off(like: Tensor) -> contextlib.AbstractContextManager:
    """A context without autocast on ``like``'s device: inside a hand-written kernel every product runs in the dtype
    its operands were cast to, as in its backward, which autocast never covers (``torch.amp.custom_fwd(
    cast_inputs=...)``'s rule, for whichever device the tensors are on). Without autocast, nothing: the per-step
    loops call this at every step."""
    if torch.is_autocast_enabled(like.device.type):
        return torch.autocast(like.device.type, enabled=False)
    return contextlib.nullcontext()


#: Weights at least this large go through oneDNN. Below it, MKL's packing overhead is negligible and the reorder
#: costs more than it saves (a 128 x 32 window projection took 3x as long packed, fwd + bwd; 512 x 128 broke even).
ONEDNN_MIN_WEIGHT = 65_536


def _use_onednn(x: Tensor, weight_numel: int | None = None) -> bool:
    """Whether a product on ``x`` (with a weight of ``weight_numel`` elements) goes through oneDNN."""
    return (
        (weight_numel is None or weight_numel >= ONEDNN_MIN_WEIGHT)
        and not plain_kernels()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and _packed_linear_works()
    )


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` through oneDNN's linear, ``weight`` packed by ``_reorder_linear_weight`` (or any
    strided ``W``; see :func:`_packed_linear_works` for why these private ops are safe to use here)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_linear_add(x: Tensor, add: Tensor, weight: Tensor) -> Tensor:
    """``add + x @ W.T`` through oneDNN's linear, the addition fused into the GEMM (``add``: ``(B, O)``)."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, add, weight, None, "add")


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for ``x: (N, I)``, ``weight: (O, I)`` (any strides), through oneDNN on CPU.

    The weight is reordered into oneDNN's blocked layout at every call; for the window GEMMs (``N`` = every position
    of a window) that costs a few percent of the product.
    """
    if not _use_onednn(x):
        return F.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, x.size(0))
    return packed_linear(x.contiguous(), packed, bias)


class _WindowLinear(torch.autograd.Function):
    """``rows @ weight.T + bias`` over a window's rows ``(T*B, I)``, each GEMM of it (forward, both gradients) in
    oneDNN. As autograd ops, the input's and the weight's gradients would go to MKL (``mm``)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return _linear(rows, weight, bias)  # (T*B, O)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        rows, weight = ctx.saved_tensors
        need_rows, need_weight, need_bias = ctx.needs_input_grad
        grad_rows = _linear(grad, weight.t()) if need_rows else None  # (T*B, I)
        grad_weight = gemm_tn(grad, rows) if need_weight else None  # (O, I)
        grad_bias = grad.sum(0) if ctx.has_bias and need_bias else None
        return grad_rows, grad_weight, grad_bias


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
    if not _use_onednn(x, weight.numel()):
        return F.linear(time_major, weight, bias).transpose(0, 1)  # (B, T, O) view of (T, B, O)
    steps, batch, _ = time_major.shape
    y = _WindowLinear.apply(time_major.reshape(steps * batch, -1), weight, bias)  # (T*B, O)
    return y.view(steps, batch, -1).transpose(0, 1)  # (B, T, O) view of (T, B, O)


def gemm_tn(a: Tensor, b: Tensor) -> Tensor:
    """``a.T @ b`` for ``a: (N, O)``, ``b: (N, I)``, through oneDNN on CPU (see the module doc)."""
    return gemm_tn_each(a, [b])[0]


def gemm_tn_each(a: Tensor, bs: list[Tensor]) -> list[Tensor]:
    """``[a.T @ b for b in bs]`` (each ``b: (N, I_j)``), transposing ``a`` once for all of them on the oneDNN route."""
    if not _use_onednn(a, a.size(1) * bs[0].size(1)):
        return [a.t() @ b for b in bs]
    # Of the layouts oneDNN can take, transposing a and packing b.T measured fastest (700 x 2600 by 700 x 650).
    a_t = a.t().contiguous()  # (O, N)
    return [_linear(a_t, b.t()) for b in bs]  # each (O, I_j)


@functools.cache
def _packed_linear_works() -> bool:
    """Whether oneDNN's packed linear (private PyTorch ops) exists and computes ``x @ W.T + add`` in this build.

    ``torch.ops.mkldnn._reorder_linear_weight`` and ``_linear_pointwise`` are the ops ``torch.compile`` emits for a
    CPU linear. They are not public API, so they are feature-tested once: if a PyTorch release renames or changes
    them, the per-step product quietly falls back to ``addmm`` (same numbers, MKL's speed).
    """
    try:
        generator = torch.Generator().manual_seed(0)  # the user's random stream is not this check's to draw from
        x, w, add, bias = (torch.randn(*shape, generator=generator) for shape in ((3, 5), (4, 5), (3, 4), (4,)))
        # Autocast off: the first call may come under the caller's autocast, which would lower `x @ w.t()` to bf16,
        # and the check would turn the packed route off for the whole process.
        with torch.autocast("cpu", enabled=False), torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
            y = torch.ops.mkldnn._linear_pointwise.binary(x, add, packed, None, "add")
            z = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            expected = x @ w.t()
        return bool(torch.allclose(y, expected + add, atol=1e-5) and torch.allclose(z, expected + bias, atol=1e-5))
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
        ctx.add_dtype = None if add is None else add.dtype
        return matmul.product(inp, add)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        need_inp, need_add, need_offset, _ = ctx.needs_input_grad
        grad = in_dtype(grad, ctx.matmul.weight.dtype)
        grad_inp = ctx.matmul.input_grad(grad) if need_inp else None
        grad_add = (grad.sum(0) if ctx.add_is_bias else grad) if need_add else None
        return grad_inp, grad_add, grad if need_offset else None, None


class _WindowWeightGrad(torch.autograd.Function):
    """A zero tensor whose backward turns the per-step output gradients into the weight's gradient in one GEMM."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, weight: Tensor, matmul: RecurrentMatmul, shape: tuple
    ) -> Tensor:
        # A weak reference: a strong one closes the cycle matmul._offsets -> this node -> ctx -> matmul, which runs
        # through autograd's C++ graph where Python's garbage collector cannot see it, so every window's matmul (its
        # packed weight copies, its offsets) was kept forever: ~20 MB a window for a 3 x 400 ON-LSTM. The step
        # products' nodes hold the matmul strongly until the graph is freed, and this backward runs after theirs.
        ctx.matmul = weakref.ref(matmul)
        # Its values are never read (the step products only take its gradient): one broadcast zero, not B*T*O.
        return weight.new_zeros(()).expand(shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        matmul = ctx.matmul()
        inputs = torch.stack(matmul.inputs, dim=1)  # (B, T, I)
        if inputs.size(1) != grad.size(1):
            raise RuntimeError(f"RecurrentMatmul was called {inputs.size(1)} times in a window of {grad.size(1)} steps")
        matmul.inputs = []  # release the window's inputs once they have been used
        grad = in_dtype(grad, inputs.dtype)
        return gemm_tn(grad.flatten(0, 1), inputs.flatten(0, 1)), None, None


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
        pack_transposed: whether the backward's products read a packed copy of ``W^T`` (made at the first backward
            step) or oneDNN reads ``W``'s transposed view as it is. Packing costs 2-5 ms per 650 x 2600 weight and
            window inside a training step; it pays back over long windows and large batches only.
        onednn: whether the products go through oneDNN's packed weight; ``None`` decides by the weight's size
            (``ONEDNN_MIN_WEIGHT``). A kernel that takes several weights in one layout decides for them all.
    """

    def __init__(
        self, weight: Tensor, batch: int, steps: int, pack_transposed: bool = True, onednn: bool | None = None
    ) -> None:
        detached = weight.detach()
        self.weight = detached  # (O, I)
        self.plain = plain_kernels()
        self.source = weight  # with its autograd history, for the plain path
        self.pack_transposed = pack_transposed
        self.inputs: list[Tensor] = []
        self.batch = batch
        self._packed: Tensor | None = None
        self._packed_t: Tensor | None = None  # W.T packed, for the backward; made at its first step
        if onednn is None:
            onednn = _use_onednn(weight, weight.numel())
        if onednn:
            # oneDNN's blocked layout for this batch size, once per window. Measured (2 threads, 20 x 650 by
            # 650 x 2600): 0.20 ms per product, against 0.34 ms with the plain layout of to_mkldnn() and its
            # input/output conversions, 0.62 ms addmm.
            self._packed = torch.ops.mkldnn._reorder_linear_weight(detached, batch)
        self._offsets: tuple[Tensor, ...] | None = None
        if torch.is_grad_enabled() and weight.requires_grad and not self.plain:
            zero = _WindowWeightGrad.apply(weight, self, (batch, steps, weight.size(0)))  # (B, T, O)
            self._offsets = zero.unbind(1)

    def product(self, inp: Tensor, add: Tensor | None = None) -> Tensor:
        """``add + inp @ weight.T`` without autograd, in the weight's dtype (also under autocast, see
        :func:`autocast_off`); ``add`` is ``(B, O)``, ``(O,)`` or ``None``."""
        inp, add = in_dtype(inp, self.weight.dtype), in_dtype(add, self.weight.dtype)
        with autocast_off(inp):
            if self._packed is not None:
                if add is None or add.dim() == 1:  # a bias goes into the GEMM
                    return packed_linear(inp, self._packed, add)
                return packed_linear_add(inp, add, self._packed)
            return inp @ self.weight.t() if add is None else torch.addmm(add, inp, self.weight.t())

    def forward_operand(self) -> tuple[Tensor, bool]:
        """What :meth:`product` multiplies by, and whether it is oneDNN's packed weight (else ``W`` itself)."""
        return (self._packed, True) if self._packed is not None else (self.weight, False)

    def input_grad_operand(self) -> tuple[Tensor, bool]:
        """What :meth:`input_grad` multiplies by: with oneDNN (``True``), ``W``'s transposed view or ``W^T``
        packed (made here, once per window); otherwise ``W``, for a plain ``grad @ W``."""
        if self._packed is None:
            return self.weight, False
        if not self.pack_transposed:
            return self.weight.t(), True
        if self._packed_t is None:
            self._packed_t = torch.ops.mkldnn._reorder_linear_weight(self.weight.t(), self.batch)
        return self._packed_t, True

    def input_grad(self, grad: Tensor) -> Tensor:
        """``grad @ weight``: the gradient of ``inp`` for a step's output gradient ``grad`` ``(B, O)``, in the weight's
        dtype (autograd casts it to ``inp``'s)."""
        grad = in_dtype(grad, self.weight.dtype)
        operand, onednn = self.input_grad_operand()
        return packed_linear(grad, operand) if onednn else grad @ operand

    def __call__(self, inp: Tensor, add: Tensor | None = None) -> Tensor:
        """``add + inp @ weight.T`` for the next step.

        Args:
            inp: ``(B, I)``.
            add: ``(B, O)`` added to the product (e.g. the step's hoisted input projection), ``(O,)`` (a bias), or
                ``None``.
        """
        if self.plain:  # autograd's own ops: a weight gradient per step, summed by autograd
            product = F.linear(inp, self.source)
            return product if add is None else add + product
        offset = self.step_offset()
        if offset is not None:
            self.record(inp)
        elif not torch.is_grad_enabled():
            return self.product(inp, add)
        return _StepProduct.apply(inp, add, offset, self)

    def step_offset(self) -> Tensor | None:
        """The next step's slice of the weight-gradient tensor (``None`` when no weight gradient is wanted): an
        autograd input of the step's product, whose gradient must be the product's output gradient ``(B, O)``."""
        return self._offsets[len(self.inputs)] if self._offsets is not None else None

    def record(self, inp: Tensor) -> None:
        """Keep the next step's input for the window's weight-gradient GEMM (after :meth:`step_offset`)."""
        if self._offsets is not None:
            self.inputs.append(in_dtype(inp.detach(), self.weight.dtype))  # values only: autograd saves nothing for W


class _GatedProduct(torch.autograd.Function):
    """``2 sigm(left(first(inp)) + bias) * x`` for one step, as one autograd node (see :func:`gated_product`)."""

    @staticmethod
    def forward(
        ctx: Any,
        inp: Tensor,
        x: Tensor,
        bias: Tensor | None,
        first_offset: Tensor | None,
        left_offset: Tensor | None,
        first: RecurrentMatmul | None,
        left: RecurrentMatmul | None,
    ) -> Tensor:
        pre = inp
        if first is not None:
            first.record(pre)
            pre = first.product(pre)
        if left is not None:
            left.record(pre)
            pre = left.product(pre, bias)
        elif bias is not None:
            pre = pre + bias
        gate = torch.sigmoid(pre)
        ctx.save_for_backward(x, gate)
        ctx.first, ctx.left = first, left
        return torch.mul(gate, x).mul_(2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, gate = ctx.saved_tensors
        need_inp, need_x, need_bias, need_first, need_left, _, _ = ctx.needs_input_grad
        grad_x = torch.mul(grad, gate).mul_(2)  # (B, n)
        grad_pre = (1 - gate).mul_(grad_x).mul_(x)  # d/dpre of 2 sigm(pre) x: 2 sigm(pre) (1 - sigm(pre)) x
        grad_mid = grad_inp = None
        if need_inp or need_first:
            grad_mid = ctx.left.input_grad(grad_pre) if ctx.left is not None else grad_pre
            if need_inp:
                grad_inp = ctx.first.input_grad(grad_mid) if ctx.first is not None else grad_mid
        return (
            grad_inp,
            grad_x if need_x else None,
            grad_pre.sum(0) if need_bias else None,
            grad_mid if need_first else None,
            grad_pre if need_left else None,
            None,
            None,
        )


def gated_product(
    inp: Tensor,
    x: Tensor,
    first: RecurrentMatmul | None = None,
    left: RecurrentMatmul | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """``2 sigm(L (F inp) + bias) * x`` for one step of a window, as one autograd node (a Mogrifier round, Melis et
    al. 2020 eqs. 1-2, with ``F`` = ``first``'s weight and ``L`` = ``left``'s; either may be left out).

    Written as autograd ops, a round is five nodes per step (two products, the sigmoid, the factor 2, the gate); each
    costs its Python and autograd overhead, which at a Mogrifier's small sizes (rank 40) is most of the round's time.
    The weights' gradients still come out as one GEMM per window (:class:`RecurrentMatmul`).

    Args:
        inp: ``(B, I)`` the vector the gate reads.
        x: ``(B, n)`` the vector it gates.
        first: the first product, or ``None`` when ``inp`` already went through it.
        left: the second product (the left factor of a low-rank matrix), or ``None``.
        bias: ``(n,)`` added inside the sigmoid, or ``None``.

    Returns:
        ``(B, n)``.
    """
    if plain_kernels():  # eqs. 1-2 as autograd ops
        pre = inp if first is None else first(inp)
        pre = left(pre, bias) if left is not None else (pre if bias is None else pre + bias)
        return 2 * torch.sigmoid(pre) * x
    first_offset = first.step_offset() if first is not None else None
    left_offset = left.step_offset() if left is not None else None
    return _GatedProduct.apply(inp, x, bias, first_offset, left_offset, first, left)
