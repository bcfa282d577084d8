"""The LSTM gate ablations of Jozefowicz, Zaremba & Sutskever 2015 (Table 1): LSTM-f, LSTM-i and LSTM-o.

Each one is the zoo's LSTM (``zoo/lstm.py``) with one gate removed, i.e. fixed to 1 (§4: "When [the output gate is]
removed, h_t simply becomes tanh(c_t)"). The removed gate has no weights at all, so every parameter is used::

    full LSTM              i = sigm(W_xi x + W_hi h + b_i)   f = sigm(W_xf x + W_hf h + b_f)
                           g = tanh(W_xg x + W_hg h + b_g)   o = sigm(W_xo x + W_ho h + b_o)
                           c' = f * c + i * g                h' = o * tanh(c')

    LSTM-f (no forget)     c' = c + i * g                    h' = o * tanh(c')       f = 1
    LSTM-i (no input)      c' = f * c + g                    h' = o * tanh(c')       i = 1
    LSTM-o (no output)     c' = f * c + i * g                h' = tanh(c')           o = 1

The paper's own names are shifted: its ``i_t = tanh(...)`` is our candidate g and its input gate is ``j_t``; "no input
gate" removes ``j_t``. Its §2 also prints ``o_t = tanh(...)``, a misprint as far as we can tell (a gate in (-1, 1)
would flip the sign of ``tanh(c)``; Zaremba's and every other implementation use a sigmoid): we keep the sigmoid of
``zoo/lstm.py``, so that each ablation is exactly the LSTM with one gate fixed to 1.

Layout: one ``weight_ih`` (3H, I), ``weight_hh`` (3H, H) and a single ``bias`` (3H) (not PyTorch's summed pair, so a
forget bias is counted once), rows in the order given by each layer's ``gates``: the two sigmoid gates first and the
candidate g last, so one ``sigmoid`` covers both gates.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from zoo.kernels import RecurrentMatmul, window_linear
from zoo.layers import CellLayer
from zoo.stack import RecurrentStack
from zoo.state import State


class _ThreeGateLSTMLayer(CellLayer):
    """An LSTM layer with one of its three gates removed; subclasses name their ``gates`` and write :meth:`step`."""

    state_size = 2  # (h, c)
    recurrent_weights = ("weight_hh",)
    gates: tuple[str, str, str]  # row blocks of the weights, the two sigmoid gates first, then the candidate "g"

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__(input_size, hidden_size)
        rows = 3 * hidden_size
        self.weight_ih = nn.Parameter(torch.empty(rows, input_size))
        self.weight_hh = nn.Parameter(torch.empty(rows, hidden_size))
        self.bias = nn.Parameter(torch.empty(rows))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(-1/sqrt(H), 1/sqrt(H)) like ``nn.LSTM`` (the stack's ``init_range`` overrides it)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def rows(self, gate: str) -> slice:
        """The rows of ``weight_ih`` / ``weight_hh`` / ``bias`` that belong to ``gate`` ("i", "f", "g" or "o")."""
        k = self.gates.index(gate)
        return slice(k * self.hidden_size, (k + 1) * self.hidden_size)

    def set_forget_bias(self, value: float) -> None:
        """Set the forget-gate bias to ``value`` (Jozefowicz et al. 2015 §2.2: 1, "LSTM-b")."""
        with torch.no_grad():
            self.bias[self.rows("f")] = value

    def hoist(self, x: Tensor) -> Tensor:
        self.window.hidden_matmul = RecurrentMatmul(self.weight_hh, x.size(0), x.size(1))
        return window_linear(x, self.weight_ih, self.bias)  # (B, T, 3H)

    def _gates(self, x_t: Tensor, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The two sigmoid gates (in ``gates`` order) and the candidate g, from one fused matmul."""
        H = self.hidden_size
        # split, not two slices: its backward is one cat, where each slice's backward zero-fills a (B, 3H) tensor.
        sigmoid_part, g = self.window.hidden_matmul(h, add=x_t).split([2 * H, H], dim=1)  # (B, 2H), (B, H)
        a, b = torch.sigmoid(sigmoid_part).chunk(2, dim=1)  # (B, H) each
        return a, b, torch.tanh(g)


class LSTMNoForgetLayer(_ThreeGateLSTMLayer):
    """LSTM-f: ``f = 1``, so the cell only accumulates, ``c' = c + i * g``."""

    gates = ("i", "o", "g")

    def step(self, x_t: Tensor, state: State) -> State:
        h, c = state
        i, o, g = self._gates(x_t, h)
        c = torch.addcmul(c, i, g)
        return o * torch.tanh(c), c


class LSTMNoInputLayer(_ThreeGateLSTMLayer):
    """LSTM-i: ``i = 1``, so the whole candidate is written, ``c' = f * c + g``."""

    gates = ("f", "o", "g")

    def step(self, x_t: Tensor, state: State) -> State:
        h, c = state
        f, o, g = self._gates(x_t, h)
        c = torch.addcmul(g, f, c)
        return o * torch.tanh(c), c


class LSTMNoOutputLayer(_ThreeGateLSTMLayer):
    """LSTM-o: ``o = 1``, so the whole squashed cell is exposed, ``h' = tanh(c')``."""

    gates = ("i", "f", "g")

    def step(self, x_t: Tensor, state: State) -> State:
        h, c = state
        i, f, g = self._gates(x_t, h)
        c = torch.addcmul(f * c, i, g)
        return torch.tanh(c), c


class LSTMNoForget(RecurrentStack):
    """A stack of LSTM-f layers (no forget gate). There is no ``forget_bias`` option: there is no forget gate.

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, **stack_options: Any) -> None:
        super().__init__(LSTMNoForgetLayer, input_size, hidden_size, num_layers, **stack_options)


class _WithForgetGate(RecurrentStack):
    """LSTM-i and LSTM-o keep the forget gate: one stack around either's layer, with the LSTM's ``forget_bias``."""

    layer_class: type[_ThreeGateLSTMLayer]

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        forget_bias: float | None = 1.0,
        **stack_options: Any,
    ) -> None:
        super().__init__(self.layer_class, input_size, hidden_size, num_layers, **stack_options)
        self.set_forget_bias(forget_bias)


class LSTMNoInput(_WithForgetGate):
    """A stack of LSTM-i layers (no input gate).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).

    Args:
        forget_bias: initial forget-gate bias (1 as in LSTM-b); ``None`` leaves the bias as initialised.
    """

    layer_class = LSTMNoInputLayer


class LSTMNoOutput(_WithForgetGate):
    """A stack of LSTM-o layers (no output gate).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).

    Args:
        forget_bias: initial forget-gate bias (1 as in LSTM-b); ``None`` leaves the bias as initialised.
    """

    layer_class = LSTMNoOutputLayer
