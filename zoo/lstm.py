"""LSTM (Hochreiter & Schmidhuber 1997) with the forget-gate bias of Gers et al. 2000 / Jozefowicz et al. 2015.

Equations (no peepholes; PyTorch gate order i, f, g, o), for each layer and step::

    i = sigm(W_xi x + W_hi h + b_i)        f = sigm(W_xf x + W_hf h + b_f)
    g = tanh(W_xg x + W_hg h + b_g)        o = sigm(W_xo x + W_ho h + b_o)
    c' = f * c + i * g                     h' = o * tanh(c')

``cap_input_gate`` (Melis et al.'s released code, deepmind/lamb ``tiled_lstm.py``; off by default) caps the input gate
at one minus the forget gate, ``c' = f * c + min(1 - f, i) * g``, so that the cell is at most a convex mix of its old
value and the candidate. The fused kernel cannot compute it: a capped layer runs the per-step loop.

Forget-gate bias: Jozefowicz et al. 2015 §2.2 recommend b_f = 1 ("LSTM-b"). PyTorch keeps two biases
(``bias_ih`` and ``bias_hh``) that are *summed*, so setting both forget slices to 1 gives an effective bias of 2
(pytorch#750); we put the whole value in ``bias_ih`` and zero the ``bias_hh`` slice.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from zoo.kernels import RecurrentMatmul, window_linear
from zoo.layers import FusedLayer
from zoo.stack import RecurrentStack
from zoo.state import State


def lstm_update(gates: Tensor, c: Tensor, cap_input_gate: bool = False) -> State:
    """The LSTM's state update from its summed gate pre-activations (PyTorch gate order i, f, g, o).

    Args:
        gates: ``(B, 4H)`` ``W_x x + W_h h + b``.
        c: ``(B, H)`` the previous cell.
        cap_input_gate: use ``min(1 - f, i)`` as the input gate (lamb's ``cap_input_gate``).

    Returns:
        ``(h, c)`` after the step.
    """
    i, f, g, o = gates.chunk(4, dim=1)
    forget, write = torch.sigmoid(f), torch.sigmoid(i)
    if cap_input_gate:
        write = torch.minimum(1 - forget, write)
    c = forget * c + write * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


class LSTMLayer(FusedLayer):
    """One LSTM layer over an ``nn.LSTM``'s parameters."""

    state_size = 2  # (h, c)

    def __init__(self, input_size: int, hidden_size: int, fused: bool = True, cap_input_gate: bool = False) -> None:
        super().__init__(nn.LSTM(input_size, hidden_size, batch_first=True), fused and not cap_input_gate)
        self.cap_input_gate = cap_input_gate

    def hoist(self, x: Tensor) -> Tensor:
        rnn = self.rnn
        self.window.hidden_matmul = RecurrentMatmul(rnn.weight_hh_l0, x.size(0), x.size(1))
        return window_linear(x, rnn.weight_ih_l0, rnn.bias_ih_l0 + rnn.bias_hh_l0)  # (B, T, 4H)

    def step(self, x_t: Tensor, state: State) -> State:
        h, c = state
        return lstm_update(self.window.hidden_matmul(h, add=x_t), c, self.cap_input_gate)  # gates (B, 4H)

    def set_forget_bias(self, value: float) -> None:
        """Make the effective forget-gate bias exactly ``value`` (all of it in ``bias_ih``, see the module doc)."""
        forget = slice(self.hidden_size, 2 * self.hidden_size)
        with torch.no_grad():
            self.rnn.bias_ih_l0[forget] = value
            self.rnn.bias_hh_l0[forget] = 0.0


class LSTM(RecurrentStack):
    """A stack of LSTM layers; fused kernel when possible, per-step loop when a reset falls inside the window.

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).

    Args:
        forget_bias: effective initial forget-gate bias; ``None`` leaves the bias as initialised.
        fused: use the fused kernel when it computes the same function (``False`` always loops, for testing).
        cap_input_gate: ``c' = f * c + min(1 - f, i) * g`` (lamb's option; the per-step loop computes it).
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        forget_bias: float | None = 1.0,
        fused: bool = True,
        cap_input_gate: bool = False,
        **stack_options: Any,
    ) -> None:
        layer = partial(LSTMLayer, fused=fused, cap_input_gate=cap_input_gate)
        super().__init__(layer, input_size, hidden_size, num_layers, **stack_options)
        self.set_forget_bias(forget_bias)
