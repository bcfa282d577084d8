"""GRU (Cho et al. 2014) in the form of ``nn.GRU`` / cuDNN.

Equations for each layer and step (PyTorch's gate order r, z, n)::

    r = sigm(W_xr x + b_xr + W_hr h + b_hr)
    z = sigm(W_xz x + b_xz + W_hz h + b_hz)
    n = tanh(W_xn x + b_xn + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h

Note: this is the "reset after" variant that cuDNN implements: the reset gate multiplies ``W_hn h + b_hn``. The form
written in Jozefowicz et al. 2015 §2.3 applies it before the matmul, ``tanh(W_xh x + W_hh (r * h) + b_h)``; that
variant is ``jozefowicz.py``'s ``gru_paper``, which has no fused kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zoo.base import FusedLayer, RecurrentStack, State


class GRULayer(FusedLayer):
    """One GRU layer over an ``nn.GRU``'s parameters."""

    def __init__(self, input_size: int, hidden_size: int, fused: bool = True) -> None:
        super().__init__(nn.GRU(input_size, hidden_size, batch_first=True), fused)

    def hoist(self, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, self.rnn.weight_ih_l0, self.rnn.bias_ih_l0)  # (B, T, 3H)

    def step(self, x_t: Tensor, state: State) -> State:
        (h,) = state
        h_gates = torch.addmm(self.rnn.bias_hh_l0, h, self.rnn.weight_hh_l0.t())  # (B, 3H)
        x_r, x_z, x_n = x_t.chunk(3, dim=1)
        h_r, h_z, h_n = h_gates.chunk(3, dim=1)
        r = torch.sigmoid(x_r + h_r)
        z = torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return ((1 - z) * n + z * h,)


class GRU(RecurrentStack):
    """A stack of GRU layers; fused kernel when possible, per-step loop when a reset falls inside the window.

    Args:
        input_size: size of each input vector.
        hidden_size: units per layer.
        num_layers: stacked layers.
        fused: use the fused kernel when it computes the same function.
        **stack_options: dropout, locked_dropout, state_dropout, weight_drop, init_range (see
            :class:`~zoo.base.RecurrentStack`).
    """

    def __init__(
        self, input_size: int, hidden_size: int, num_layers: int = 1, fused: bool = True, **stack_options: Any
    ) -> None:
        layers = [GRULayer(input_size if i == 0 else hidden_size, hidden_size, fused) for i in range(num_layers)]
        super().__init__(layers, **stack_options)
