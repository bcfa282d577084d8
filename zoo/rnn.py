"""The tanh (Elman) RNN, the baseline of Jozefowicz et al. 2015: ``h' = tanh(W_x x + b_x + W_h h + b_h)``."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from zoo.kernels import RecurrentMatmul, window_linear
from zoo.layers import FusedLayer
from zoo.stack import RecurrentStack
from zoo.state import State


class TanhRNNLayer(FusedLayer):
    """One tanh RNN layer over an ``nn.RNN``'s parameters."""

    def __init__(self, input_size: int, hidden_size: int, fused: bool = True) -> None:
        super().__init__(nn.RNN(input_size, hidden_size, nonlinearity="tanh", batch_first=True), fused)

    def hoist(self, x: Tensor) -> Tensor:
        rnn = self.rnn
        self.window.hidden_matmul = RecurrentMatmul(rnn.weight_hh_l0, x.size(0), x.size(1))
        return window_linear(x, rnn.weight_ih_l0, rnn.bias_ih_l0 + rnn.bias_hh_l0)  # (B, T, H)

    def step(self, x_t: Tensor, state: State) -> State:
        return (torch.tanh(self.window.hidden_matmul(state[0], add=x_t)),)


class TanhRNN(RecurrentStack):
    """A stack of tanh RNN layers; fused kernel when possible, per-step loop when a reset falls inside the window.

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).

    Args:
        fused: use the fused kernel when it computes the same function.
    """

    def __init__(
        self, input_size: int, hidden_size: int, num_layers: int = 1, fused: bool = True, **stack_options: Any
    ) -> None:
        super().__init__(partial(TanhRNNLayer, fused=fused), input_size, hidden_size, num_layers, **stack_options)
