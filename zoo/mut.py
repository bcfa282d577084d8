"""MUT1, MUT2 and MUT3: the three best cells of the architecture search of Jozefowicz et al. 2015 (§4).

All three are mutations of the paper-form GRU (``zoo/gru.py``'s ``gru_paper``). The equations as written in §4, with
``h = h_t`` the previous state and ``h' = h_{t+1}``::

    MUT1   z  = sigm(W_xz x + b_z)                               # z does not see h
           r  = sigm(W_xr x + W_hr h + b_r)
           h' = tanh(W_hh (r * h) + tanh(x) + b_h) * z + h * (1 - z)  # x enters the candidate through tanh, no matrix

    MUT2   z  = sigm(W_xz x + W_hz h + b_z)
           r  = sigm(x + W_hr h + b_r)                            # no matrix on x in the reset gate
           h' = tanh(W_hh (r * h) + W_xh x + b_h) * z + h * (1 - z)

    MUT3   z  = sigm(W_xz x + W_hz tanh(h) + b_z)                 # z sees tanh(h)
           r  = sigm(W_xr x + W_hr h + b_r)
           h' = tanh(W_hh (r * h) + W_xh x + b_h) * z + h * (1 - z)

Note the update convention: here ``z`` weights the *candidate*, whereas the GRU's ``z`` weights the old state
(``h' = z * h + (1 - z) * h~``); a MUT cell equals a GRU whose ``z`` is replaced by ``1 - z``.

``tanh(x)`` (MUT1) and ``x + ...`` (MUT2) add the input to an H-wide vector with no weight matrix, so they need
``input_size == hidden_size``, which is how the paper used them (§3.2: "all nodes have the same dimensionality") and how
a language model with ``embedding_size == hidden_size`` (every layer above the first, too) uses them: then the cell is
exactly as above. When the sizes differ, a layer adds one learned, bias-free projection ``P`` (H, I) and uses ``P x``
in place of ``x`` in that term only (``input_projection``; ``None`` when the sizes match). This is our extension, not
the paper's, and it exists so that MUT1/MUT2 can be stacked on any input width.

Speed: everything that depends on x alone is hoisted out of the time loop (for MUT1 the whole of ``z``). The state
enters through at most two matmuls per step in sequence: ``r`` must be known before ``W_hh (r * h)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from zoo.kernels import RecurrentMatmul, window_linear
from zoo.layers import CellLayer, lerp
from zoo.stack import RecurrentStack
from zoo.state import State


class _MUTLayer(CellLayer):
    """What the three cells share: the uniform init and the optional input projection."""

    def __init__(self, input_size: int, hidden_size: int, needs_square_input: bool) -> None:
        super().__init__(input_size, hidden_size)
        # Only MUT1 and MUT2 add x itself to an H-wide vector; see the module docstring.
        if needs_square_input and input_size != hidden_size:
            self.input_projection = nn.Parameter(torch.empty(hidden_size, input_size))
        else:
            self.register_parameter("input_projection", None)

    def reset_parameters(self) -> None:
        """Uniform(-1/sqrt(H), 1/sqrt(H)) like ``nn.GRU`` (the stack's ``init_range`` overrides it)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def _square(self, x: Tensor) -> Tensor:
        """``x`` where the paper adds it to an H-wide vector: itself, or ``P x`` when ``input_size != hidden_size``."""
        return x if self.input_projection is None else window_linear(x, self.input_projection)  # (B, T, H)


class MUT1Layer(_MUTLayer):
    """MUT1. Parameters: ``weight_ih`` (2H, I) rows z, r; ``weight_hr``, ``weight_hh`` (H, H); ``bias`` (3H) z, r, h."""

    recurrent_weights = ("weight_hr", "weight_hh")

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__(input_size, hidden_size, needs_square_input=True)
        self.weight_ih = nn.Parameter(torch.empty(2 * hidden_size, input_size))
        self.weight_hr = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.weight_hh = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(3 * hidden_size))
        self.reset_parameters()

    def hoist(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        H, (batch, steps, _) = self.hidden_size, x.shape
        self.window.reset_matmul = RecurrentMatmul(self.weight_hr, batch, steps)
        self.window.hidden_matmul = RecurrentMatmul(self.weight_hh, batch, steps)
        b_zr, b_h = self.bias.split([2 * H, H])
        x_z, x_r = window_linear(x, self.weight_ih, b_zr).split(H, dim=-1)  # (B, T, H) each
        z = torch.sigmoid(x_z)  # z depends on x alone, so all of it is computed here
        return z, x_r, torch.tanh(self._square(x)) + b_h

    def step(self, x_t: tuple[Tensor, Tensor, Tensor], state: State) -> State:
        (h,) = state
        z, x_r, x_h = x_t
        r = torch.sigmoid(self.window.reset_matmul(h, add=x_r))
        candidate = torch.tanh(self.window.hidden_matmul(r * h, add=x_h))
        return (lerp(h, candidate, z),)  # candidate * z + h * (1 - z)


class MUT2Layer(_MUTLayer):
    """MUT2. Parameters: ``weight_ih`` (2H, I) rows z, h; ``weight_hh_zr`` (2H, H) rows z, r; ``weight_hh`` (H, H);
    ``bias`` (3H) z, r, h."""

    recurrent_weights = ("weight_hh_zr", "weight_hh")

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__(input_size, hidden_size, needs_square_input=True)
        self.weight_ih = nn.Parameter(torch.empty(2 * hidden_size, input_size))
        self.weight_hh_zr = nn.Parameter(torch.empty(2 * hidden_size, hidden_size))
        self.weight_hh = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(3 * hidden_size))
        self.reset_parameters()

    def hoist(self, x: Tensor) -> tuple[Tensor, Tensor]:
        H, (batch, steps, _) = self.hidden_size, x.shape
        self.window.gates_matmul = RecurrentMatmul(self.weight_hh_zr, batch, steps)
        self.window.hidden_matmul = RecurrentMatmul(self.weight_hh, batch, steps)
        b_zr, b_h = self.bias.split([2 * H, H])
        x_z, x_h = window_linear(x, self.weight_ih).split(H, dim=-1)  # (B, T, H) each: W_xz x, W_xh x
        # z and r share one recurrent matmul, so their input parts sit side by side: [W_xz x + b_z, x + b_r].
        x_zr = torch.cat([x_z, self._square(x)], dim=-1) + b_zr  # (B, T, 2H)
        return x_zr, x_h + b_h

    def step(self, x_t: tuple[Tensor, Tensor], state: State) -> State:
        (h,) = state
        x_zr, x_h = x_t
        z, r = torch.sigmoid(self.window.gates_matmul(h, add=x_zr)).chunk(2, dim=1)  # (B, H) each
        candidate = torch.tanh(self.window.hidden_matmul(r * h, add=x_h))
        return (lerp(h, candidate, z),)  # candidate * z + h * (1 - z)


class MUT3Layer(_MUTLayer):
    """MUT3. Parameters: ``weight_ih`` (3H, I) rows z, r, h; ``weight_hz``, ``weight_hr``, ``weight_hh`` (H, H);
    ``bias`` (3H) z, r, h."""

    recurrent_weights = ("weight_hz", "weight_hr", "weight_hh")

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__(input_size, hidden_size, needs_square_input=False)
        self.weight_ih = nn.Parameter(torch.empty(3 * hidden_size, input_size))
        self.weight_hz = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.weight_hr = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.weight_hh = nn.Parameter(torch.empty(hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(3 * hidden_size))
        self.reset_parameters()

    def hoist(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch, steps, _ = x.shape
        self.window.update_matmul = RecurrentMatmul(self.weight_hz, batch, steps)
        self.window.reset_matmul = RecurrentMatmul(self.weight_hr, batch, steps)
        self.window.hidden_matmul = RecurrentMatmul(self.weight_hh, batch, steps)
        return window_linear(x, self.weight_ih, self.bias).chunk(3, dim=-1)  # (B, T, H) each: z, r, h

    def step(self, x_t: tuple[Tensor, Tensor, Tensor], state: State) -> State:
        (h,) = state
        x_z, x_r, x_h = x_t
        # z sees tanh(h) and r sees h, so their matmuls cannot share an input.
        z = torch.sigmoid(self.window.update_matmul(torch.tanh(h), add=x_z))
        r = torch.sigmoid(self.window.reset_matmul(h, add=x_r))
        candidate = torch.tanh(self.window.hidden_matmul(r * h, add=x_h))
        return (lerp(h, candidate, z),)  # candidate * z + h * (1 - z)


class MUT1(RecurrentStack):
    """A stack of MUT1 layers (Jozefowicz et al. 2015 §4).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    When ``input_size`` differs from ``hidden_size`` the first layer learns a projection for its ``tanh(x)`` term (see
    the module docstring).
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, **stack_options: Any) -> None:
        super().__init__(MUT1Layer, input_size, hidden_size, num_layers, **stack_options)


class MUT2(RecurrentStack):
    """A stack of MUT2 layers (Jozefowicz et al. 2015 §4).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    When ``input_size`` differs from ``hidden_size`` the first layer learns a projection for the ``x`` of its reset
    gate (see the module docstring).
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, **stack_options: Any) -> None:
        super().__init__(MUT2Layer, input_size, hidden_size, num_layers, **stack_options)


class MUT3(RecurrentStack):
    """A stack of MUT3 layers (Jozefowicz et al. 2015 §4).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, **stack_options: Any) -> None:
        super().__init__(MUT3Layer, input_size, hidden_size, num_layers, **stack_options)
