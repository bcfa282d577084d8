"""Multiplicative LSTM (Krause et al. 2016), as Melis, Kočiský & Blunsom (ICLR 2020) §4.2 define it.

``mLSTM(x, c_prev, h_prev) = LSTM(x, c_prev, h_m)`` with ``h_m = (W^{mx} x) * (W^{mh} h_prev)``: the LSTM's recurrent
input is replaced by an input-dependent transform of ``h_prev`` (a multiplicative RNN's factorised transition, Sutskever
et al. 2011), shared by all four gates. Written out for one step (no biases in ``h_m``, as in both papers)::

    m  = (W^{mx} x) * (W^{mh} h_prev)
    i  = sigm(W^{ix} x + W^{im} m + b^i)      f = sigm(W^{fx} x + W^{fm} m + b^f)
    j  = tanh(W^{jx} x + W^{jm} m + b^j)      o = sigm(W^{ox} x + W^{om} m + b^o)
    c  = f * c_prev + i * j                   h = o * tanh(c)

The LSTM part keeps ``nn.LSTM``'s layout (``rnn.weight_ih_l0`` = the ``W^{*x}``, ``rnn.weight_hh_l0`` = the ``W^{*m}``),
so it shares the zoo LSTM's forget-bias handling. Speed: ``W^{*x} x`` and ``W^{mx} x`` depend on the input alone and
are computed for the whole window in one matmul; a step costs two dependent matmuls (``W^{mh} h`` then ``W^{*m} m``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zoo.kernels import RecurrentMatmul, window_linear
from zoo.lstm import LSTMLayer
from zoo.mogrifier import lstm_update
from zoo.stack import RecurrentStack
from zoo.state import State


class MLSTMLayer(LSTMLayer):
    """One mLSTM layer: ``weight_mx`` (``n x m``) and ``weight_mh`` (``n x n``) beside an ``nn.LSTM``'s parameters.

    There is no fused kernel for it, so the per-step loop always runs.
    """

    # Both matrices that act on the recurrent path (h_prev -> m -> gates) are targets of weight drop.
    recurrent_weights = ("rnn.weight_hh_l0", "weight_mh")

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__(input_size, hidden_size, fused=False)
        bound = hidden_size**-0.5  # nn.LSTM's default range for every weight
        self.weight_mx = nn.Parameter(torch.empty(hidden_size, input_size).uniform_(-bound, bound))
        self.weight_mh = nn.Parameter(torch.empty(hidden_size, hidden_size).uniform_(-bound, bound))

    def hoist(self, x: Tensor) -> tuple[Tensor, Tensor]:
        rnn, n = self.rnn, self.hidden_size
        batch, steps = x.shape[:2]
        # The two recurrent matrices, applied once per step, with one weight-gradient GEMM per window each.
        self.window.mh = RecurrentMatmul(self.weight_mh, batch, steps)
        self.window.hm = RecurrentMatmul(rnn.weight_hh_l0, batch, steps)
        weight = torch.cat([rnn.weight_ih_l0, self.weight_mx])  # (4n + n, m): the gates' W^{*x} and W^{mx} read x
        bias = torch.cat([rnn.bias_ih_l0 + rnn.bias_hh_l0, rnn.bias_ih_l0.new_zeros(n)])
        gates_x, mx = window_linear(x, weight, bias).split([4 * n, n], dim=-1)  # (B, T, 4n), (B, T, n)
        return gates_x, mx

    def step(self, x_t: tuple[Tensor, Tensor], state: State) -> State:
        gates_x, mx = x_t
        h, c = state
        m = mx * self.window.mh(h)  # (B, n): h_m = (W^{mx} x) * (W^{mh} h_prev)
        return lstm_update(self.window.hm(m, add=gates_x), c)  # gates (B, 4n) = W^{*x} x + W^{*m} h_m + b


class MLSTM(RecurrentStack):
    """A stack of mLSTM layers (Krause et al. 2016; Melis et al. 2020 §4.2).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    ``hidden_size`` is also the width of ``h_m``; weight drop acts on ``W^{mh}`` and the LSTM's ``W^{*m}``.

    Args:
        forget_bias: effective initial forget-gate bias (counted once, see :mod:`zoo.lstm`); ``None`` keeps the init.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        forget_bias: float | None = 1.0,
        **stack_options: Any,
    ) -> None:
        super().__init__(MLSTMLayer, input_size, hidden_size, num_layers, **stack_options)
        self.set_forget_bias(forget_bias)
