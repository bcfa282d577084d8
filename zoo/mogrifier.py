"""Mogrifier LSTM (Melis, Kočiský & Blunsom, ICLR 2020, §2 eqs. 1-2; ablation §4.1).

Before the usual LSTM update, the input ``x`` and the previous output ``h_prev`` gate each other for ``r`` rounds::

    x^i = 2 sigm(Q^i h^{i-1}) * x^{i-2}      for odd i in [1..r]      (eq. 1)
    h^i = 2 sigm(R^i x^{i-1}) * h^{i-2}      for even i in [1..r]     (eq. 2)

with ``x^{-1} = x`` and ``h^0 = h_prev``; the LSTM then runs on the highest-indexed ``x^i`` and ``h^i``:
``Mogrify(x, c_prev, h_prev) = LSTM(x^↑, c_prev, h_prev^↑)``. So the *first* round gates the input (a trap: a 0-based
loop that tests ``round % 2 == 1`` for the input flips the order, peers.md §4). The factor 2 makes a gate with small
weights close to 1, so that a randomly initialised Mogrifier starts near the plain LSTM; ``r = 0`` *is* the LSTM.
The mogrified ``h`` only feeds the LSTM's gate matmuls: the state carried to the next step is the LSTM's new ``(h, c)``.

``Q^i`` is ``m x n`` (it maps the state to the input's width) and ``R^i`` is ``n x m``. With rank ``k > 0`` each is the
product of two thin matrices, ``Q^i = Q^i_left Q^i_right`` (``m x k`` times ``k x n``); ``k <= 0`` means full rank
(Appendix A). The paper's equations have no bias inside the sigmoids; the reference code (``lamb/tiled_lstm.py``) adds
one per round, which ``round_bias=True`` reproduces.

No-zigzag ablation (§4.1, Fig. 2): every gate is computed from the *original* inputs,
``x^i = 2 sigm(Q^i h_prev) * x^{i-2}`` and ``h^i = 2 sigm(R^i x) * h_prev^{i-2}``. Round 1 coincides (``h^0 = h_prev``);
from round 2 on the two differ (zigzag uses ``x^1``, no-zigzag ``x``). Without the zigzag the state gates depend on
the input alone, so they are computed for the whole window at once, and the input gates share one matmul on
``h_prev``.

Speed. The input is mogrified per step, so ``W_x x`` cannot be hoisted out of the loop, and round i needs round i-1,
so the rounds cannot be batched: a step streams both LSTM matrices (the LSTM streams only ``W_h``), which bounds the
Mogrifier near half the per-step LSTM's throughput. What is shared: the last round reads the same vector as one half
of the LSTM matmul (for odd r, ``Q^r`` and ``W_h`` both read ``h^{r-1}``; for even r, ``R^r`` and ``W_x`` both read
``x^{r-1}``), so those two matrices are concatenated once per window and applied in one ``addmm``; a step costs
``r + 1`` matmuls (``2r + 1`` at low rank). Measured against the alternatives (rounds, then one matmul over the
concatenation ``[x^↑, h^↑]``; or ``W_x x^↑`` and ``W_h h^↑`` as two ``addmm`` into one buffer), it was as fast or
slightly faster (CPU, hidden 650, batch 20, BPTT 35). Every matrix goes through :class:`~zoo.kernels.RecurrentMatmul`
(one weight-gradient GEMM per window instead of one per step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zoo.base import RecurrentStack, State
from zoo.kernels import RecurrentMatmul, gated_product, window_linear
from zoo.lstm import LSTMLayer


def lstm_update(gates: Tensor, c: Tensor) -> State:
    """The LSTM's state update from its summed gate pre-activations (PyTorch gate order i, f, g, o).

    Args:
        gates: ``(B, 4H)`` ``W_x x + W_h h + b``.
        c: ``(B, H)`` the previous cell.

    Returns:
        ``(h, c)`` after the step.
    """
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


class MogrifierLayer(LSTMLayer):
    """One Mogrifier LSTM layer: the rounds' matrices beside an ``nn.LSTM``'s parameters (the LSTM's layout).

    Round i's parameters are named after the paper: ``Q1``, ``R2``, ``Q3``, ... at full rank, ``Q1_left`` and
    ``Q1_right`` (``Q1 = Q1_left @ Q1_right``) at low rank, and ``Q1_bias`` with ``round_bias``. Weights follow
    ``nn.Linear``'s convention ``(out, in)``, which for ``Q^i`` (``m x n``) is the paper's own shape.

    Args:
        input_size: ``m``.
        hidden_size: ``n``.
        rounds: ``r``; 0 is the LSTM (and then the fused kernel runs when ``fused``).
        rank: ``k``; ``k <= 0`` means full-rank ``Q^i``, ``R^i``.
        zigzag: ``False`` is the §4.1 ablation (gates from the original ``x`` and ``h_prev``).
        round_bias: add a bias inside each round's sigmoid (the reference code; not in the paper's equations).
        fused: with ``rounds == 0``, use ``nn.LSTM``'s kernel when it computes the same function.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        rounds: int = 5,
        rank: int = 40,
        zigzag: bool = True,
        round_bias: bool = False,
        fused: bool = True,
    ) -> None:
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        super().__init__(input_size, hidden_size, fused and rounds == 0)  # no fused kernel with rounds
        self.rounds = rounds
        self.rank = rank
        # With one round the two schemes are the same function (h^0 = h_prev); the zigzag path is the faster one.
        self.zigzag = zigzag or rounds <= 1
        self.round_bias = round_bias
        self.mog = nn.ParameterDict()
        for i in range(1, rounds + 1):
            name = self.round_name(i)
            # Odd rounds gate x with Q^i h (m x n); even rounds gate h with R^i x (n x m).
            out, inp = (input_size, hidden_size) if i % 2 else (hidden_size, input_size)
            if rank > 0:
                self.mog[f"{name}_left"] = _uniform(out, rank)
                self.mog[f"{name}_right"] = _uniform(rank, inp)
            else:
                self.mog[name] = _uniform(out, inp)
            if round_bias:
                self.mog[f"{name}_bias"] = nn.Parameter(torch.zeros(out))

    @staticmethod
    def round_name(i: int) -> str:
        """``Q1``, ``R2``, ``Q3``, ...: round i (1-based, as in the paper) gates x when i is odd."""
        return f"Q{i}" if i % 2 else f"R{i}"

    # ------------------------------------------------------------------------------------------ round helpers
    def round_matrix(self, i: int) -> Tensor:
        """Round i's full matrix (``Q^i_left @ Q^i_right`` at low rank), for tests and inspection."""
        name = self.round_name(i)
        if self.rank > 0:
            return self.mog[f"{name}_left"] @ self.mog[f"{name}_right"]
        return self.mog[name]

    def _first(self, i: int) -> Tensor:
        """The matrix that reads round i's input: the full matrix, or the right factor at low rank."""
        name = self.round_name(i)
        return self.mog[f"{name}_right"] if self.rank > 0 else self.mog[name]

    def _bias(self, i: int) -> Tensor | None:
        return self.mog[f"{self.round_name(i)}_bias"] if self.round_bias else None

    def _round(self, i: int, v: Tensor, gated: Tensor, first: RecurrentMatmul | None = None) -> Tensor:
        """Round i at one step, ``2 sigm(Q^i v) * gated`` (eqs. 1-2), as one autograd node.

        ``first`` applies the first matrix (the full one, or the right factor) to ``v``; without it, ``v`` is that
        product already. The left factor and the bias follow inside.
        """
        left = self.window.left[i] if self.rank > 0 else None
        return gated_product(v, gated, first, left, self._bias(i))

    def _window_gate(self, i: int, v: Tensor) -> Tensor:
        """``2 sigm(Q^i v)`` (or ``R^i``) for a whole window ``v: (B, T, in)`` at once."""
        pre = window_linear(v, self._first(i))
        if self.rank > 0:
            pre = window_linear(pre, self.mog[f"{self.round_name(i)}_left"], self._bias(i))
        elif self.round_bias:
            pre = pre + self._bias(i)
        return 2 * torch.sigmoid(pre)

    # ------------------------------------------------------------------------------------------------ the loop
    def hoist(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if self.rounds == 0:
            return super().hoist(x)  # (B, T, 4n): W_x x + b, the LSTM's own hoist
        # Every matrix is applied once per step through a RecurrentMatmul: one weight-gradient GEMM per window. They
        # are built here, per window, from the parameters in use, so weight drop (functional_call) reaches them.
        rnn, r, w = self.rnn, self.rounds, self.window
        batch, steps = x.shape[:2]
        bias = rnn.bias_ih_l0 + rnn.bias_hh_l0  # (4n,)
        if self.rank > 0:
            w.left = {i: RecurrentMatmul(self.mog[f"{self.round_name(i)}_left"], batch, steps) for i in range(1, r + 1)}
        if not self.zigzag:
            odd = range(1, r + 1, 2)
            w.odd_widths = [self._first(i).size(0) for i in odd]
            # Every odd round reads h_prev: their first matrices stacked, one matmul per step.
            w.odd = RecurrentMatmul(torch.cat([self._first(i) for i in odd]), batch, steps)
            w.lstm = RecurrentMatmul(torch.cat([rnn.weight_ih_l0, rnn.weight_hh_l0], 1), batch, steps)  # [x~, h~]
            w.bias = bias
            if self.rank > 0:
                for i in range(2, r + 1, 2):
                    del w.left[i]  # the even rounds run here, over the window
            # h~ = h_prev * prod_{even i} 2 sigm(R^i x) depends on x alone: computed for the whole window at once.
            state_gate = self._window_gate(2, x)  # (B, T, n)
            for i in range(4, r + 1, 2):
                state_gate = state_gate * self._window_gate(i, x)
            return x, state_gate
        w.first = {i: RecurrentMatmul(self._first(i), batch, steps) for i in range(1, r)}
        # The last round and one half of the LSTM read the same vector: one matrix for both, one for the other half.
        shared, other = (rnn.weight_hh_l0, rnn.weight_ih_l0) if r % 2 else (rnn.weight_ih_l0, rnn.weight_hh_l0)
        last = self._first(r)
        w.shared = RecurrentMatmul(torch.cat([shared, last]), batch, steps)  # (4n + width, in)
        w.shared_bias = torch.cat([bias, bias.new_zeros(last.size(0))])
        w.shared_width = last.size(0)
        w.other = RecurrentMatmul(other, batch, steps)
        return x  # every round depends on h: nothing else to precompute

    def step(self, x_t: Any, state: State) -> State:
        if self.rounds == 0:
            return super().step(x_t, state)
        h, c = state
        w, r, n4 = self.window, self.rounds, 4 * self.hidden_size
        if not self.zigzag:
            x, state_gate = x_t  # (B, m), (B, n)
            for i, pre in zip(range(1, r + 1, 2), w.odd(h).split(w.odd_widths, dim=1)):
                x = self._round(i, pre, x)  # x^i = 2 sigm(Q^i h_prev) * x^{i-2}
            return lstm_update(w.lstm(torch.cat([x, h * state_gate], 1), add=w.bias), c)  # gates (B, 4n)
        x = x_t
        for i in range(1, r):  # every round but the last: x^i reads h^{i-1}, h^i reads x^{i-1}
            if i % 2:
                x = self._round(i, h, x, w.first[i])  # (B, m)
            else:
                h = self._round(i, x, h, w.first[i])  # (B, n)
        # Round r shares its input with one half of the LSTM matmul.
        if r % 2:  # round r gates x from h^{r-1} = h^↑, which W_h also reads
            gates, pre = w.shared(h, add=w.shared_bias).split([n4, w.shared_width], dim=1)  # (B, 4n), (B, width)
            x = self._round(r, pre, x)  # x^↑ (B, m)
            gates = w.other(x, add=gates)
        else:  # round r gates h from x^{r-1} = x^↑, which W_x also reads
            gates, pre = w.shared(x, add=w.shared_bias).split([n4, w.shared_width], dim=1)
            h = self._round(r, pre, h)  # h^↑ (B, n)
            gates = w.other(h, add=gates)
        return lstm_update(gates, c)


def _uniform(rows: int, cols: int) -> nn.Parameter:
    """A ``(rows, cols)`` weight with ``nn.Linear``'s default range, ``U(-1/sqrt(cols), 1/sqrt(cols))``."""
    bound = cols**-0.5
    return nn.Parameter(torch.empty(rows, cols).uniform_(-bound, bound))


class Mogrifier(RecurrentStack):
    """A stack of Mogrifier LSTM layers (Melis et al. 2020).

    Args:
        input_size: size of each input vector.
        hidden_size: units per layer.
        num_layers: stacked layers.
        rounds: mogrifier rounds ``r`` (the paper tunes 0..6 and finds 5 or 6 best); 0 is the plain LSTM.
        rank: rank ``k`` of ``Q^i``, ``R^i`` (best 40..90 in the paper); ``k <= 0`` means full rank.
        zigzag: ``False`` for the §4.1 no-zigzag ablation.
        round_bias: a bias inside each round's sigmoid, as the reference code (not in eqs. 1-2).
        forget_bias: effective initial forget-gate bias (counted once, see :mod:`zoo.lstm`); ``None`` keeps the init.
        fused: with ``rounds == 0``, use ``nn.LSTM``'s kernel when it computes the same function.
        **stack_options: dropout, locked_dropout, state_dropout, weight_drop, init_range
            (:class:`~zoo.base.RecurrentStack`). Weight drop acts on the LSTM's ``W_h``.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        rounds: int = 5,
        rank: int = 40,
        zigzag: bool = True,
        round_bias: bool = False,
        forget_bias: float | None = 1.0,
        fused: bool = True,
        **stack_options: Any,
    ) -> None:
        layers = [
            MogrifierLayer(input_size if i == 0 else hidden_size, hidden_size, rounds, rank, zigzag, round_bias, fused)
            for i in range(num_layers)
        ]
        super().__init__(layers, **stack_options)
        self.set_forget_bias(forget_bias)  # after init_range, which the base applied
