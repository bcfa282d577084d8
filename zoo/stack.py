"""The stack every architecture builds: :class:`RecurrentStack`, its layers bottom first, with the zoo's forward
contract (``../shared/DESIGN.md``): ``forward(x: (B, T, I), state=None, reset=None) -> (y: (B, T, H), state)``. The
state format and what a reset does are :mod:`zoo.state`'s; the layers are :mod:`zoo.layers`'; a training window on a
GPU runs as a captured graph (:mod:`zoo.window`).

Regularisers that act inside the recurrence live here, so that every architecture has them:

* ``dropout`` between layers, either a fresh mask per element (Zaremba et al. 2014) or, with ``locked_dropout``, one
  mask per sequence shared by every step (Gal & Ghahramani 2016; AWD-LSTM's ``LockedDropout``);
* ``state_dropout``: Melis et al. 2018's recurrent ("state") dropout, one mask per sequence on ``h_{t-1}`` where it
  enters the recurrence;
* ``weight_drop``: DropConnect on the hidden-to-hidden matrices (Merity et al. 2017). AWD-LSTM's ``WeightDrop`` deleted
  and re-registered ``nn.LSTM`` parameters and broke on nearly every PyTorch release; here the dropped matrices are
  passed in with :func:`torch.func.functional_call`, a public API that leaves the parameters and the state-dict keys
  alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from zoo import paths, window
from zoo.layers import FusedLayer, RecurrentLayer, sequence_dropout_mask
from zoo.state import KeepAt, Resets, State, mask_state


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
        last_layer_size: units of the last layer, where it differs from ``hidden_size``: AWD-LSTM's stack, whose
            last layer has the embedding's width so that the tied softmax reads it directly (salesforce/awd-lstm-lm
            ``model.py``: ``nhid if l != nlayers - 1 else ninp``). ``None``: ``hidden_size``. The carried state keeps
            its ``(L, B, H)`` layout: a narrower layer's rows are zero past its width.
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
        last_layer_size: int | None = None,
    ) -> None:
        super().__init__()
        for name, rate in [("dropout", dropout), ("state_dropout", state_dropout), ("weight_drop", weight_drop)]:
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate}")
        widths = [hidden_size] * num_layers
        if last_layer_size is not None and num_layers > 0:
            if last_layer_size < 1:
                raise ValueError(f"last_layer_size must be at least 1, got {last_layer_size}")
            if sum_layer_outputs and last_layer_size != hidden_size:
                raise ValueError("sum_layer_outputs adds the layers' outputs: they need one width, not last_layer_size")
            widths[-1] = last_layer_size
        self.sum_layer_outputs = sum_layer_outputs
        self.layers = nn.ModuleList(
            layer(input_size if i == 0 else widths[i - 1], widths[i]) for i in range(num_layers)
        )
        # The state's width: the widest layer's (a narrower layer's state is zero-padded to it, :meth:`_layer_state`).
        self.state_width = max(widths, default=hidden_size)
        self._padded_state = len(set(widths)) > 1
        if self._padded_state:
            self._check_padded_state()
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
        return self._stack_states(per_layer)

    def _check_padded_state(self) -> None:
        """Layers of several widths share one ``(L, B, H)`` state only if each of a layer's state tensors is
        ``(B, width)``: its rows can then be padded to the widest layer and sliced back."""
        for layer in self.layers:
            parameter = next(layer.parameters(), None)
            like = torch.empty(0) if parameter is None else parameter.new_empty(0)
            shapes = [tuple(s.shape) for s in layer.initial_state(1, like)]
            if any(shape != (1, layer.hidden_size) for shape in shapes):
                raise ValueError(
                    f"last_layer_size needs layers whose state tensors are (batch, width); {type(layer).__name__}'s "
                    f"are {shapes} at width {layer.hidden_size}: give every layer hidden_size units"
                )

    def _layer_state(self, state: State, index: int) -> State:
        """Layer ``index``'s part of the stack's state, each ``(B, ...)``, without the padding of a narrower layer."""
        if not self._padded_state:
            return tuple(s[index] for s in state)
        width = self.layers[index].hidden_size
        return tuple(s[index, ..., :width] for s in state)

    def _stack_states(self, per_layer: list[State]) -> State:
        """The layers' states as the stack's, each ``(L, B, ...)``, a narrower layer's zero-padded to the widest."""
        if self._padded_state:
            per_layer = [
                tuple(F.pad(s, (0, self.state_width - s.size(-1))) for s in layer_state) for layer_state in per_layer
            ]
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
        graphs = self.__dict__.get("_graphs")
        if graphs is not None:  # what a replay left is the last window's only if this window is replayed too
            graphs.statistics = None
        if state is None:
            parameter = next(self.parameters(), None)
            state = self.initial_state(x.size(0), x if parameter is None else x.new_empty(0, dtype=parameter.dtype))
        path = paths.window_path(self, x, resets=reset is not None)
        if self.training:
            self.__dict__["last_training_path"] = path  # for the start-up summary (zoo.window.summary)
        if path.stack == "merged":
            merged = self._merged_kernel()
            y, final = merged(x, state if len(state) > 1 else state[0])  # state: (L, B, H), nn.RNNBase's layout
            return y, final if isinstance(final, tuple) else (final,)
        if path.stack == "captured":
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
            layer_state = self._layer_state(state, index)  # each (B, ...)
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
        return output, self._stack_states(new_state)

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
        graphs = self.__dict__.get("_graphs")
        if graphs is not None and graphs.statistics is not None:  # the last window was a graph's replay
            return graphs.statistics
        per_layer = [layer.statistics() for layer in self.layers]
        keys = {key for stats in per_layer for key in stats}
        return {key: torch.stack([s[key] for s in per_layer if key in s]).mean() for key in sorted(keys)}


#: Options every architecture takes beside its own: :class:`RecurrentStack`'s keyword-only arguments, which each
#: architecture passes on as ``**stack_options``.
STACK_OPTIONS = tuple(
    name for name, p in inspect.signature(RecurrentStack.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY
)
