"""GRU (Cho et al. 2014) in the form of ``nn.GRU`` / cuDNN.

Equations for each layer and step (PyTorch's gate order r, z, n)::

    r = sigm(W_xr x + b_xr + W_hr h + b_hr)
    z = sigm(W_xz x + b_xz + W_hz h + b_hz)
    n = tanh(W_xn x + b_xn + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h

Note: this is the "reset after" variant that cuDNN implements: the reset gate multiplies ``W_hn h + b_hn``. The form
written in Jozefowicz et al. 2015 §2.3 applies it before the matmul, ``tanh(W_xh x + W_hh (r * h) + b_h)``; that
variant belongs with the paper's other cells (MUT1-3), which have no fused kernel either.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from zoo.base import FusedRecurrentStack


class GRU(FusedRecurrentStack):
    """A stack of GRU layers; fused kernel when possible, per-step loop when a reset falls inside the window.

    Args:
        input_size: size of each input vector.
        hidden_size: units per layer.
        num_layers: stacked layers.
        dropout: dropout on each layer's output except the last (as ``nn.GRU``).
        init_range: if set, every weight and bias starts Uniform(-init_range, init_range); ``None`` keeps PyTorch's.
        fused: use the fused kernel when no reset falls inside the window.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        dropout: float = 0.0,
        init_range: float | None = None,
        fused: bool = True,
    ) -> None:
        rnn = nn.GRU(input_size, hidden_size, num_layers, batch_first=True, dropout=dropout)
        super().__init__(rnn, init_range, fused)

    def _cell_loop(
        self, layer: int, x: Tensor, state: tuple[Tensor, ...], keep_at: dict[int, Tensor]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        w_ih, w_hh, b_ih, b_hh = self._layer_weights(layer)
        x_gates = torch.addmm(b_ih, x.flatten(0, 1), w_ih.t()).view(x.size(0), x.size(1), -1)  # (B, T, 3H)
        (h,) = state
        outputs = []
        for t in range(x.size(1)):
            if t in keep_at:
                h = h * keep_at[t].unsqueeze(1)
            h_gates = torch.addmm(b_hh, h, w_hh.t())  # (B, 3H)
            x_r, x_z, x_n = x_gates[:, t].chunk(3, dim=1)
            h_r, h_z, h_n = h_gates.chunk(3, dim=1)
            r = torch.sigmoid(x_r + h_r)
            z = torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + r * h_n)
            h = (1 - z) * n + z * h
            outputs.append(h)
        return torch.stack(outputs, dim=1), (h,)
