"""Skip RNN (Campos, Jou, Giró-i-Nieto, Torres & Chang, ICLR 2018; ``papers/003_…``, "Skip RNN") over the zoo LSTM.

A binary *state update gate* ``u_t`` decides, at every step, whether the LSTM updates its state or copies it::

    u_t       = round(ũ_t)                                  forward: round; backward: identity (straight-through)
    s_t       = u_t · LSTM(s_{t-1}, x_t) + (1 - u_t) · s_{t-1}
    Δũ_t      = σ(W_p s_t + b_p)
    ũ_{t+1}   = u_t · Δũ_t + (1 - u_t) · (ũ_t + min(Δũ_t, 1 - ũ_t))
    L_budget  = λ · Σ_t u_t

* ``s_t`` is the LSTM's ``(h_t, c_t)``; ``W_p`` reads the cell state ``c_t``, as the authors' ``SkipLSTMCell`` does
  (``state_update_prob`` is a linear layer on ``new_c``); their ``b_p`` starts at 1.0 (``update_bias``).
* ``ũ_1 = 1``: the first step always updates (the authors start from ``update_prob = 1, cum_update_prob = 0``, whose
  first ``ũ`` is ``0 + min(1, 1 - 0) = 1``).
* The authors' cell keeps ``Δũ`` in its state and computes it from the candidate ``c``, reusing the previous ``Δũ``
  when it skips; since a skipped step copies ``s``, that is the same forward value as the equation above, which is
  what this file computes (so the state needs ``ũ`` alone).
* Budget normalisation as the authors' ``compute_budget_loss``: sum over time, mean over the batch,
  ``λ · mean_b Σ_t u_{b,t}`` for the last window (:meth:`SkipLSTMLayer.regularization_loss`).
* A stack has one gate per layer. (The authors' ``MultiSkipLSTMCell`` shares one gate, computed from the top layer,
  across the whole stack; the zoo runs a stack layer by layer over the window, so each layer gets its own.)

State per layer: ``(h, c, v)`` with ``v = 1 - ũ`` ``(B, 1)``. Storing the complement makes the all-zero state (a fresh
stream, or a ``reset``) mean ``ũ = 1``, so a reset stream behaves exactly like a fresh start.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from zoo.errors import ConfigError
from zoo.layers import lerp
from zoo.lstm import LSTMLayer
from zoo.stack import RecurrentStack
from zoo.state import State


def round_straight_through(x: Tensor) -> Tensor:
    """``round(x)`` forward, identity backward (Bengio et al. 2013's straight-through estimator, as Campos et al.)."""
    return x + (torch.round(x) - x).detach()


class SkipLSTMLayer(LSTMLayer):
    """An LSTM layer (``zoo/lstm.py``'s parameters, always the per-step loop) with a binary state update gate.

    Args:
        input_size: width of the input.
        hidden_size: LSTM units.
        update_bias: initial ``b_p``.

    Attributes:
        update_gate: ``nn.Linear(hidden_size, 1)``, ``W_p`` and ``b_p``.
        budget_weight: ``λ`` of the budget loss (set by the stack).
        last_updates: ``(B, T)`` the gates ``u_t`` of the last forward (detached).
    """

    state_size = 3  # (h, c, 1 - ũ)

    def __init__(self, input_size: int, hidden_size: int, update_bias: float = 1.0) -> None:
        super().__init__(input_size, hidden_size, fused=False)
        self.update_gate = nn.Linear(hidden_size, 1)
        with torch.no_grad():
            self.update_gate.bias.fill_(update_bias)
        self.budget_weight = 0.0
        self.last_updates: Tensor | None = None
        self._updates: list[Tensor] = []
        self._budget: Tensor | None = None

    def initial_state(self, batch_size: int, like: Tensor) -> State:
        h = like.new_zeros(batch_size, self.hidden_size)
        return h, h.clone(), like.new_zeros(batch_size, 1)  # v = 0: ũ_1 = 1

    def step(self, x_t: Tensor, state: State) -> State:
        h, c, v = state
        u_prob = 1 - v  # ũ_t (B, 1)
        u = round_straight_through(u_prob)
        self._updates.append(u)
        h_new, c_new = super().step(x_t, (h, c))
        # lerp(a, b, w) is exactly b at w = 1 and a at w = 0, and its gradient reaches w (the straight-through path).
        h = lerp(h, h_new, u)
        c = lerp(c, c_new, u)
        delta = torch.sigmoid(torch.addmm(self.update_gate.bias, c, self.update_gate.weight.t()))  # Δũ_t (B, 1)
        accumulated = u_prob + torch.minimum(delta, v)  # ũ_t + min(Δũ_t, 1 - ũ_t)
        return h, c, 1 - lerp(accumulated, delta, u)  # store 1 - ũ_{t+1}

    def forward(
        self, x: Tensor, state: State, keep_at: dict[int, Tensor], state_mask: Tensor | None = None
    ) -> tuple[Tensor, State]:
        self._updates = []
        try:
            y, state = super().forward(x, state, keep_at, state_mask)
            updates = torch.cat(self._updates, 1)  # (B, T)
        finally:
            self._updates = []
        self.last_updates = updates.detach()
        self._budget = None
        if self.training and self.budget_weight > 0:
            # Sum over time, mean over the batch (the authors' compute_budget_loss).
            self._budget = self.budget_weight * updates.sum(1).mean()
        return y, state

    def regularization_loss(self) -> Tensor | None:
        """``λ · mean_b Σ_t u_{b,t}`` for the last window, in training with ``λ > 0``; otherwise ``None``.

        Reading it hands the term over: it is in the autograd graph (its gradient reaches ``W_p`` and ``b_p``
        through the straight-through ``round``), and no graph is kept on the module (``deepcopy`` needs that).
        """
        loss, self._budget = self._budget, None
        return loss

    def statistics(self) -> dict[str, Tensor]:
        """``update_fraction``: the mean of ``u_t`` over the last window's streams and steps."""
        if self.last_updates is None:
            return {}
        return {"update_fraction": self.last_updates.mean()}


class SkipLSTM(RecurrentStack):
    """A stack of Skip LSTM layers, each with its own update gate.

    The sizes and ``**stack_options`` are every stack's (:class:`~zoo.stack.RecurrentStack`).
    ``update_bias`` and ``forget_bias`` are applied after ``init_range``.

    Args:
        budget_weight: ``λ``, the weight of the budget loss ``λ · Σ_t u_t`` (per layer; 0 turns it off).
        update_bias: initial bias ``b_p`` of the update gate (the authors' default 1.0).
        forget_bias: effective initial forget-gate bias of the LSTM (as the zoo ``lstm``); ``None`` keeps the init.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        budget_weight: float = 0.0,
        update_bias: float = 1.0,
        forget_bias: float | None = 1.0,
        **stack_options: Any,
    ) -> None:
        if budget_weight < 0:
            raise ConfigError(f"skip_lstm: budget_weight must be >= 0, got {budget_weight}")
        super().__init__(
            partial(SkipLSTMLayer, update_bias=update_bias), input_size, hidden_size, num_layers, **stack_options
        )
        self.budget_weight = budget_weight
        for layer in self.layers:
            layer.budget_weight = budget_weight
            with torch.no_grad():
                layer.update_gate.bias.fill_(update_bias)
        self.set_forget_bias(forget_bias)
