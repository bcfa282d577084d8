"""Mogrifier LSTM (Melis, Kočiský & Blunsom, ICLR 2020, §2 eqs. 1-2; ablation §4.1).

Before the usual LSTM update, the input ``x`` and the previous output ``h_prev`` gate each other for ``r`` rounds::

    x^i = 2 sigm(Q^i h^{i-1}) * x^{i-2}      for odd i in [1..r]      (eq. 1)
    h^i = 2 sigm(R^i x^{i-1}) * h^{i-2}      for even i in [1..r]     (eq. 2)

with ``x^{-1} = x`` and ``h^0 = h_prev``; the LSTM then runs on the highest-indexed ``x^i`` and ``h^i``:
``Mogrify(x, c_prev, h_prev) = LSTM(x^↑, c_prev, h_prev^↑)``. So the *first* round gates the input (a trap: a 0-based
loop that tests ``round % 2 == 1`` for the input flips the order, peers.md §4). The factor 2 makes a gate with small
weights close to 1, so that a randomly initialised Mogrifier starts near the plain LSTM; ``r = 0`` *is* the LSTM.
The mogrified ``h`` only feeds the LSTM's gate matmuls: the state carried to the next step is the LSTM's new ``(h, c)``.

``Q^i`` is ``m x n`` (it maps the state to the input's width) and ``R^i`` is ``n x m``. With rank ``k > 0`` each is the
product of two thin matrices, ``Q^i = Q^i_left Q^i_right`` (``m x k`` times ``k x n``); ``k <= 0`` means full rank
(Appendix A). The paper's equations have no bias inside the sigmoids; the reference code (``lamb/tiled_lstm.py``) adds
one per round, which ``round_bias=True`` reproduces.

No-zigzag ablation (§4.1, Fig. 2): every gate is computed from the *original* inputs,
``x^i = 2 sigm(Q^i h_prev) * x^{i-2}`` and ``h^i = 2 sigm(R^i x) * h_prev^{i-2}``. Round 1 coincides (``h^0 = h_prev``);
from round 2 on the two differ (zigzag uses ``x^1``, no-zigzag ``x``). Without the zigzag the state gates depend on
the input alone, so they are computed for the whole window at once, and the input gates share one matmul on
``h_prev``.

Speed. The input is mogrified per step, so ``W_x x`` cannot be hoisted out of the loop, and round i needs round i-1,
so the rounds cannot be batched: a step streams both LSTM matrices (the LSTM streams only ``W_h``), which bounds the
Mogrifier near half the per-step LSTM's throughput at small batches, where those products are limited by memory
bandwidth. The zigzag layer with rounds runs :class:`_MogrifierWindow` by default: the window's forward and backward
loops written out, with no autograd nodes inside the step (some twenty per step otherwise) and one weight-gradient
GEMM per matrix and window. The loops run in C++ (``zoo/csrc/mogrifier_window.cpp``, built on first use by
:mod:`zoo.native`) or, where that cannot be built, as their Python twins, which compute the same bits.
``fused=False`` (and the no-zigzag ablation) runs the per-step autograd path, where every matrix goes through
:class:`~zoo.kernels.RecurrentMatmul` and the last round shares one matmul with the half of the LSTM that reads the
same vector; the tests hold the two paths equal, gradients included.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from zoo import native
from zoo.errors import clip
from zoo.kernels import (
    RecurrentMatmul,
    _packed_linear_works,
    _use_onednn,
    autocast_off,
    gated_product,
    gemm_tn,
    gemm_tn_each,
    in_dtype,
    packed_linear,
    packed_linear_add,
    plain_kernels,
    window_linear,
)
from zoo.lstm import LSTMLayer, lstm_update
from zoo.stack import RecurrentStack
from zoo.state import State


class MogrifierLayer(LSTMLayer):
    """One Mogrifier LSTM layer: the rounds' matrices beside an ``nn.LSTM``'s parameters (the LSTM's layout).

    Round i's parameters are named after the paper: ``Q1``, ``R2``, ``Q3``, ... at full rank, ``Q1_left`` and
    ``Q1_right`` (``Q1 = Q1_left @ Q1_right``) at low rank, and ``Q1_bias`` with ``round_bias``. Weights follow
    ``nn.Linear``'s convention ``(out, in)``, which for ``Q^i`` (``m x n``) is the paper's own shape.

    Args:
        input_size: ``m``.
        hidden_size: ``n``.
        rounds: ``r``; 0 is the LSTM (and then the fused kernel runs when ``fused``).
        rank: ``k``; ``k <= 0`` means full-rank ``Q^i``, ``R^i``.
        zigzag: ``False`` is the §4.1 ablation (gates from the original ``x`` and ``h_prev``).
        round_bias: add a bias inside each round's sigmoid (the reference code; not in the paper's equations).
        fused: with ``rounds == 0``, use ``nn.LSTM``'s kernel when it computes the same function; with rounds (zigzag),
            the window kernel written out by hand. ``False`` runs the per-step autograd path.
        cap_input_gate: the LSTM's input gate capped at ``1 - f`` (lamb's ``cap_input_gate``, which the paper's
            released configurations use); neither kernel computes it, so a capped layer runs the per-step path.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        rounds: int = 5,
        rank: int = 40,
        zigzag: bool = True,
        round_bias: bool = False,
        fused: bool = True,
        cap_input_gate: bool = False,
    ) -> None:
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        # nn.LSTM's kernel for r = 0 only (and without the cap: LSTMLayer turns it off then).
        super().__init__(input_size, hidden_size, fused and rounds == 0, cap_input_gate)
        self.rounds = rounds
        self.rank = rank
        # With one round the two schemes are the same function (h^0 = h_prev); the zigzag path is the faster one.
        self.zigzag = zigzag or rounds <= 1
        # With rounds, the zigzag layer runs the hand-written window kernel (_MogrifierWindow); the per-step autograd
        # path (fused=False, and the no-zigzag ablation) is its independent check.
        self.window_kernel = fused and rounds > 0 and self.zigzag and not cap_input_gate
        self.round_bias = round_bias
        self.mog = nn.ParameterDict()
        for i in range(1, rounds + 1):
            name = self.round_name(i)
            # Odd rounds gate x with Q^i h (m x n); even rounds gate h with R^i x (n x m).
            out, inp = (input_size, hidden_size) if i % 2 else (hidden_size, input_size)
            if rank > 0:
                self.mog[f"{name}_left"] = _uniform(out, rank)
                self.mog[f"{name}_right"] = _uniform(rank, inp)
            else:
                self.mog[name] = _uniform(out, inp)
            if round_bias:
                self.mog[f"{name}_bias"] = nn.Parameter(torch.zeros(out))

    @staticmethod
    def round_name(i: int) -> str:
        """``Q1``, ``R2``, ``Q3``, ...: round i (1-based, as in the paper) gates x when i is odd."""
        return f"Q{i}" if i % 2 else f"R{i}"

    # ------------------------------------------------------------------------------------------ round helpers
    def round_matrix(self, i: int) -> Tensor:
        """Round i's full matrix (``Q^i_left @ Q^i_right`` at low rank), for tests and inspection."""
        name = self.round_name(i)
        if self.rank > 0:
            return self.mog[f"{name}_left"] @ self.mog[f"{name}_right"]
        return self.mog[name]

    def _first(self, i: int) -> Tensor:
        """The matrix that reads round i's input: the full matrix, or the right factor at low rank."""
        name = self.round_name(i)
        return self.mog[f"{name}_right"] if self.rank > 0 else self.mog[name]

    def _bias(self, i: int) -> Tensor | None:
        return self.mog[f"{self.round_name(i)}_bias"] if self.round_bias else None

    def _round(self, i: int, v: Tensor, gated: Tensor, first: RecurrentMatmul | None = None) -> Tensor:
        """Round i at one step, ``2 sigm(Q^i v) * gated`` (eqs. 1-2), as one autograd node.

        ``first`` applies the first matrix (the full one, or the right factor) to ``v``; without it, ``v`` is that
        product already. The left factor and the bias follow inside.
        """
        left = self.window.left[i] if self.rank > 0 else None
        return gated_product(v, gated, first, left, self._bias(i))

    def _window_gate(self, i: int, v: Tensor) -> Tensor:
        """``2 sigm(Q^i v)`` (or ``R^i``) for a whole window ``v: (B, T, in)`` at once."""
        pre = window_linear(v, self._first(i))
        if self.rank > 0:
            pre = window_linear(pre, self.mog[f"{self.round_name(i)}_left"], self._bias(i))
        elif self.round_bias:
            pre = pre + self._bias(i)
        return 2 * torch.sigmoid(pre)

    # ------------------------------------------------------------------------------------------------ the loop
    def forward(
        self, x: Tensor, state: State, keep_at: dict[int, Tensor], state_mask: Tensor | None = None
    ) -> tuple[Tensor, State]:
        if not self.window_kernel or plain_kernels():
            return super().forward(x, state, keep_at, state_mask)
        rnn = self.rnn
        round_tensors = [  # in the order _unflatten_rounds reads them: first, left (low rank), bias (round_bias)
            tensor
            for i in range(1, self.rounds + 1)
            for tensor in (
                self._first(i),
                self.mog[f"{self.round_name(i)}_left"] if self.rank > 0 else None,
                self._bias(i),
            )
            if tensor is not None
        ]
        y, h, c = _MogrifierWindow.apply(
            keep_at,
            (self.rank > 0, self.round_bias),
            x,
            state[0],
            state[1],
            state_mask,
            rnn.weight_ih_l0,
            rnn.weight_hh_l0,
            rnn.bias_ih_l0 + rnn.bias_hh_l0,
            *round_tensors,
        )
        return y, (h, c)

    def hoist(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if self.rounds == 0:
            return super().hoist(x)  # (B, T, 4n): W_x x + b, the LSTM's own hoist
        # Every matrix is applied once per step through a RecurrentMatmul: one weight-gradient GEMM per window. They
        # are built here, per window, from the parameters in use, so weight drop (functional_call) reaches them.
        rnn, r, w = self.rnn, self.rounds, self.window
        batch, steps = x.shape[:2]
        bias = rnn.bias_ih_l0 + rnn.bias_hh_l0  # (4n,)
        if self.rank > 0:
            w.left = {i: RecurrentMatmul(self.mog[f"{self.round_name(i)}_left"], batch, steps) for i in range(1, r + 1)}
        if not self.zigzag:
            odd = range(1, r + 1, 2)
            w.odd_widths = [self._first(i).size(0) for i in odd]
            # Every odd round reads h_prev: their first matrices stacked, one matmul per step.
            w.odd = RecurrentMatmul(torch.cat([self._first(i) for i in odd]), batch, steps)
            w.lstm = RecurrentMatmul(torch.cat([rnn.weight_ih_l0, rnn.weight_hh_l0], 1), batch, steps)  # [x~, h~]
            w.bias = bias
            if self.rank > 0:
                for i in range(2, r + 1, 2):
                    del w.left[i]  # the even rounds run here, over the window
            # h~ = h_prev * prod_{even i} 2 sigm(R^i x) depends on x alone: computed for the whole window at once.
            state_gate = self._window_gate(2, x)  # (B, T, n)
            for i in range(4, r + 1, 2):
                state_gate = state_gate * self._window_gate(i, x)
            return x, state_gate
        w.first = {i: RecurrentMatmul(self._first(i), batch, steps) for i in range(1, r)}
        # The last round and one half of the LSTM read the same vector: one matrix for both, one for the other half.
        shared, other = (rnn.weight_hh_l0, rnn.weight_ih_l0) if r % 2 else (rnn.weight_ih_l0, rnn.weight_hh_l0)
        last = self._first(r)
        w.shared = RecurrentMatmul(torch.cat([shared, last]), batch, steps)  # (4n + width, in)
        w.shared_bias = torch.cat([bias, bias.new_zeros(last.size(0))])
        w.shared_width = last.size(0)
        w.other = RecurrentMatmul(other, batch, steps)
        return x  # every round depends on h: nothing else to precompute

    def step(self, x_t: Any, state: State) -> State:
        if self.rounds == 0:
            return super().step(x_t, state)
        h, c = state
        w, r, n4 = self.window, self.rounds, 4 * self.hidden_size
        if not self.zigzag:
            x, state_gate = x_t  # (B, m), (B, n)
            for i, pre in zip(range(1, r + 1, 2), w.odd(h).split(w.odd_widths, dim=1)):
                x = self._round(i, pre, x)  # x^i = 2 sigm(Q^i h_prev) * x^{i-2}
            gates = w.lstm(torch.cat([x, h * state_gate], 1), add=w.bias)  # (B, 4n)
            return lstm_update(gates, c, self.cap_input_gate)
        x = x_t
        for i in range(1, r):  # every round but the last: x^i reads h^{i-1}, h^i reads x^{i-1}
            if i % 2:
                x = self._round(i, h, x, w.first[i])  # (B, m)
            else:
                h = self._round(i, x, h, w.first[i])  # (B, n)
        # Round r shares its input with one half of the LSTM matmul.
        if r % 2:  # round r gates x from h^{r-1} = h^↑, which W_h also reads
            gates, pre = w.shared(h, add=w.shared_bias).split([n4, w.shared_width], dim=1)  # (B, 4n), (B, width)
            x = self._round(r, pre, x)  # x^↑ (B, m)
            gates = w.other(x, add=gates)
        else:  # round r gates h from x^{r-1} = x^↑, which W_x also reads
            gates, pre = w.shared(x, add=w.shared_bias).split([n4, w.shared_width], dim=1)
            h = self._round(r, pre, h)  # h^↑ (B, n)
            gates = w.other(h, add=gates)
        return lstm_update(gates, c, self.cap_input_gate)


# The derivative kernels autograd itself uses: one fused op each instead of three or four elementwise ones.
_sigmoid_backward = torch.ops.aten.sigmoid_backward  # (g, s) -> g s (1 - s); out= through grad_input
_tanh_backward = torch.ops.aten.tanh_backward  # (g, t) -> g (1 - t^2)


class _WindowLayout:
    """Where each saved tensor of a step sits in the window loops' flat list (``zoo/csrc/mogrifier_window.cpp`` keeps
    the same one): ``xs`` (x^{-1}, x^1, x^3, ...), ``hs`` (h^0, h^2, ...), each round's first product at low rank
    (``mid``), each round's ``sigm(pre)`` (``gate``), then the LSTM's sigmoids ``(B, 4n)``, ``tanh(g)``, ``c_prev`` and
    ``tanh(c)`` (from ``lstm``)."""

    def __init__(self, rounds: int, low_rank: bool) -> None:
        self.rounds = rounds
        self.hs = 1 + (rounds + 1) // 2  # xs come first: x^{-1} and one per odd round
        self.mid = self.hs + 1 + rounds // 2
        self.gate = self.mid + (rounds if low_rank else 0)
        self.lstm = self.gate + rounds
        self.per_step = self.lstm + 4

    def read(self, i: int) -> int:
        """The vector round i (1-based) read: h^{i-1} for odd i (eq. 1), x^{i-1} for even i (eq. 2)."""
        return self.hs + (i - 1) // 2 if i % 2 else i // 2

    def gated(self, i: int) -> int:
        """The vector round i gated: x^{i-2} for odd i, h^{i-2} for even i."""
        return (i + 1) // 2 - 1 if i % 2 else self.hs + i // 2 - 1


def _forward_loop(
    x: Tensor,
    h0: Tensor,
    c0: Tensor,
    keep: list[Tensor | None],
    state_mask: Tensor | None,
    weight_x: Tensor,
    weight_h: Tensor,
    packed: bool,
    bias: Tensor,
    firsts: list[Tensor],
    lefts: list[Tensor | None],
    biases: list[Tensor | None],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """The window kernel's forward loop in Python: the twin of ``mogrifier_window_forward`` in
    ``zoo/csrc/mogrifier_window.cpp``, op for op, and what runs where the C++ kernels cannot be built.

    Args:
        x: ``(B, T, m)``.
        h0: ``(B, n)``.
        c0: ``(B, n)``.
        keep: per step, the ``(B,)`` keep mask of a reset, or ``None``.
        state_mask: ``(B, n)`` state dropout mask, or ``None``.
        weight_x: ``W_x`` ``(4n, m)``, or oneDNN's packed copy when ``packed``.
        weight_h: ``W_h`` ``(4n, n)``, likewise.
        packed: whether the weights are oneDNN-packed (:class:`~zoo.kernels.RecurrentMatmul`).
        bias: ``(4n,)`` the LSTM's summed bias.
        firsts: per round, the matrix that reads the round's input (full, or the right factor).
        lefts: per round, the left factor at low rank, else ``None``.
        biases: per round, the bias inside the sigmoid, or ``None``.

    Returns:
        ``y`` ``(B, T, n)``, ``h_T``, ``c_T`` and the saved tensors, step after step (:class:`_WindowLayout`).
    """
    inputs = x.transpose(0, 1)  # (T, B, m)
    saved: list[Tensor] = []
    outputs = []
    h, c, n = h0, c0, h0.size(1)
    for t, keep_t in enumerate(keep):
        if keep_t is not None:
            keep_t = keep_t.unsqueeze(1)  # (B, 1)
            h, c = h * keep_t, c * keep_t
        if state_mask is not None:
            h = h * state_mask
        xs, hs, mids, gates = [inputs[t]], [h], [], []
        for i, (first, left, round_bias) in enumerate(zip(firsts, lefts, biases, strict=True), start=1):
            read, chain = (hs, xs) if i % 2 else (xs, hs)  # odd rounds gate x reading h (eq. 1), even rounds h
            pre = torch.mm(read[-1], first.t())  # (B, k) or (B, width)
            if left is not None:
                mids.append(pre)  # the left factor's input, for its weight gradient
                pre = torch.mm(pre, left.t())
            if round_bias is not None:
                pre = pre + round_bias
            gate = torch.sigmoid(pre)  # sigm(.); the round multiplies by 2 sigm(.)
            gates.append(gate)
            chain.append(torch.mul(gate, chain[-1]).mul_(2))
        if packed:  # (B, 4n) = W_h h^up + b + W_x x^up
            pre = packed_linear_add(xs[-1], packed_linear(hs[-1], weight_h, bias), weight_x)
        else:
            pre = torch.addmm(torch.addmm(bias, hs[-1], weight_h.t()), xs[-1], weight_x.t())
        sig = torch.sigmoid(pre)
        tanh_g = torch.tanh(pre[:, 2 * n : 3 * n])
        c_prev = c
        c = torch.addcmul(sig[:, n : 2 * n] * c, sig[:, :n], tanh_g)
        tanh_c = torch.tanh(c)
        h = sig[:, 3 * n :] * tanh_c
        saved += [*xs, *hs, *mids, *gates, sig, tanh_g, c_prev, tanh_c]
        outputs.append(h)
    return torch.stack(outputs, 1), h, c, saved


def _backward_loop(
    saved: list[Tensor],
    grad_y: Tensor,
    grad_h: Tensor,
    grad_c: Tensor,
    keep: list[Tensor | None],
    state_mask: Tensor | None,
    operand_x: Tensor,
    operand_h: Tensor,
    onednn: bool,
    firsts: list[Tensor],
    lefts: list[Tensor | None],
    biases: list[Tensor | None],
) -> list[Tensor]:
    """The window kernel's backward loop (BPTT by hand) in Python, twin of ``mogrifier_window_backward``.

    Per step: the LSTM's gate gradient, the input gradients of ``W_x`` and ``W_h`` (``operand_*`` is ``W`` for a
    plain ``mm``, or, when ``onednn``, what oneDNN's linear reads: ``W``'s transposed view or ``W^T`` packed), then the
    rounds in reverse: round i makes ``v = 2 s * u`` with ``s = sigm(p)``, so ``du = 2 s * dv`` and
    ``dp = 2 u * dv * s (1 - s)``.

    Returns:
        ``grad_x`` ``(B, T, m)``, ``dh0``, ``dc0``, the gate gradients ``(T*B, 4n)``, then per round the gradient of
        its pre-sigmoid ``(T*B, out)`` and, at low rank, of its first product ``(T*B, k)``: rows in step order, for
        the weights' window GEMMs.
    """
    layout = _WindowLayout(len(firsts), lefts[0] is not None)
    steps, n = len(keep), grad_h.size(1)
    grad_ys = grad_y.transpose(0, 1)  # (T, B, n)
    dh, dc = grad_h, grad_c
    grad_inputs, grad_gates = [None] * steps, [None] * steps
    grad_pre = [[None] * steps for _ in firsts]
    grad_mid = [[None] * steps for _ in firsts]
    for t in reversed(range(steps)):
        step = saved[t * layout.per_step : (t + 1) * layout.per_step]
        sig, tanh_g, c_prev, tanh_c = step[layout.lstm :]
        dh = dh + grad_ys[t]
        i_gate, f_gate, o_gate = sig[:, :n], sig[:, n : 2 * n], sig[:, 3 * n :]
        dc = dc + _tanh_backward(dh * o_gate, tanh_c)
        d_pre = torch.empty_like(sig)  # (B, 4n), gate order i, f, g, o
        _sigmoid_backward(dc * tanh_g, i_gate, grad_input=d_pre[:, :n])
        _sigmoid_backward(dc * c_prev, f_gate, grad_input=d_pre[:, n : 2 * n])
        _tanh_backward(dc * i_gate, tanh_g, grad_input=d_pre[:, 2 * n : 3 * n])
        _sigmoid_backward(dh * tanh_c, o_gate, grad_input=d_pre[:, 3 * n :])
        grad_gates[t] = d_pre
        dc = dc * f_gate
        dx, dh = _input_grad(d_pre, operand_x, onednn), _input_grad(d_pre, operand_h, onednn)  # of x^up, h^up
        for i in range(len(firsts), 0, -1):
            gate, gated = step[layout.gate + i - 1], step[layout.gated(i)]  # gate = sigm(p)
            if i % 2:  # x^i = 2 gate * x^{i-2}, the gate read h^{i-1}
                d_out, dx = dx, torch.mul(dx, gate).mul_(2)
            else:
                d_out, dh = dh, torch.mul(dh, gate).mul_(2)
            d_p = _sigmoid_backward(torch.mul(d_out, gated).mul_(2), gate)  # d/dp of 2 sigm(p) * u
            grad_pre[i - 1][t] = d_read = d_p
            if lefts[i - 1] is not None:
                grad_mid[i - 1][t] = d_read = torch.mm(d_read, lefts[i - 1])
            d_read = torch.mm(d_read, firsts[i - 1])
            if i % 2:
                dh = dh + d_read
            else:
                dx = dx + d_read
        grad_inputs[t] = dx
        if state_mask is not None:
            dh = dh * state_mask
        if keep[t] is not None:
            keep_t = keep[t].unsqueeze(1)
            dh, dc = dh * keep_t, dc * keep_t
    result = [torch.stack(grad_inputs, 1), dh, dc, torch.cat(grad_gates)]
    for i, left in enumerate(lefts):
        result.append(torch.cat(grad_pre[i]))
        if left is not None:
            result.append(torch.cat(grad_mid[i]))
    return result


def _input_grad(grad: Tensor, operand: Tensor, onednn: bool) -> Tensor:
    """``grad @ W`` for a step's gate gradient: oneDNN's linear on ``operand``, or a plain ``mm`` on ``W``."""
    return packed_linear(grad, operand) if onednn else torch.mm(grad, operand)


class _PythonLoops:
    """The window loops in Python, under the names the C++ kernels have in ``torch.ops.lm_zoo``."""

    mogrifier_window_forward = staticmethod(_forward_loop)
    mogrifier_window_backward = staticmethod(_backward_loop)


def _window_loops() -> Any:
    """The C++ window loops when they can be built (:mod:`zoo.native`) and compute what their Python twins do on a
    small window (:func:`_usable`), else the Python twins."""
    cpp = native.ops()
    return cpp if cpp is not None and _usable(cpp) else _PythonLoops


@functools.cache
def _usable(cpp: Any) -> bool:
    """Whether the C++ loops agree with the Python ones (:func:`_loops_agree`); said in one warning, once, if not.

    The C++ loops call oneDNN's private linear op by its schema, as :func:`zoo.kernels._packed_linear_works` checks
    the Python route's: a PyTorch release that changes it makes the check fail here, once, and training runs the
    Python loops, instead of stopping mid-run.
    """
    try:
        if _loops_agree(cpp):
            return True
        reason = "they compute other numbers than the Python loops"
    except Exception as error:  # noqa: BLE001 - any failure means the Python twin runs, which is correct
        reason = f"they fail on a small window ({clip(str(error) or type(error).__name__)})"
    warnings.warn(f"lm-zoo: the C++ Mogrifier loops are not used: {reason}; the Python loops run", stacklevel=2)
    return False


def _loops_agree(cpp: Any) -> bool:
    """Whether ``cpp``'s window loops give the Python loops' outputs and gradients on a small zigzag window (2
    rounds, full rank), through oneDNN's packed weights where this build has them and through plain ``mm``."""
    generator = torch.Generator().manual_seed(0)
    batch, steps, m, n = 2, 3, 4, 5

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator) * 0.5

    x, h0, c0 = rand(batch, steps, m), rand(batch, n), rand(batch, n)
    w_x, w_h, bias = rand(4 * n, m), rand(4 * n, n), rand(4 * n)
    firsts, lefts, biases = [rand(m, n), rand(n, m)], [None, None], [None, None]
    keep = [None, (torch.arange(batch) > 0).float(), None]
    grads = rand(batch, steps, n), rand(batch, n), rand(batch, n)
    for onednn in [False, True] if _packed_linear_works() and not plain_kernels() else [False]:
        if onednn:  # packed for the forward, W's transposed view for the backward (RecurrentMatmul's operands)
            weight_x, weight_h = (torch.ops.mkldnn._reorder_linear_weight(w, batch) for w in (w_x, w_h))
            operand_x, operand_h = w_x.t(), w_h.t()
        else:
            weight_x, weight_h, operand_x, operand_h = w_x, w_h, w_x, w_h
        outputs = []
        for loops in (cpp, _PythonLoops):
            # Autocast off: the first window may run under the caller's autocast, which would lower the Python twin's
            # products to bf16 and not the C++ loops', and the check would refuse correct C++ loops for the process.
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                *forward, saved = loops.mogrifier_window_forward(
                    x, h0, c0, keep, None, weight_x, weight_h, onednn, bias, firsts, lefts, biases
                )
                backward = loops.mogrifier_window_backward(
                    saved, *grads, keep, None, operand_x, operand_h, onednn, firsts, lefts, biases
                )
            outputs.append([*forward, *backward])
        if len(outputs[0]) != len(outputs[1]) or not all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*outputs, strict=True)
        ):
            return False
    return True


class _MogrifierWindow(torch.autograd.Function):
    """A zigzag Mogrifier layer over a whole window, forward and backward written out (no autograd inside).

    Through autograd, a step is some twenty nodes (five rounds, two products, the LSTM's pointwise ops), and
    building them is what made the per-step forward slower than the same arithmetic without grad (127 against 80 ms
    at 2 x 650, batch 20, BPTT 35, 2 threads). Here the forward loop keeps what the backward needs and the backward
    loop runs BPTT by hand (:func:`_forward_loop`, :func:`_backward_loop`; in C++ where it can be built, see
    ``zoo/csrc/mogrifier_window.cpp``). Every weight's gradient is one GEMM over the window, here. Measured against the
    per-step path (``fused=False``) by ``benchmarks/cells.py --arch mogrifier --loop``.

    Inputs: ``x`` ``(B, T, m)``, the layer's state ``h0``, ``c0`` ``(B, n)``, ``keep_at`` (step -> ``(B,)`` keep
    mask), ``state_mask`` ``(B, n)`` or ``None``, ``W_x`` ``(4n, m)``, ``W_h`` ``(4n, n)``, the summed LSTM bias, and
    each round's ``first``, ``left``, ``bias`` (``left``/``bias`` left out where absent, per ``layout``).
    Outputs: ``y`` ``(B, T, n)``, ``h_T``, ``c_T``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        keep_at: dict[int, Tensor],
        layout: tuple[bool, bool],
        x: Tensor,
        h0: Tensor,
        c0: Tensor,
        state_mask: Tensor | None,
        w_x: Tensor,
        w_h: Tensor,
        bias: Tensor,
        *round_tensors: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        low_rank, round_bias = layout
        firsts, lefts, biases = _unflatten_rounds(round_tensors, low_rank, round_bias)
        batch, steps = x.size(0), x.size(1)
        # In the weights' dtype, without autocast, forward and backward alike (zoo.kernels.autocast_off).
        x, h0, c0, state_mask = (in_dtype(t, w_h.dtype) for t in (x, h0, c0, state_mask))
        keep_at = {t: in_dtype(k, w_h.dtype) for t, k in keep_at.items()}
        # Small batches: the backward reads W's transposed view rather than packing W^T. Measured (2 x 650, BPTT 35,
        # 2 threads, ms per training step, view vs packed): batch 20 186-212 vs 206-240, batch 32 321 vs 334, batch 40
        # 341 vs 339, batch 64 558 vs 518.
        pack_transposed = batch > 32
        # The window loops take W_x and W_h in one layout (one flag), but W_x alone can fall under oneDNN's size
        # threshold (an input narrower than the layer: the reverse-copy recipe's embedding of 64 died on it), so the
        # larger weight decides for both.
        onednn = _use_onednn(w_h, max(w_x.numel(), w_h.numel()))
        product_x = RecurrentMatmul(w_x, batch, steps, pack_transposed, onednn)
        product_h = RecurrentMatmul(w_h, batch, steps, pack_transposed, onednn)
        (weight_x, packed), (weight_h, _) = product_x.forward_operand(), product_h.forward_operand()
        keep = [keep_at.get(t) for t in range(steps)]
        loops = _window_loops()
        with autocast_off(x):
            y, h, c, saved = loops.mogrifier_window_forward(
                x, h0, c0, keep, state_mask, weight_x, weight_h, packed, bias, firsts, lefts, biases
            )
        ctx.loops, ctx.keep, ctx.state_mask, ctx.saved = loops, keep, state_mask, saved
        ctx.rounds = firsts, lefts, biases
        ctx.products = product_x, product_h
        return y, h, c

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor, grad_h: Tensor | None, grad_c: Tensor | None) -> tuple[Tensor | None, ...]:
        firsts, lefts, biases = ctx.rounds
        product_x, product_h = ctx.products
        (operand_x, onednn), (operand_h, _) = product_x.input_grad_operand(), product_h.input_grad_operand()
        saved, layout = ctx.saved, _WindowLayout(len(firsts), lefts[0] is not None)
        h0 = saved[layout.hs]  # h^0 of the first step, for the shape of a gradient autograd left out
        grad_y = in_dtype(grad_y, h0.dtype)
        grad_h = torch.zeros_like(h0) if grad_h is None else in_dtype(grad_h, h0.dtype)
        grad_c = torch.zeros_like(h0) if grad_c is None else in_dtype(grad_c, h0.dtype)
        grad_x, dh, dc, d_pre_all, *round_grads = ctx.loops.mogrifier_window_backward(
            saved, grad_y, grad_h, grad_c, ctx.keep, ctx.state_mask, operand_x, operand_h, onednn, firsts, lefts, biases
        )
        # One GEMM per weight over the window, rows (T*B) in step order.

        def window(index: int) -> Tensor:  # the saved tensor at `index` of every step, stacked (T*B, width)
            return torch.cat(saved[index :: layout.per_step])

        x_up, h_up = window(layout.hs - 1), window(layout.mid - 1)  # the last of xs and of hs
        grad_w_x, grad_w_h = gemm_tn_each(d_pre_all, [x_up, h_up])
        grad_rounds: list[Tensor] = []
        round_grads = iter(round_grads)
        for i, (left, round_bias) in enumerate(zip(lefts, biases, strict=True), start=1):
            read, d_p = window(layout.read(i)), next(round_grads)  # (T*B, in), (T*B, out)
            if left is not None:
                grad_rounds += [gemm_tn(next(round_grads), read), gemm_tn(d_p, window(layout.mid + i - 1))]
            else:
                grad_rounds.append(gemm_tn(d_p, read))
            if round_bias is not None:
                grad_rounds.append(d_p.sum(0))
        return (None, None, grad_x, dh, dc, None, grad_w_x, grad_w_h, d_pre_all.sum(0), *grad_rounds)


def _unflatten_rounds(
    tensors: tuple[Tensor, ...], low_rank: bool, round_bias: bool
) -> tuple[list[Tensor], list[Tensor | None], list[Tensor | None]]:
    """The rounds' tensors, flat in :class:`_MogrifierWindow`'s arguments (first, left, bias per round, each
    present or not as ``low_rank`` and ``round_bias`` say), as three per-round lists: firsts, lefts, biases."""
    per_round = 1 + low_rank + round_bias
    firsts, lefts, biases = [], [], []
    for start in range(0, len(tensors), per_round):
        group = list(tensors[start : start + per_round])
        firsts.append(group.pop(0))
        lefts.append(group.pop(0) if low_rank else None)
        biases.append(group.pop(0) if round_bias else None)
    return firsts, lefts, biases


def _uniform(rows: int, cols: int) -> nn.Parameter:
    """A ``(rows, cols)`` weight with ``nn.Linear``'s default range, ``U(-1/sqrt(cols), 1/sqrt(cols))``."""
    bound = cols**-0.5
    return nn.Parameter(torch.empty(rows, cols).uniform_(-bound, bound))


class Mogrifier(RecurrentStack):
    """A stack of Mogrifier LSTM layers (Melis et al. 2020).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    Weight drop acts on the LSTM's ``W_h``.

    Args:
        rounds: mogrifier rounds ``r`` (the paper tunes 0..6 and finds 5 or 6 best); 0 is the plain LSTM.
        rank: rank ``k`` of ``Q^i``, ``R^i`` (best 40..90 in the paper); ``k <= 0`` means full rank.
        zigzag: ``False`` for the §4.1 no-zigzag ablation.
        round_bias: a bias inside each round's sigmoid, as the reference code (not in eqs. 1-2).
        forget_bias: effective initial forget-gate bias (counted once, see :mod:`zoo.lstm`); ``None`` keeps the init.
        fused: with ``rounds == 0``, use ``nn.LSTM``'s kernel when it computes the same function.
        cap_input_gate: ``c' = f * c + min(1 - f, i) * j`` (lamb's option, off by default: the paper's equations).
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        rounds: int = 5,
        rank: int = 40,
        zigzag: bool = True,
        round_bias: bool = False,
        forget_bias: float | None = 1.0,
        fused: bool = True,
        cap_input_gate: bool = False,
        **stack_options: Any,
    ) -> None:
        layer = functools.partial(
            MogrifierLayer, rounds=rounds, rank=rank, zigzag=zigzag, round_bias=round_bias, fused=fused,
            cap_input_gate=cap_input_gate,
        )  # fmt: skip
        super().__init__(layer, input_size, hidden_size, num_layers, **stack_options)
        self.set_forget_bias(forget_bias)
