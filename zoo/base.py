"""What every recurrent stack in the zoo shares: the state format, reset masking, and the fused/per-step dispatch.

The zoo contract (``../shared/DESIGN.md``): ``forward(x: (B, T, I), state=None, reset=None) -> (y: (B, T, H), state)``.

* A *state* is a tuple of tensors, each shaped ``(num_layers, B, ...)`` (for the LSTM: ``(h, c)``, the layout of
  ``nn.LSTM``'s ``hx``). ``None`` means zeros. Callers treat it as opaque apart from :func:`detach_state`.
* ``reset[b, t] = True`` zeroes stream b's state *before* step t. A reset at ``t = 0`` is applied to the incoming state;
  a reset later in the window forces the per-step path, since cuDNN cannot zero a state mid-sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

State = tuple[Tensor, ...]


def detach_state(state: State | None) -> State | None:
    """Cut the autograd graph at a window boundary (truncated BPTT) while keeping the values."""
    if state is None:
        return None
    return tuple(s.detach() for s in state)


def mask_state(state: State, keep: Tensor) -> State:
    """Zero the streams where ``keep`` is 0.

    Args:
        state: tensors shaped ``(L, B, ...)``.
        keep: ``(B,)`` float mask, 1 to keep a stream's state, 0 to reset it.
    """
    return tuple(s * keep.view(1, -1, *([1] * (s.dim() - 2))) for s in state)


class FusedRecurrentStack(nn.Module):
    """A stack of ``nn.RNNBase`` layers with a second, per-step implementation over the same parameters.

    The parameters live in ``self.rnn`` (an ``nn.LSTM``/``nn.GRU``/``nn.RNN``, batch-first), so the fused kernel (cuDNN
    on GPU, MKL-DNN/ATen on CPU) is used whenever no reset falls inside the window, and :meth:`_cell_loop` computes the
    same function one step at a time when one does. Subclasses write out their cell's equations in ``_cell_loop``.
    """

    rnn: nn.RNNBase
    #: number of tensors in this architecture's state (LSTM: h and c)
    state_size: int = 1

    def __init__(self, rnn: nn.RNNBase, init_range: float | None = None, fused: bool = True) -> None:
        super().__init__()
        if not rnn.batch_first:
            raise ValueError("the zoo is batch-first: build the nn.RNNBase with batch_first=True")
        self.rnn = rnn
        self.fused = fused
        if init_range is not None:  # Uniform(-r, r) on every weight and bias (Zaremba et al. 2014)
            for p in self.rnn.parameters():
                nn.init.uniform_(p, -init_range, init_range)

    @property
    def num_layers(self) -> int:
        return self.rnn.num_layers

    @property
    def hidden_size(self) -> int:
        return self.rnn.hidden_size

    def initial_state(self, batch_size: int, like: Tensor) -> State:
        """All-zero state for ``batch_size`` streams, on ``like``'s device and dtype."""
        zeros = like.new_zeros(self.num_layers, batch_size, self.hidden_size)
        return tuple(zeros.clone() for _ in range(self.state_size))

    def forward(self, x: Tensor, state: State | None = None, reset: Tensor | None = None) -> tuple[Tensor, State]:
        """Run the stack over a window.

        Args:
            x: ``(B, T, I)`` inputs.
            state: the state after the previous window, or ``None`` for zeros.
            reset: ``(B, T)`` bool; ``True`` zeroes that stream's state before that step.

        Returns:
            ``(y, state)`` with ``y`` the last layer's outputs ``(B, T, H)``.
        """
        if state is None:
            state = self.initial_state(x.size(0), x)
        reset_steps: list[int] = []
        if reset is not None:
            keep = (~reset).to(x.dtype)  # (B, T)
            state = mask_state(state, keep[:, 0])
            # One host sync per window to learn where (if anywhere) a mid-window reset falls.
            reset_steps = (reset[:, 1:].any(0).nonzero().flatten() + 1).tolist()
        if self.fused and not reset_steps:
            y, hx = self.rnn(x, state if self.state_size > 1 else state[0])
            return y, (hx if isinstance(hx, tuple) else (hx,))
        keep_at = {t: keep[:, t] for t in reset_steps}
        return self._loop_layers(x, state, keep_at)

    def _layer_weights(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        rnn = self.rnn
        w_ih = getattr(rnn, f"weight_ih_l{layer}")
        w_hh = getattr(rnn, f"weight_hh_l{layer}")
        b_ih = getattr(rnn, f"bias_ih_l{layer}", None)
        b_hh = getattr(rnn, f"bias_hh_l{layer}", None)
        return w_ih, w_hh, b_ih, b_hh

    def _loop_layers(self, x: Tensor, state: State, keep_at: dict[int, Tensor]) -> tuple[Tensor, State]:
        """Per-step path: layer by layer, so that each layer's input projection is one matmul over the window."""
        layer_input = x
        new_state: list[tuple[Tensor, ...]] = []
        for layer in range(self.num_layers):
            layer_state = tuple(s[layer] for s in state)  # each (B, H)
            layer_input, layer_state = self._cell_loop(layer, layer_input, layer_state, keep_at)
            new_state.append(layer_state)
            # nn.RNNBase applies its dropout to every layer's output but the last; so do we.
            if layer < self.num_layers - 1 and self.rnn.dropout > 0:
                layer_input = F.dropout(layer_input, self.rnn.dropout, self.training)
        return layer_input, tuple(torch.stack(parts) for parts in zip(*new_state))

    def _cell_loop(
        self, layer: int, x: Tensor, state: tuple[Tensor, ...], keep_at: dict[int, Tensor]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Run one layer over the window one step at a time.

        Args:
            layer: layer index (selects the weights).
            x: ``(B, T, I)`` the layer's input.
            state: this layer's state tensors, each ``(B, H)``.
            keep_at: step -> ``(B,)`` keep-mask, for the steps where some stream resets.

        Returns:
            ``(y, state)``: outputs ``(B, T, H)`` and the layer's final state.
        """
        raise NotImplementedError
