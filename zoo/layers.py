"""The layers of a recurrent stack: one layer runs a whole window from its own state.

* :class:`RecurrentLayer`: the layer contract; :class:`CellLayer`: a layer defined by its cell, input-only work
  hoisted out of the loop (:meth:`~CellLayer.hoist`, one matmul over the whole window) and the recurrence in
  :meth:`~CellLayer.step`; :class:`FusedLayer`: a layer whose parameters live in a one-layer ``nn.LSTM``/``nn.GRU``/
  ``nn.RNN``, whose fused kernel runs where it computes the same function.
* Adding a cell: subclass :class:`CellLayer`, then build its stack with :class:`zoo.stack.RecurrentStack` (its
  docstring shows how).

Mixed precision (``torch.autocast``, Lightning's ``bf16-mixed`` / ``16-mixed``): the recurrent state is kept in the
parameters' dtype (float32 when the weights are), between steps and between windows, whatever the autocast dtype:
a recurrence accumulates its rounding errors over hundreds of steps. The products of a step run in the autocast dtype
where autograd runs them (the per-step loops' products and pointwise ops). The fused ``nn.LSTM``/``nn.GRU``/``nn.RNN``
layers run in the autocast dtype too, but not through autocast: they are called with autocast off and their input,
state and weights cast to its dtype (:meth:`FusedLayer._fused`), because autocast's own rule for them differs by device
and never says so. On CUDA, its wrapper for cuDNN RNNs (``aten/src/ATen/cudnn/AutocastRNN.cpp``,
``_cudnn_rnn_cast_reflatten``) casts to float16 whatever the autocast dtype, so under ``bf16-mixed``, where Lightning
uses no gradient scaler, per-token-mean gradients of size ~1/(B T) would fall into float16's subnormal range; on CPU,
autocast runs ``nn.LSTM`` in bfloat16 but leaves ``nn.GRU`` in float32. The hand-written kernels (``zoo/kernels.py``,
the Mogrifier window) compute in the weights' dtype, as ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` would, so
that their backward, which autocast does not cover, sees the same dtypes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from zoo import paths
from zoo.errors import ConfigError
from zoo.state import KeepAt, Segments, State


def lerp(start: Tensor, end: Tensor, weight: Tensor) -> Tensor:
    """``start + weight * (end - start)`` (``torch.lerp``) in the widest of the three dtypes: under autocast a gate and
    a candidate come out in bf16/fp16 while the carried state stays float32, and ``torch.lerp`` takes one dtype."""
    dtype = torch.promote_types(torch.promote_types(start.dtype, end.dtype), weight.dtype)
    return torch.lerp(start.to(dtype), end.to(dtype), weight.to(dtype))


def _mask_layer_state(state: State, keep: Tensor) -> State:
    """:func:`mask_state` for one layer's state, whose tensors are ``(B, ...)``."""
    return tuple(s * keep.view(-1, *([1] * (s.dim() - 1))) for s in state)


def sequence_dropout_mask(like: Tensor, p: float) -> Tensor:
    """An inverted-dropout mask shaped like ``like`` (``(B, H)``), to be reused at every step of a window."""
    return torch.bernoulli(torch.full_like(like, 1 - p)) / (1 - p)


class RecurrentLayer(nn.Module):
    """One layer of a stack: runs a whole window from its own state.

    Attributes:
        input_size: width of the layer's input.
        hidden_size: width of its output ``h``.
        state_size: number of tensors in its state; ``state[0]`` is always the output ``h``.
        recurrent_weights: names of the hidden-to-hidden matrices, the targets of ``weight_drop``.
    """

    state_size: int = 1
    recurrent_weights: tuple[str, ...] = ()

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        # Per-window helpers that hoist() creates for step() (e.g. zoo.kernels.RecurrentMatmul). Emptied after each
        # window so that no autograd graph outlives it on the module (deepcopy, e.g. for weight averaging, needs that).
        self.window = SimpleNamespace()

    def initial_state(self, batch_size: int, like: Tensor) -> State:
        """All-zero state for ``batch_size`` streams, on ``like``'s device and dtype; each tensor ``(B, ...)``."""
        return tuple(like.new_zeros(batch_size, self.hidden_size) for _ in range(self.state_size))

    def forward(
        self, x: Tensor, state: State, keep_at: dict[int, Tensor], state_mask: Tensor | None = None
    ) -> tuple[Tensor, State]:
        """Run the layer over a window.

        Args:
            x: ``(B, T, I)`` the layer's input.
            state: this layer's state tensors, each ``(B, ...)``.
            keep_at: step -> ``(B,)`` keep-mask, for the steps ``t > 0`` where some stream resets.
            state_mask: ``(B, H)`` dropout mask for ``h_{t-1}`` where it enters the recurrence, or ``None``.

        Returns:
            ``(y, state)``: outputs ``(B, T, H)`` and the layer's final state.
        """
        raise NotImplementedError

    def regularization_loss(self) -> Tensor | None:
        """A term this layer adds to the training loss for the last window (e.g. Skip RNN's budget), or ``None``."""
        return None

    def statistics(self) -> dict[str, Tensor]:
        """Scalars worth logging about the last window (e.g. Skip RNN's fraction of updated steps)."""
        return {}


class CellLayer(RecurrentLayer):
    """A layer defined by its cell: input-only work hoisted out of the loop, then one :meth:`step` per time step."""

    def hoist(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        """Everything that depends on the input alone, for the whole window at once (e.g. ``W_x x + b``).

        Per-window helpers for :meth:`step` (e.g. a :class:`zoo.kernels.RecurrentMatmul` per recurrent matrix) go
        in ``self.window``, which is emptied after the window.

        Args:
            x: ``(B, T, I)``.

        Returns:
            A tensor ``(B, T, ...)`` or a tuple of them; :meth:`step` receives their slices at step t.
        """
        return x

    def step(self, x_t: Any, state: State) -> State:
        """One time step.

        Args:
            x_t: the step-t slice of :meth:`hoist`'s result (a tensor ``(B, ...)`` or a tuple of them).
            state: the layer's state before the step; ``state[0]`` is ``h_{t-1}`` (already state-dropped).

        Returns:
            The state after the step; its first tensor is the output ``h_t``.
        """
        raise NotImplementedError

    def forward(
        self, x: Tensor, state: State, keep_at: dict[int, Tensor], state_mask: Tensor | None = None
    ) -> tuple[Tensor, State]:
        try:
            hoisted = self.hoist(x)
            # unbind once (not x[:, t] per step): its backward stacks the step gradients in one copy instead of T,
            # time-major, the layout of zoo.kernels.window_linear's output (its backward then reads them as they are).
            steps: Iterator[Any] = (
                iter(hoisted.transpose(0, 1).unbind(0))
                if isinstance(hoisted, Tensor)
                else zip(*(h.transpose(0, 1).unbind(0) for h in hoisted))
            )
            outputs = []
            # Under autocast a step can come out in bf16/fp16 (a cell whose state is one product away from its
            # output); the state stays in the dtype it came in, the weights' (module doc).
            state_dtype = state[0].dtype if torch.is_autocast_enabled(x.device.type) else None
            for t, x_t in enumerate(steps):
                if t in keep_at:
                    state = _mask_layer_state(state, keep_at[t])
                if state_mask is not None:
                    state = (state[0] * state_mask, *state[1:])
                state = self.step(x_t, state)
                if state_dtype is not None:
                    state = tuple(s.to(state_dtype) for s in state)
                outputs.append(state[0])
        finally:
            self.window = SimpleNamespace()
        return torch.stack(outputs, dim=1), state  # (B, T, H)


#: The kernel each ``nn.RNNBase`` mode's forward calls.
_RNN_KERNELS = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}
#: What cuDNN says when it is handed weights outside one buffer: it compacts them into one for the call.
_COMPACTED = "RNN module weights are not part of single contiguous chunk of memory"


def rnn_kernel(
    rnn: nn.RNNBase, x: Tensor | nn.utils.rnn.PackedSequence, hx: State, weights: list[Tensor]
) -> tuple[Any, Tensor | State]:
    """``rnn``'s kernel over ``x`` from ``hx`` (each ``(layers, N, H)``) with ``weights`` in the order of its
    ``_flat_weights_names``: what its forward computes with those weights, returned as its forward returns it.

    Why not ``rnn(x, hx)`` with the weights swapped in (``functional_call``): ``nn.RNNBase.forward`` flattens weights
    it has not seen into one cuDNN buffer (``flatten_parameters``), and ``torch._cudnn_rnn_flatten_weight`` moves every
    tensor it is given into that buffer, the module's own parameters with the swapped ones. Under weight drop the
    layer's parameters then left their storage at every window, and a captured training step, which is bound to that
    storage, was captured anew at every step until it held its limit (an H200 run at 522b546 held 16:
    ``benchmarks/results/gpu-h200/522b546/ptb_word_fit.txt``; the CPU's flattening is a no-op,
    ``tests/test_training_step.py`` does it as a GPU does). Handed to the kernel, weights outside one buffer are
    compacted into a temporary one for the call, and the parameters stay where they are. The module's own weights are
    flattened as its forward would, where they were replaced since the last call (``load_state_dict(assign=True)``):
    once, so that cuDNN does not compact them at every call.

    Args:
        rnn: a one-direction ``nn.LSTM``/``nn.GRU``/``nn.RNN``, batch-first unless ``x`` is packed.
        x: ``(N, T, I)``, or a ``PackedSequence`` without a sort order (as :meth:`FusedLayer._segments` builds it).
        hx: the state, ``(h, c)`` for an LSTM, ``(h,)`` otherwise.
        weights: the weights in use.
    """
    kernel = _RNN_KERNELS[rnn.mode]
    state: Any = list(hx) if rnn.mode == "LSTM" else hx[0]
    settings = (rnn.bias, rnn.num_layers, float(rnn.dropout), rnn.training, rnn.bidirectional)
    swapped = not all(isinstance(w, nn.Parameter) for w in weights)  # weight drop's matrix, autocast's copies
    if not swapped:
        rnn._update_flat_weights()  # a no-op on the CPU, and once they are flat
    with warnings.catch_warnings() if swapped else contextlib.nullcontext():
        if swapped:  # outside the parameters' buffer, they are compacted for the call: as meant
            warnings.filterwarnings("ignore", message=_COMPACTED)
        if isinstance(x, nn.utils.rnn.PackedSequence):
            if x.sorted_indices is not None:
                raise ValueError("rnn_kernel takes a PackedSequence without a sort order")
            out = kernel(x.data, x.batch_sizes, state, weights, *settings)
            y: Any = nn.utils.rnn.PackedSequence(out[0], x.batch_sizes)
        else:
            out = kernel(x, state, weights, *settings, rnn.batch_first)
            y = out[0]
    return y, (tuple(out[1:]) if rnn.mode == "LSTM" else out[1])


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast lowers products to on ``device_type``, or ``None`` where autocast is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


_FUSED_IN: dict[tuple[type, torch.dtype], bool] = {}


def _fused_runs_in(rnn: nn.RNNBase, dtype: torch.dtype) -> bool:
    """Whether ``rnn``'s fused CPU kernel runs in ``dtype`` on this machine.

    Tried once per class and dtype on a 2-unit copy. Called the way :meth:`FusedLayer._fused` calls it (autocast off,
    tensors cast), ``nn.LSTM`` takes oneDNN's bfloat16 primitive on CPUs that have one and ATen's own loop elsewhere,
    so this holds on every CPU seen so far; where it fails, the layer takes its per-step loop, which autocast covers
    like any other ops.
    """
    key = (type(rnn), dtype)
    if key not in _FUSED_IN:
        with torch.random.fork_rng(devices=[]):  # the probe's initial weights must not move the run's dropout masks
            probe = type(rnn)(2, 2, batch_first=True).to(dtype)
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                probe(torch.zeros(1, 2, 2, dtype=dtype))
            _FUSED_IN[key] = True
        except RuntimeError:
            _FUSED_IN[key] = False
    return _FUSED_IN[key]


class FusedLayer(CellLayer):
    """A layer whose parameters live in a one-layer ``nn.LSTM``/``nn.GRU``/``nn.RNN``.

    The fused kernel (cuDNN on GPU, oneDNN on CPU) runs whenever it computes the same function: no reset inside the
    window and no state dropout. Otherwise the subclass's :meth:`step` runs over the same parameters.
    :func:`zoo.paths.layer_path` decides which.
    """

    recurrent_weights = ("rnn.weight_hh_l0",)
    #: Windows with resets inside (GBW's multi-sequence batches: a sentence ends somewhere in nearly every window)
    #: run the fused kernel on their sentence segments, packed (:meth:`_segments`): ``None`` on CUDA only, where
    #: cuDNN's packed kernel beats the per-step loop; ``True``/``False`` everywhere/nowhere.
    packed_segments: bool | None = None
    #: Set by :func:`zoo.quantization.quantize_int8`, which makes ``rnn`` an int8 module with no float weights for a
    #: per-step loop: every window then runs the fused kernel, a window with resets as packed segments.
    int8: bool = False

    def __init__(self, rnn: nn.RNNBase, fused: bool = True) -> None:
        if not rnn.batch_first or rnn.num_layers != 1 or rnn.bidirectional:
            raise ValueError("a FusedLayer wraps a batch-first, one-layer, one-direction nn.RNNBase")
        super().__init__(rnn.input_size, rnn.hidden_size)
        self.rnn = rnn
        self.fused = fused

    def forward(
        self, x: Tensor, state: State, keep_at: dict[int, Tensor], state_mask: Tensor | None = None
    ) -> tuple[Tensor, State]:
        if self.int8 and state_mask is not None:
            raise ConfigError("an int8 layer is for inference: state dropout needs the float model")
        path = paths.layer_path(self, x, resets=bool(keep_at), state_dropout=state_mask is not None)
        if path == "fused":
            return self._fused(x, state)
        if path == "packed":
            return self._segments(x, state, keep_at)
        return super().forward(x, state, keep_at, state_mask)

    def fused_kernel_runs(self, x: Tensor) -> bool:
        """Whether the fused kernel runs in the autocast dtype in force (always on GPU, or without autocast)."""
        dtype = autocast_dtype(x.device.type)
        return dtype is None or x.device.type != "cpu" or _fused_runs_in(self.rnn, dtype)

    def _fused(self, x: Tensor | nn.utils.rnn.PackedSequence, state: State) -> tuple[Any, State]:
        """The fused kernel over ``x`` from ``state`` (each ``(N, H)``); the final state in the weights' dtype."""
        hx = tuple(s.unsqueeze(0) for s in state)  # (1, N, H): nn.RNNBase's (layers, N, H)
        device = (x.data if isinstance(x, nn.utils.rnn.PackedSequence) else x).device.type
        if self.int8:  # a quantized module, with no float weights to hand its kernel: its own forward
            y, hx = self.rnn(x, hx if self.state_size > 1 else hx[0])
        else:
            # The weights in use: the parameters, or the weight-dropped matrix functional_call put in their place.
            weights = [getattr(self.rnn, name) for name in self.rnn._flat_weights_names]
            compute = autocast_dtype(device)
            if compute is None:
                y, hx = rnn_kernel(self.rnn, x, hx, weights)
            else:
                # Autocast's dtype, cast here rather than by autocast, whose RNN rule is float16 on CUDA whatever the
                # autocast dtype (module doc).
                with torch.autocast(device, enabled=False):
                    cast = [w.to(compute) for w in weights]
                    y, hx = rnn_kernel(self.rnn, x.to(compute), tuple(h.to(compute) for h in hx), cast)
        dtype = state[0].dtype  # the state stays in the dtype it came in (the weights')
        return y, tuple(s.squeeze(0).to(dtype) for s in (hx if isinstance(hx, tuple) else (hx,)))

    def _segments(self, x: Tensor, state: State, keep_at: dict[int, Tensor]) -> tuple[Tensor, State]:
        """A window with resets inside, as one fused call over its sentence segments.

        Each stream's window is cut where it resets; every piece is a sequence of its own, the first starting from
        the stream's carried state and the others from zeros (what the reset does), and all of them go through the
        kernel at once as a ``PackedSequence`` (cuDNN's variable-length RNN). The outputs go back to their steps and
        each stream's state is that at the end of its last piece: what the per-step loop computes.

        The layout (:class:`Segments`) comes with ``keep_at`` from the stack, worked out on the host before the batch
        moved (:class:`Resets`), so the window runs with gathers alone: no host synchronisation. A plain ``keep_at``
        dict (a caller of the layer's own) is copied to the host once to work it out.
        """
        batch, steps, _ = x.shape
        segments = keep_at.segments if isinstance(keep_at, KeepAt) else None
        if segments is None:
            reset = torch.zeros(batch, steps, dtype=torch.bool)
            if keep_at:
                times = sorted(keep_at)
                reset[:, times] = torch.stack([keep_at[t] == 0 for t in times], 1).cpu()  # (B, R), one host copy
            segments = Segments.from_reset(reset).to(x.device)
        flat = x.reshape(batch * steps, -1)  # (B*T, I)
        # Built directly rather than by pack_padded_sequence, which copies its sort order to the device and (unpacked
        # by pad_packed_sequence) back: the pieces are already longest first, the batch sizes host ints.
        packed = nn.utils.rnn.PackedSequence(
            flat.index_select(0, segments.step_of_row), torch.tensor(segments.batch_sizes)
        )
        first = segments.first.unsqueeze(1)  # (P, 1)
        piece_state = tuple(torch.where(first, s.index_select(0, segments.owner), s.new_zeros(())) for s in state)
        y_packed, final = self._fused(packed, piece_state)
        y = y_packed.data.index_select(0, segments.row_of_step)  # (B*T, H), every step from its piece
        return y.view(batch, steps, -1), tuple(s.index_select(0, segments.last) for s in final)
