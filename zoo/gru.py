"""GRU (Cho et al. 2014) in the form of ``nn.GRU`` / cuDNN.

Equations for each layer and step (PyTorch's gate order r, z, n)::

    r = sigm(W_xr x + b_xr + W_hr h + b_hr)
    z = sigm(W_xz x + b_xz + W_hz h + b_hz)
    n = tanh(W_xn x + b_xn + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h

Note: this is the "reset after" variant that cuDNN implements: the reset gate multiplies ``W_hn h + b_hn``. The form
written in Jozefowicz et al. 2015 §2.3 (and Cho et al. 2014) applies it before the matmul::

    r = sigm(W_xr x + W_hr h + b_r)
    z = sigm(W_xz x + W_hz h + b_z)
    h~ = tanh(W_xh x + W_hh (r * h) + b_h)
    h' = z * h + (1 - z) * h~

That is :class:`GRUPaper` below (registry ``gru_paper``). It has no fused kernel, and needs two matmuls per step in
sequence (``r`` must be known before ``W_hh (r * h)``), where the cuDNN form needs one.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from zoo.kernels import RecurrentMatmul, window_linear
from zoo.layers import CellLayer, FusedLayer, lerp
from zoo.stack import RecurrentStack
from zoo.state import State


class GRULayer(FusedLayer):
    """One GRU layer over an ``nn.GRU``'s parameters."""

    def __init__(self, input_size: int, hidden_size: int, fused: bool = True) -> None:
        super().__init__(nn.GRU(input_size, hidden_size, batch_first=True), fused)

    def hoist(self, x: Tensor) -> Tensor:
        self.window.hidden_matmul = RecurrentMatmul(self.rnn.weight_hh_l0, x.size(0), x.size(1))
        return window_linear(x, self.rnn.weight_ih_l0, self.rnn.bias_ih_l0)  # (B, T, 3H)

    def step(self, x_t: Tensor, state: State) -> State:
        (h,) = state
        h_gates = self.window.hidden_matmul(h, add=self.rnn.bias_hh_l0)  # (B, 3H)
        x_r, x_z, x_n = x_t.chunk(3, dim=1)
        h_r, h_z, h_n = h_gates.chunk(3, dim=1)
        r = torch.sigmoid(x_r + h_r)
        z = torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return ((1 - z) * n + z * h,)


class GRU(RecurrentStack):
    """A stack of GRU layers; fused kernel when possible, per-step loop when a reset falls inside the window.

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).

    Args:
        fused: use the fused kernel when it computes the same function.
    """

    def __init__(
        self, input_size: int, hidden_size: int, num_layers: int = 1, fused: bool = True, **stack_options: Any
    ) -> None:
        super().__init__(partial(GRULayer, fused=fused), input_size, hidden_size, num_layers, **stack_options)


class GRUPaperLayer(CellLayer):
    """One GRU layer in the form of Jozefowicz et al. 2015 §2.3: the reset gate acts on ``h`` before ``W_hh``.

    Parameters: ``weight_ih`` (3H, I) with rows for r, z and the candidate h~; ``weight_hh_rz`` (2H, H) with rows for
    r and z (one matmul for both gates); ``weight_hh`` (H, H), the paper's W_hh; one ``bias`` (3H) for r, z, h~.
    """

    recurrent_weights = ("weight_hh_rz", "weight_hh")

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__(input_size, hidden_size)
        self.weight_ih = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hh_rz = nn.Parameter(torch.empty(2 * hidden_size, hidden_size))
        self.weight_hh = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(3 * hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(-1/sqrt(H), 1/sqrt(H)) like ``nn.GRU`` (the stack's ``init_range`` overrides it)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def hoist(self, x: Tensor) -> tuple[Tensor, Tensor]:
        batch, steps, _ = x.shape
        self.window.gates_matmul = RecurrentMatmul(self.weight_hh_rz, batch, steps)
        self.window.hidden_matmul = RecurrentMatmul(self.weight_hh, batch, steps)
        H = self.hidden_size
        x_rz, x_h = window_linear(x, self.weight_ih, self.bias).split([2 * H, H], dim=-1)
        return x_rz, x_h  # (B, T, 2H) for r and z, (B, T, H) for h~

    def step(self, x_t: tuple[Tensor, Tensor], state: State) -> State:
        (h,) = state
        x_rz, x_h = x_t
        r, z = torch.sigmoid(self.window.gates_matmul(h, add=x_rz)).chunk(2, dim=1)  # (B, H) each
        candidate = torch.tanh(self.window.hidden_matmul(r * h, add=x_h))  # reset *before* the matmul
        return (lerp(candidate, h, z),)  # z * h + (1 - z) * candidate


class GRUPaper(RecurrentStack):
    """A stack of paper-form GRU layers (Jozefowicz et al. 2015 §2.3; reset gate before the matmul), always per step.

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, **stack_options: Any) -> None:
        super().__init__(GRUPaperLayer, input_size, hidden_size, num_layers, **stack_options)
