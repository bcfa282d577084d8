"""LSTM (Hochreiter & Schmidhuber 1997) with the forget-gate bias of Gers et al. 2000 / Jozefowicz et al. 2015.

Equations (no peepholes; PyTorch gate order i, f, g, o), for each layer and step::

    i = sigm(W_xi x + W_hi h + b_i)        f = sigm(W_xf x + W_hf h + b_f)
    g = tanh(W_xg x + W_hg h + b_g)        o = sigm(W_xo x + W_ho h + b_o)
    c' = f * c + i * g                     h' = o * tanh(c')

Forget-gate bias: Jozefowicz et al. 2015 §2.2 recommend b_f = 1 ("LSTM-b"). PyTorch keeps two biases
(``bias_ih`` and ``bias_hh``) that are *summed*, so setting both forget slices to 1 gives an effective bias of 2
(pytorch#750); we put the whole value in ``bias_ih`` and zero the ``bias_hh`` slice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from zoo.base import FusedRecurrentStack


class LSTM(FusedRecurrentStack):
    """A stack of LSTM layers; fused kernel when possible, per-step loop when a reset falls inside the window.

    Args:
        input_size: size of each input vector.
        hidden_size: units per layer.
        num_layers: stacked layers.
        dropout: dropout on each layer's output except the last (as ``nn.LSTM``).
        forget_bias: effective initial forget-gate bias; ``None`` leaves the bias as initialised.
        init_range: if set, every weight and bias starts Uniform(-init_range, init_range) (Zaremba et al. 2014) before
            the forget bias is applied; ``None`` keeps PyTorch's Uniform(-1/sqrt(H), 1/sqrt(H)).
        fused: use the fused kernel when no reset falls inside the window (``False`` always loops, for testing).
    """

    state_size = 2  # (h, c)

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        dropout: float = 0.0,
        forget_bias: float | None = 1.0,
        init_range: float | None = None,
        fused: bool = True,
    ) -> None:
        rnn = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True, dropout=dropout)
        super().__init__(rnn, init_range, fused)
        self.forget_bias = forget_bias
        if forget_bias is not None:
            with torch.no_grad():
                forget = slice(hidden_size, 2 * hidden_size)
                for layer in range(num_layers):
                    getattr(self.rnn, f"bias_ih_l{layer}")[forget] = forget_bias
                    getattr(self.rnn, f"bias_hh_l{layer}")[forget] = 0.0

    def _cell_loop(
        self, layer: int, x: Tensor, state: tuple[Tensor, ...], keep_at: dict[int, Tensor]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        w_ih, w_hh, b_ih, b_hh = self._layer_weights(layer)
        # The input projection does not depend on h: one matmul for the whole window.
        x_gates = torch.addmm(b_ih + b_hh, x.flatten(0, 1), w_ih.t()).view(x.size(0), x.size(1), -1)  # (B, T, 4H)
        h, c = state
        outputs = []
        for t in range(x.size(1)):
            if t in keep_at:
                keep = keep_at[t].unsqueeze(1)  # (B, 1)
                h, c = h * keep, c * keep
            gates = torch.addmm(x_gates[:, t], h, w_hh.t())  # (B, 4H)
            i, f, g, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs, dim=1), (h, c)  # (B, T, H)
