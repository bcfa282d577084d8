"""The tanh (Elman) RNN, the baseline of Jozefowicz et al. 2015: ``h' = tanh(W_x x + b_x + W_h h + b_h)``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from zoo.base import FusedRecurrentStack


class TanhRNN(FusedRecurrentStack):
    """A stack of tanh RNN layers; fused kernel when possible, per-step loop when a reset falls inside the window.

    Args:
        input_size: size of each input vector.
        hidden_size: units per layer.
        num_layers: stacked layers.
        dropout: dropout on each layer's output except the last (as ``nn.RNN``).
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
        rnn = nn.RNN(input_size, hidden_size, num_layers, nonlinearity="tanh", batch_first=True, dropout=dropout)
        super().__init__(rnn, init_range, fused)

    def _cell_loop(
        self, layer: int, x: Tensor, state: tuple[Tensor, ...], keep_at: dict[int, Tensor]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        w_ih, w_hh, b_ih, b_hh = self._layer_weights(layer)
        x_proj = torch.addmm(b_ih + b_hh, x.flatten(0, 1), w_ih.t()).view(x.size(0), x.size(1), -1)  # (B, T, H)
        (h,) = state
        outputs = []
        for t in range(x.size(1)):
            if t in keep_at:
                h = h * keep_at[t].unsqueeze(1)
            h = torch.tanh(torch.addmm(x_proj[:, t], h, w_hh.t()))
            outputs.append(h)
        return torch.stack(outputs, dim=1), (h,)
