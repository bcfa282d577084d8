"""ON-LSTM, the ordered-neurons LSTM (Shen, Tan, Sordoni & Courville, ICLR 2019; ``papers/002_…`` §4).

An LSTM whose cell state is ordered: high-ranking neurons keep long-term information, low-ranking ones are rewritten
often. Two *master* gates built with ``cumax`` decide, at each step, where the "erase" and the "write" regions end.
For each layer and step (``D`` = hidden size, ``C`` = chunk size, ``D_m = D / C``)::

    f = sigm(W_f x + U_f h + b_f)      i = sigm(W_i x + U_i h + b_i)      o = sigm(W_o x + U_o h + b_o)   (1-3)
    ĉ = tanh(W_c x + U_c h + b_c)                                                                         (4)
    cumax(z) = cumsum(softmax(z))                                                                         (6)
    f̃ = cumax(W_f̃ x + U_f̃ h + b_f̃)          # (B, D_m), increases from 0 to 1 along the neurons          (9)
    ĩ = 1 - cumax(W_ĩ x + U_ĩ h + b_ĩ)      # (B, D_m), decreases from 1 to 0                           (10)
    ω = f̃ ∘ ĩ                                                                                            (11)
    f̂ = f ∘ ω + (f̃ - ω) = f̃ ∘ (f ∘ ĩ + 1 - ĩ)                                                          (12)
    î = i ∘ ω + (ĩ - ω) = ĩ ∘ (i ∘ f̃ + 1 - f̃)                                                          (13)
    c' = f̂ ∘ c + î ∘ ĉ                                                                                  (14)
    h' = o ∘ tanh(c')                                                                                     (5)

Chunks (end of §4.2): the master gates have ``D_m = D / C`` units and each is repeated ``C`` times before it meets
``f`` and ``i``, so the ``C`` neighbouring neurons of a chunk share one master value. Here the repetition is a
broadcast: the ``D`` neurons are viewed as ``(D_m, C)`` (neuron ``j`` is in chunk ``j // C``) against ``(D_m, 1)``.
(eq. 14 in the translated text reads ``c_t = f̂_t ∘ c_t + …``; the right-hand ``c`` is ``c_{t-1}``, as in eq. 20.)

Expected split points (eq. 15), for unsupervised parsing (§5.2): ``d̂_t = D_m - Σ_k f̃_tk``, the expected number of
chunks the master forget gate erases, in ``[0, D_m - 1]`` (the last chunk's ``f̃`` is always 1). After every forward
each layer holds ``last_split_points`` ``(B, T)`` (detached) and :meth:`ONLSTM.split_points` stacks them to
``(L, B, T)``. The authors' code (``ON_LSTM.py``) returns ``1 - Σ f̃ / D_m = d̂ / D_m`` instead: divide by
:attr:`ONLSTMLayer.n_chunks` for that scale.

A consequence of eqs. 9-10 kept as written: the last chunk always has ``f̃ = 1`` and ``ĩ = 0`` (up to rounding), so
``f̂ = 1``, ``î = 0`` there and its cell state is never written; from a zero state it stays zero (the authors' code
behaves the same, their issue #27).

Layout of the fused gate rows, the authors' (so their weights port directly, with ``bias = ih.bias + hh.bias``):
``[ĩ pre-activation (D_m), f̃ pre-activation (D_m), o (D), ĉ (D), i (D), f (D)]``; the cell state is stored flat
``(B, D)`` and viewed as ``(B, D_m, C)`` inside the step. No forget-gate bias: neither the paper nor the authors' code
sets one (every weight keeps the uniform init).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.errors import ConfigError
from zoo.kernels import RecurrentMatmul, window_linear
from zoo.layers import CellLayer
from zoo.stack import RecurrentStack
from zoo.state import State


def cumax(z: Tensor, dim: int = -1) -> Tensor:
    """``cumsum(softmax(z))`` (eq. 6): the expectation of a binary gate ``(0, …, 0, 1, …, 1)`` whose split point
    has the distribution ``softmax(z)``; monotonically non-decreasing from ``softmax(z)_0`` to 1."""
    return torch.cumsum(F.softmax(z, dim=dim), dim=dim)


def default_chunk_size(hidden_size: int, preferred: int = 10) -> int:
    """The largest divisor of ``hidden_size`` up to ``preferred`` (the paper's C = 10) that leaves at least two chunks.

    One chunk would make the layer inert: ``f̃ = 1`` and ``ĩ = 0`` everywhere, so the cell state is never written.
    """
    candidates = [c for c in range(1, preferred + 1) if hidden_size % c == 0 and hidden_size // c >= 2]
    return max(candidates, default=1)


class ONLSTMLayer(CellLayer):
    """One ON-LSTM layer: every gate in one input projection (hoisted) and one recurrent matmul per step.

    Args:
        input_size: width of the input.
        hidden_size: ``D``, the number of neurons; must be divisible by ``chunk_size``.
        chunk_size: ``C``, the neurons per master-gate unit.

    Raises:
        ConfigError: ``hidden_size`` is not a multiple of ``chunk_size`` (the message lists the divisors).

    Attributes:
        last_split_points: ``(B, T)`` the expected split points ``d̂`` (eq. 15) of the last forward, detached.
    """

    state_size = 2  # (h, c)
    recurrent_weights = ("weight_hh",)

    def __init__(self, input_size: int, hidden_size: int, chunk_size: int = 10) -> None:
        super().__init__(input_size, hidden_size)
        if chunk_size < 1 or hidden_size % chunk_size:
            divisors = [c for c in range(1, min(hidden_size, 64) + 1) if hidden_size % c == 0]
            raise ConfigError(
                f"on_lstm: hidden_size {hidden_size} is not divisible by chunk_size {chunk_size}; set chunk_size to "
                f"a divisor of it (e.g. one of {', '.join(map(str, divisors))}) or change hidden_size"
            )
        self.chunk_size = chunk_size
        self.n_chunks = hidden_size // chunk_size
        gates = 2 * self.n_chunks + 4 * hidden_size
        self.weight_ih = nn.Parameter(torch.empty(gates, input_size))
        self.weight_hh = nn.Parameter(torch.empty(gates, hidden_size))
        self.bias = nn.Parameter(torch.empty(gates))
        # The authors' cells are two nn.Linear layers (input and recurrent): Uniform(±1/sqrt(fan_in)) each.
        nn.init.uniform_(self.weight_ih, -1 / math.sqrt(input_size), 1 / math.sqrt(input_size))
        for p in (self.weight_hh, self.bias):
            nn.init.uniform_(p, -1 / math.sqrt(hidden_size), 1 / math.sqrt(hidden_size))
        self.last_split_points: Tensor | None = None
        self._master_forget: list[Tensor] = []

    def hoist(self, x: Tensor) -> Tensor:
        self.window.hidden_matmul = RecurrentMatmul(self.weight_hh, x.size(0), x.size(1))
        return window_linear(x, self.weight_ih, self.bias)  # (B, T, 2 D_m + 4D)

    def master_gates(self, gates: Tensor) -> tuple[Tensor, Tensor]:
        """The master forget and input gates (eqs. 9-10) from a step's pre-activations.

        Args:
            gates: ``(B, 2 D_m + 4D)``, ``W x + U h + b`` in this layer's row layout.

        Returns:
            ``(f̃, ĩ)``, each ``(B, D_m)``: ``f̃`` rises from 0 to 1 along the chunks, ``ĩ`` falls from 1 to 0.
        """
        m = self.n_chunks
        # Both in one softmax and one cumsum over a (B, 2, D_m) view: row 0 is ĩ's, row 1 is f̃'s.
        master = cumax(gates[:, : 2 * m].unflatten(1, (2, m)))
        return master[:, 1], 1 - master[:, 0]

    def step(self, x_t: Tensor, state: State) -> State:
        h, c = state
        batch = h.size(0)
        gates = self.window.hidden_matmul(h, add=x_t)  # (B, 2 D_m + 4D)
        master_forget, master_in = self.master_gates(gates)  # (B, D_m) each
        self._master_forget.append(master_forget.detach())
        # (B, D_m, 1) against (B, D_m, C): the broadcast repeats each master unit over its chunk's C neurons.
        master_forget, master_in = master_forget.unsqueeze(2), master_in.unsqueeze(2)
        cell = gates[:, 2 * self.n_chunks :].view(batch, 4, self.n_chunks, self.chunk_size)  # o, ĉ, i, f
        sig = torch.sigmoid(cell)  # the ĉ block's sigmoid is wasted, but one call beats three
        o, i, f = sig[:, 0], sig[:, 2], sig[:, 3]
        g = torch.tanh(cell[:, 1])  # ĉ (B, D_m, C)
        # The factored right-hand forms of eqs. 12-13: fewer full-size ops than building ω.
        forget = master_forget * torch.addcmul(1 - master_in, f, master_in)  # f̂
        write = master_in * torch.addcmul(1 - master_forget, i, master_forget)  # î
        c = torch.addcmul(forget * c.view_as(g), write, g)  # eq. 14
        h = o * torch.tanh(c)  # eq. 5
        return h.view(batch, -1), c.view(batch, -1)

    def forward(
        self, x: Tensor, state: State, keep_at: dict[int, Tensor], state_mask: Tensor | None = None
    ) -> tuple[Tensor, State]:
        self._master_forget = []
        try:
            y, state = super().forward(x, state, keep_at, state_mask)
            # eq. 15 on the chunk-level gate: d̂ = D_m - Σ_k f̃_k.
            self.last_split_points = self.n_chunks - torch.stack(self._master_forget, 1).sum(-1)  # (B, T)
        finally:
            self._master_forget = []
        return y, state


class ONLSTM(RecurrentStack):
    """A stack of ON-LSTM layers (always the per-step loop: there is no fused kernel for it).

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    ``hidden_size`` is a multiple of ``chunk_size``; ``weight_drop`` covers the whole recurrent matrix, master-gate rows
    included, as the authors' ``LinearDropConnect`` does.

    Args:
        chunk_size: ``C``, neurons per master-gate unit. ``None``: the paper's 10 when it divides ``hidden_size``
            (and leaves at least two chunks), otherwise :func:`default_chunk_size`'s largest divisor below 10.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        chunk_size: int | None = None,
        **stack_options: Any,
    ) -> None:
        if chunk_size is None:
            chunk_size = default_chunk_size(hidden_size)
        super().__init__(
            partial(ONLSTMLayer, chunk_size=chunk_size), input_size, hidden_size, num_layers, **stack_options
        )
        self.chunk_size = chunk_size

    def split_points(self) -> Tensor:
        """The expected split points ``d̂`` (eq. 15) of the last forward, per layer and step.

        Returns:
            ``(L, B, T)``, detached, each value in ``[0, D_m]`` with ``D_m = hidden_size / chunk_size``.

        Raises:
            RuntimeError: no forward has run yet.
        """
        if any(layer.last_split_points is None for layer in self.layers):
            raise RuntimeError("split_points() needs a forward pass first")
        return torch.stack([layer.last_split_points for layer in self.layers])
