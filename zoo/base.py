"""What every recurrent stack in the zoo shares: the layer and stack classes, the per-step loop and the regularisers.

The zoo contract (``../shared/DESIGN.md``): ``forward(x: (B, T, I), state=None, reset=None) -> (y: (B, T, H), state)``.

* A stack is a :class:`RecurrentStack` of :class:`RecurrentLayer` s; the state format and what a reset does are
  :mod:`zoo.state`'s.
* Adding a cell: subclass :class:`CellLayer`, put everything that does not depend on the state in
  :meth:`~CellLayer.hoist` (one matmul over the whole window) and the recurrence in :meth:`~CellLayer.step`; then
  subclass :class:`RecurrentStack`, passing it that layer class and the cell's own options (its docstring shows how).

Regularisers that act inside the recurrence live here, so that every architecture has them:

* ``dropout`` between layers, either a fresh mask per element (Zaremba et al. 2014) or, with ``locked_dropout``, one
  mask per sequence shared by every step (Gal & Ghahramani 2016; AWD-LSTM's ``LockedDropout``);
* ``state_dropout``: Melis et al. 2018's recurrent ("state") dropout, one mask per sequence on ``h_{t-1}`` where it
  enters the recurrence;
* ``weight_drop``: DropConnect on the hidden-to-hidden matrices (Merity et al. 2017). AWD-LSTM's ``WeightDrop`` deleted
  and re-registered ``nn.LSTM`` parameters and broke on nearly every PyTorch release; here the dropped matrices are
  passed in with :func:`torch.func.functional_call`, a public API that leaves the parameters and the state-dict keys
  alone.

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

import inspect
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from zoo import window
from zoo.errors import ConfigError
from zoo.kernels import plain_kernels
from zoo.state import KeepAt, Resets, Segments, State, mask_state


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
        if self.int8:
            if state_mask is not None:
                raise ConfigError("an int8 layer is for inference: state dropout needs the float model")
            return self._segments(x, state, keep_at) if keep_at else self._fused(x, state)
        if self.fused and state_mask is None and not plain_kernels() and self._fused_kernel_runs(x):
            packed = self.packed_segments if self.packed_segments is not None else x.device.type == "cuda"
            if not keep_at:
                y, hx = self._fused(x, state)
                return y, hx
            if packed:
                return self._segments(x, state, keep_at)
        return super().forward(x, state, keep_at, state_mask)

    def _fused_kernel_runs(self, x: Tensor) -> bool:
        """Whether the fused kernel runs in the autocast dtype in force (always on GPU, or without autocast)."""
        dtype = autocast_dtype(x.device.type)
        return dtype is None or x.device.type != "cpu" or _fused_runs_in(self.rnn, dtype)

    def _fused(self, x: Tensor | nn.utils.rnn.PackedSequence, state: State) -> tuple[Any, State]:
        """The fused kernel over ``x`` from ``state`` (each ``(N, H)``); the final state in the weights' dtype."""
        hx = tuple(s.unsqueeze(0) for s in state)  # (1, N, H): nn.RNNBase's (layers, N, H)
        device = (x.data if isinstance(x, nn.utils.rnn.PackedSequence) else x).device.type
        compute = None if self.int8 else autocast_dtype(device)
        if compute is None:
            y, hx = self.rnn(x, hx if self.state_size > 1 else hx[0])
        else:
            # Autocast's dtype, cast here rather than by autocast, whose RNN rule is float16 on CUDA whatever the
            # autocast dtype (module doc). `_flat_weights` are the weights the module would use, including a
            # weight_drop'ped matrix that functional_call put in place.
            weights = {
                n: w.to(compute) for n, w in zip(self.rnn._flat_weights_names, self.rnn._flat_weights, strict=True)
            }
            hx = tuple(h.to(compute) for h in hx)
            with torch.autocast(device, enabled=False):
                y, hx = functional_call(self.rnn, weights, (x.to(compute), hx if self.state_size > 1 else hx[0]))
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


class RecurrentStack(nn.Module):
    """A stack of recurrent layers with the zoo's forward contract and the recurrent regularisers.

    Every architecture builds its stack here, one way: a subclass whose ``__init__`` takes the sizes, its own options
    and ``**stack_options``, and passes its layer class (with its options bound by :func:`functools.partial`) on::

        super().__init__(partial(LSTMLayer, fused=fused), input_size, hidden_size, num_layers, **stack_options)

    Initialisation that must survive ``init_range`` (a forget-gate bias: :meth:`set_forget_bias`) comes after that
    call. The keyword-only arguments below are the options every architecture takes (:data:`STACK_OPTIONS`).

    Args:
        layer: builds one layer from its ``(input_size, hidden_size)``; called once per layer, bottom first.
        input_size: size of each input vector (the first layer's input; the others read ``hidden_size``).
        hidden_size: units per layer.
        num_layers: stacked layers.
        dropout: dropout on each layer's output except the last.
        locked_dropout: use one ``dropout`` mask per sequence (shared over time) instead of one per element.
        state_dropout: Melis et al.'s recurrent dropout on ``h_{t-1}``, one mask per sequence and window.
        weight_drop: DropConnect rate on the hidden-to-hidden matrices (AWD-LSTM), one mask per window.
        init_range: if set, every parameter starts Uniform(-init_range, init_range) (Zaremba et al. 2014);
            subclasses apply their own initialisation (e.g. the forget bias) after this.
        sum_layer_outputs: the stack's output is the sum of every layer's output (before the dropout between
            layers) instead of the last layer's: lamb's ``lstm_skip_connection`` (``SkipMultiRNNCell``), which the
            Mogrifier paper's released configurations use.
    """

    def __init__(
        self,
        layer: Callable[[int, int], RecurrentLayer],
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        *,
        dropout: float = 0.0,
        locked_dropout: bool = False,
        state_dropout: float = 0.0,
        weight_drop: float = 0.0,
        init_range: float | None = None,
        sum_layer_outputs: bool = False,
    ) -> None:
        super().__init__()
        for name, rate in [("dropout", dropout), ("state_dropout", state_dropout), ("weight_drop", weight_drop)]:
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate}")
        self.sum_layer_outputs = sum_layer_outputs
        self.layers = nn.ModuleList(
            layer(input_size if i == 0 else hidden_size, hidden_size) for i in range(num_layers)
        )
        self.dropout = dropout
        self.locked_dropout = locked_dropout
        self.state_dropout = state_dropout
        self.weight_drop = weight_drop
        if init_range is not None:
            for p in self.layers.parameters():
                nn.init.uniform_(p, -init_range, init_range)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def set_forget_bias(self, value: float | None) -> None:
        """Give every layer the effective forget-gate bias ``value`` (Jozefowicz et al. 2015 §2.2: 1, "LSTM-b").

        Architectures with a forget gate call this after ``__init__``, i.e. after ``init_range`` has been applied, so
        a uniform re-initialisation cannot wipe the bias out. ``None`` leaves the biases as initialised. The layers
        implement ``set_forget_bias(value)``.
        """
        self.forget_bias = value
        if value is not None:
            for layer in self.layers:
                layer.set_forget_bias(value)

    @property
    def hidden_size(self) -> int:
        return self.layers[-1].hidden_size

    def initial_state(self, batch_size: int, like: Tensor) -> State:
        """All-zero state for ``batch_size`` streams, each tensor ``(L, B, ...)``."""
        per_layer = [layer.initial_state(batch_size, like) for layer in self.layers]
        return tuple(torch.stack(parts) for parts in zip(*per_layer))

    def forward(
        self, x: Tensor, state: State | None = None, reset: Tensor | Resets | None = None
    ) -> tuple[Tensor, State]:
        """Run the stack over a window.

        Args:
            x: ``(B, T, I)`` inputs.
            state: the state after the previous window, or ``None`` for zeros.
            reset: ``(B, T)`` bool; ``True`` zeroes that stream's state before that step. Or a :class:`Resets`, the
                same mask with where its resets fall, worked out on the host: then the window needs no host
                synchronisation (a bare mask on a GPU costs one, to learn where its resets fall).

        Returns:
            ``(y, state)`` with ``y`` the last layer's outputs ``(B, T, H)`` (with ``sum_layer_outputs``: the sum of
            every layer's).
        """
        if state is None:
            parameter = next(self.parameters(), None)
            state = self.initial_state(x.size(0), x if parameter is None else x.new_empty(0, dtype=parameter.dtype))
        if reset is None and self._merged_kernel_runs(x):
            merged = self._merged_kernel()
            if merged is not None:
                y, final = merged(x, state if len(state) > 1 else state[0])  # state: (L, B, H), nn.RNNBase's layout
                return y, final if isinstance(final, tuple) else (final,)
        if window.captures(self, x):
            graphed = self._window_graphs().run(self, x, state, reset)
            if graphed is not None:
                return graphed
        keep_at: dict[int, Tensor] = {}
        if reset is not None:
            # Where the resets fall is host data: a Resets brings it (worked out before the batch moved to the
            # device); a bare mask on a GPU is copied to the host once to learn it.
            resets = reset if isinstance(reset, Resets) else Resets.from_mask(reset)
            keep = (~resets.mask).to(x.dtype)  # (B, T)
            state = mask_state(state, keep[:, 0])
            keep_at = KeepAt({t: keep[:, t] for t in resets.steps}, resets.segments)
        return self._run_layers(x, state, keep_at)

    def run_layers(self, x: Tensor, state: State, keep: Tensor | None) -> tuple[Tensor, State]:
        """The window with its resets applied as a keep mask at every step, what a captured graph runs
        (:mod:`zoo.window`): no host decision on where the resets fall. Equal to :meth:`forward` with ``reset =
        keep == 0`` (a keep of 1 multiplies exactly).

        Args:
            x: ``(B, T, I)``.
            state: the state, each ``(L, B, ...)``.
            keep: ``(B, T)`` 1 to keep a stream's state before a step, 0 to reset it; ``None``: no resets.
        """
        if keep is None:
            return self._run_layers(x, state, {})
        state = mask_state(state, keep[:, 0])
        return self._run_layers(x, state, {t: keep[:, t] for t in range(1, x.size(1))})

    def _window_graphs(self) -> window.WindowGraphs:
        graphs = self.__dict__.get("_graphs")
        if graphs is None:
            graphs = self.__dict__["_graphs"] = window.WindowGraphs()  # not a submodule: see its doc
        return graphs

    def _run_layers(self, x: Tensor, state: State, keep_at: dict[int, Tensor]) -> tuple[Tensor, State]:
        layer_input = x
        new_state: list[State] = []
        summed: Tensor | None = None
        for index, layer in enumerate(self.layers):
            layer_state = tuple(s[index] for s in state)  # each (B, ...)
            state_mask = None
            if self.training and self.state_dropout > 0:
                state_mask = sequence_dropout_mask(layer_state[0], self.state_dropout)  # (B, H)
            args = (layer_input, layer_state, keep_at, state_mask)
            if self.training and self.weight_drop > 0 and layer.recurrent_weights:
                dropped = {
                    name: F.dropout(layer.get_parameter(name), self.weight_drop) for name in layer.recurrent_weights
                }
                layer_input, layer_state = functional_call(layer, dropped, args, strict=False)
            else:
                layer_input, layer_state = layer(*args)
            new_state.append(layer_state)
            if self.sum_layer_outputs:
                summed = layer_input if summed is None else summed + layer_input  # (B, T, H)
            if index < self.num_layers - 1:
                layer_input = self._between_layers(layer_input)
        output = summed if self.sum_layer_outputs else layer_input
        return output, tuple(torch.stack(parts) for parts in zip(*new_state))

    def _merged_kernel_runs(self, x: Tensor) -> bool:
        """Whether a window may run as one multi-layer kernel call (:meth:`_merged_kernel`): inference on the CPU,
        where nothing runs between the layers and no gradient is taken (the per-layer path stays the one trained
        and differentiated through, dynamic evaluation's included)."""
        return (
            not self.training
            and not torch.is_grad_enabled()
            and x.device.type == "cpu"
            and not self.sum_layer_outputs
            and not plain_kernels()
            and not torch.is_autocast_enabled("cpu")
        )

    def _merged_kernel(self) -> nn.RNNBase | None:
        """The layers as one multi-layer ``nn.LSTM``/``nn.GRU``/``nn.RNN`` over their own parameters (the same
        tensors, not copies), or ``None`` where the stack is not fused layers of one kind and width.

        Sampling runs one step per call, where each kernel call's fixed cost is most of a small model's step: one
        call for the stack instead of one per layer is what pytorch/examples' two-layer ``nn.LSTM`` loop pays
        (``benchmarks/inference_overhead.py``). The outputs are bit for bit the per-layer calls'
        (``tests/test_kernels.py``). Built once, on the meta device so that nothing is allocated, and again when a
        layer's weight is another tensor than it was built over (``load_state_dict(assign=True)``, int8
        quantization); the check is what a step pays, a few microseconds.
        """
        rnns = [getattr(layer, "rnn", None) for layer in self.layers]
        weights = [w for rnn in rnns for w in getattr(rnn, "_flat_weights", ())]
        cached = self.__dict__.get("_merged")
        if cached is not None and len(cached[1]) == len(weights) and all(a is b for a, b in zip(cached[1], weights)):
            return cached[0]
        merged = self._build_merged_kernel()
        self.__dict__["_merged"] = (merged, weights)  # not a submodule: its parameters are the layers'
        return merged

    def _build_merged_kernel(self) -> nn.RNNBase | None:
        layers = list(self.layers)
        first = layers[0].rnn if layers and isinstance(layers[0], FusedLayer) else None
        if not isinstance(first, nn.RNNBase) or not all(
            isinstance(layer, FusedLayer)
            and layer.fused
            and not layer.int8
            and type(layer.rnn) is type(first)
            and layer.rnn.hidden_size == first.hidden_size
            and layer.rnn.bias == first.bias
            and layer.rnn.proj_size == 0
            and getattr(layer.rnn, "nonlinearity", None) == getattr(first, "nonlinearity", None)
            and (index == 0 or layer.rnn.input_size == first.hidden_size)
            for index, layer in enumerate(layers)
        ):
            return None
        options = {"nonlinearity": first.nonlinearity} if isinstance(first, nn.RNN) else {}
        merged = type(first)(
            first.input_size, first.hidden_size, len(layers), bias=first.bias, batch_first=True, device="meta",
            **options,
        )  # fmt: skip
        for index, layer in enumerate(layers):
            for name in layer.rnn._flat_weights_names:  # layer i's weight_ih_l0 is the stack's weight_ih_l{i}
                # nn.RNNBase.__setattr__ also puts it in the flat weight list its kernel reads.
                setattr(merged, f"{name[:-1]}{index}", getattr(layer.rnn, name))
        return merged

    def _between_layers(self, y: Tensor) -> Tensor:
        if not self.training or self.dropout == 0:
            return y
        if self.locked_dropout:
            return y * sequence_dropout_mask(y[:, 0], self.dropout).unsqueeze(1)  # (B, 1, H) over all steps
        return F.dropout(y, self.dropout, training=True)

    def regularization_loss(self) -> Tensor | None:
        """The sum of the layers' extra training-loss terms for the last window, or ``None`` if they have none."""
        graphs = self.__dict__.get("_graphs")
        if graphs is not None and graphs.regularization is not None:  # the last window was a graph's replay
            loss, graphs.regularization = graphs.regularization, None
            return loss
        terms = [loss for loss in (layer.regularization_loss() for layer in self.layers) if loss is not None]
        return torch.stack(terms).sum() if terms else None

    def statistics(self) -> dict[str, Tensor]:
        """The layers' statistics for the last window, averaged over layers."""
        per_layer = [layer.statistics() for layer in self.layers]
        keys = {key for stats in per_layer for key in stats}
        return {key: torch.stack([s[key] for s in per_layer if key in s]).mean() for key in sorted(keys)}


#: Options every architecture takes beside its own: :class:`RecurrentStack`'s keyword-only arguments, which each
#: architecture passes on as ``**stack_options``.
STACK_OPTIONS = tuple(
    name for name, p in inspect.signature(RecurrentStack.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY
)
