"""Fast-Slow RNN (Mujika, Meier & Steger, NeurIPS 2017; ``papers/003_…``, "FS-RNN"), with LSTM cells (FS-LSTM).

``k`` *fast* cells ``F_1 … F_k`` run one after the other at every step (a deep transition), and one *slow* cell ``S``
sits between ``F_1`` and ``F_2``. Writing ``f^Q(h, x)`` for cell ``Q`` mapping its previous state ``h`` and an input
``x`` to its new state::

    h_t^{F1} = f^{F1}(h_{t-1}^{Fk}, x_t)
    h_t^{S}  = f^{S}(h_{t-1}^{S}, h_t^{F1})
    h_t^{F2} = f^{F2}(h_t^{F1}, h_t^{S})
    h_t^{Fi} = f^{Fi}(h_t^{F(i-1)})           for 3 <= i <= k   (no external input: only the previous fast cell)
    y_t      = h_t^{Fk}

With LSTM cells the fast state handed along the chain is the pair ``(h, c)`` (the authors' ``FSRNN.py`` passes
``F_state`` from cell to cell), so a fast cell's "previous state" is the previous fast cell's ``(h, c)``; ``F_i`` for
``i >= 3`` is an LSTM without input weights, ``gates = U h + b``. Each cell is the LSTM of ``zoo/lstm.py`` (gate order
i, f, g, o; one bias per cell, whose forget slice starts at ``forget_bias`` — the authors' cells add 1.0). The
authors' cells are also layer-normalised and use zoneout; those are not part of the equations and are left out.

State per layer: ``(h_fast, c_fast, h_slow, c_slow)``, fast tensors ``(B, hidden_size)``, slow ``(B, slow_size)``;
``h_fast`` (``h^{Fk}``) is the output. Weight drop (DropConnect) covers every state-to-state matrix: ``U`` of every fast
cell (including ``F_2``'s weight on ``h^{F1}``, the link that carries the fast state) and ``U`` of the slow cell.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from zoo.errors import ConfigError
from zoo.kernels import RecurrentMatmul, window_linear
from zoo.layers import CellLayer
from zoo.stack import RecurrentStack
from zoo.state import State


def _lstm_update(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """The LSTM state update from its pre-activations ``gates`` ``(B, 4H)`` (order i, f, g, o) and ``c`` ``(B, H)``."""
    hidden = c.size(1)
    sig = torch.sigmoid(gates)  # the g block's sigmoid is wasted; one call beats three
    i, f, o = sig[:, :hidden], sig[:, hidden : 2 * hidden], sig[:, 3 * hidden :]
    g = torch.tanh(gates[:, 2 * hidden : 3 * hidden])
    c = torch.addcmul(f * c, i, g)
    return o * torch.tanh(c), c


class _LSTMWeights(nn.Module):
    """One LSTM cell's parameters: ``weight_ih`` ``(4H, I)`` (absent when ``input_size`` is 0), ``weight_hh``
    ``(4H, H)`` and one ``bias`` ``(4H)``, initialised like ``nn.LSTM`` (Uniform(±1/sqrt(H)))."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        if input_size > 0:
            self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(4 * hidden_size))
        bound = 1 / math.sqrt(hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def set_forget_bias(self, value: float) -> None:
        with torch.no_grad():
            self.bias[self.hidden_size : 2 * self.hidden_size] = value


class FSRNNLayer(CellLayer):
    """One Fast-Slow LSTM block: ``fast_cells`` fast LSTM cells of ``hidden_size`` around one slow cell.

    Args:
        input_size: width of ``x_t`` (the input of ``F_1`` only).
        hidden_size: units of every fast cell, and the width of the output.
        slow_size: units of the slow cell.
        fast_cells: ``k >= 2``.

    Attributes:
        fast: the fast cells' weights, ``fast[0]`` is ``F_1``; ``fast[i].weight_ih`` exists for ``F_1`` (on ``x``)
            and ``F_2`` (on ``h^S``) only.
        slow: the slow cell's weights (``weight_ih`` on ``h^{F1}``).
    """

    state_size = 4  # (h_fast, c_fast, h_slow, c_slow)

    def __init__(self, input_size: int, hidden_size: int, slow_size: int, fast_cells: int = 2) -> None:
        super().__init__(input_size, hidden_size)
        self.slow_size = slow_size
        self.fast_cells = fast_cells
        fast_inputs = [input_size, slow_size] + [0] * (fast_cells - 2)
        self.fast = nn.ModuleList(_LSTMWeights(n, hidden_size) for n in fast_inputs)
        self.slow = _LSTMWeights(hidden_size, slow_size)
        self.recurrent_weights = tuple(f"fast.{i}.weight_hh" for i in range(fast_cells)) + ("slow.weight_hh",)

    def initial_state(self, batch_size: int, like: Tensor) -> State:
        fast = like.new_zeros(batch_size, self.hidden_size)
        slow = like.new_zeros(batch_size, self.slow_size)
        return fast, fast.clone(), slow, slow.clone()

    def hoist(self, x: Tensor) -> Tensor:
        batch, steps = x.size(0), x.size(1)
        f1, f2, slow = self.fast[0], self.fast[1], self.slow
        # One RecurrentMatmul per per-step product (each called once per step): the weight gradients come out as one
        # GEMM per window.
        w = self.window
        w.f1_hh = RecurrentMatmul(f1.weight_hh, batch, steps)
        w.slow_ih = RecurrentMatmul(slow.weight_ih, batch, steps)
        w.slow_hh = RecurrentMatmul(slow.weight_hh, batch, steps)
        w.f2_ih = RecurrentMatmul(f2.weight_ih, batch, steps)
        w.f2_hh = RecurrentMatmul(f2.weight_hh, batch, steps)
        w.deep_hh = [RecurrentMatmul(cell.weight_hh, batch, steps) for cell in self.fast[2:]]
        return window_linear(x, f1.weight_ih, f1.bias)  # (B, T, 4H): F_1's input projection for the window

    def step(self, x_t: Tensor, state: State) -> State:
        h, c, h_slow, c_slow = state
        w = self.window
        h, c = _lstm_update(w.f1_hh(h, add=x_t), c)  # F_1 from h^{Fk}_{t-1} and x_t
        h_slow, c_slow = _lstm_update(w.slow_hh(h_slow, add=w.slow_ih(h, add=self.slow.bias)), c_slow)  # S
        h, c = _lstm_update(w.f2_hh(h, add=w.f2_ih(h_slow, add=self.fast[1].bias)), c)  # F_2 from h^{F1}, h^S
        for cell, matmul in zip(self.fast[2:], w.deep_hh):
            h, c = _lstm_update(matmul(h, add=cell.bias), c)  # F_i (i >= 3), no input
        return h, c, h_slow, c_slow

    def set_forget_bias(self, value: float) -> None:
        """Start every cell's forget-gate bias at ``value``."""
        for cell in [*self.fast, self.slow]:
            cell.set_forget_bias(value)


class FSRNN(RecurrentStack):
    """A stack of Fast-Slow LSTM blocks (usually one: the block is already two levels deep).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    ``hidden_size`` is the width of every fast cell (the output's); block ``l > 0`` reads block ``l - 1``'s output
    ``h^{Fk}``; ``state_dropout`` masks ``h^{Fk}_{t-1}`` where it enters ``F_1``.

    Args:
        fast_cells: ``k``, the number of fast cells (at least 2).
        slow_size: units of the slow cell; ``None`` means ``hidden_size``.
        forget_bias: initial forget-gate bias of every cell; ``None`` leaves the uniform init.

    Raises:
        ConfigError: ``fast_cells < 2`` or a size below 1.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        fast_cells: int = 2,
        slow_size: int | None = None,
        forget_bias: float | None = 1.0,
        **stack_options: Any,
    ) -> None:
        if fast_cells < 2:
            raise ConfigError(
                f"fs_rnn: fast_cells must be at least 2 (F_1 and F_2 hold the slow cell), got {fast_cells}"
            )
        slow_size = hidden_size if slow_size is None else slow_size
        if slow_size < 1:
            raise ConfigError(f"fs_rnn: slow_size must be positive, got {slow_size}")
        layer = partial(FSRNNLayer, slow_size=slow_size, fast_cells=fast_cells)
        super().__init__(layer, input_size, hidden_size, num_layers, **stack_options)
        self.fast_cells = fast_cells
        self.slow_size = slow_size
        self.set_forget_bias(forget_bias)
