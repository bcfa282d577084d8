"""A training window of a recurrent stack as one captured CUDA graph: the per-step cells at the GPU's pace.

Why: a per-step cell runs a few small kernels per layer and step (the Mogrifier some twenty forward and twice as many
backward). On a GPU each kernel takes a few microseconds and its launch from Python ten or more, so the step time is
the host's: on one H100 a 2 x 650 Mogrifier took 58 ms a training step at batch 20 and at batch 64 alike
(``benchmarks/results/gpu-h100/cells.txt``). Replayed from a CUDA graph, the same kernels run back to back with no
Python between them: ``benchmarks/cells.py --device cuda --eager`` measures both (docs/results.md).

The route is PyTorch's own :func:`torch.cuda.make_graphed_callables`: it captures the window's forward and its
backward as two graphs and returns an autograd node that replays them, so Lightning's automatic optimization, the
optimizer and gradient clipping see ordinary gradients. It replays whatever kernels the capture ran, so the zoo's
autograd Functions that keep Python state between a window's forward and backward (``zoo.kernels.RecurrentMatmul``)
are captured as they are. ``torch.compile(mode="reduce-overhead")`` would capture the window as well, but must trace
it first: through those Functions it cannot, and the unrolled window costs tens of seconds of compilation per shape.

What a graph needs, and how a window provides it:

* static shapes: one graph per window signature (shapes, dtypes, which inputs need a gradient, the autocast dtype,
  the parameters' storage), captured at its first window; at most :data:`MAX_GRAPHS` per stack, after which new
  signatures run the plain path (variable BPTT draws a handful of lengths; a data module's last, shorter batch is one);
* no host decision: a window with resets multiplies the state by its keep mask at *every* step (``keep = 1`` where no
  stream resets, an exact no-op in floating point), instead of finding on the host where the resets fall;
* the same random numbers drawn anew at each replay: dropout masks come from the CUDA generator, which capture
  registers so that each replay advances its offset.

The plain path stays: a stack runs it on the CPU, in evaluation and without gradients, wherever a layer runs cuDNN's
fused kernel (already one kernel a window), under ``LM_ZOO_WINDOW_GRAPHS=0`` or ``LM_ZOO_KERNELS=plain``
(:mod:`zoo.settings`; :func:`zoo.paths.window_path` decides), and for a signature whose capture failed (one warning
says why). The GPU suite holds the two
equal (outputs, final state, every gradient).
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zoo.state import Resets, State

# The stacks are zoo.stack's RecurrentStack, which imports this module: typed here by what is used of them (their
# layers, parameters, mode and run_layers), so that neither module needs the other to be read first.
RecurrentStack = nn.Module

#: Graphs kept per stack: each holds its own memory pool (a window's activations), so a stack that met many shapes
#: would hold many windows' memory. Further signatures run the plain path.
MAX_GRAPHS = 8


def keep_mask(reset: Tensor | Resets, dtype: torch.dtype) -> Tensor:
    """``(B, T)`` 1 where a stream keeps its state before a step, 0 where it resets, from a reset mask or
    :class:`~zoo.state.Resets` (device ops only: no host synchronisation)."""
    mask = reset.mask if isinstance(reset, Resets) else reset
    return (~mask).to(dtype)


@dataclass
class _Graph:
    """One captured window: the graphed callable and the shape of its outputs."""

    run: Callable[..., tuple[Tensor, ...]]
    state_size: int
    has_regularization: bool
    capture_seconds: float
    statistics: tuple[str, ...] = ()  # the names of the layers' statistics, the last outputs


class _Window(nn.Module):
    """A stack's window as a module of tensor arguments, for capture: ``(x, *state[, keep]) -> (y, *state[, loss],
    *statistics)``. The statistics (Skip RNN's update fraction) are outputs of the graph: a layer keeps them as a
    tensor of the capture's, which a replay of another window shape's graph would leave stale.

    The stack is held by a weak reference, not in ``_modules`` (it owns this wrapper, not the other way around);
    :meth:`parameters` is the stack's, which is what :func:`torch.cuda.make_graphed_callables` differentiates the
    captured backward for.
    """

    def __init__(self, stack: RecurrentStack, state_size: int, has_keep: bool) -> None:
        super().__init__()
        # A weak reference: the stack holds its graphs, which hold this wrapper. A cycle would leave a dropped stack's
        # graphs to the garbage collector, which can run in the middle of another capture, and freeing a graph
        # during a capture invalidates it (seen on an H200: a model's capture failed when the previous setting's
        # models were collected).
        self._stack = weakref.ref(stack)
        self.state_size = state_size
        self.has_keep = has_keep
        self.has_regularization = False
        self.statistics: tuple[str, ...] = ()
        self.training = stack.training

    @property
    def stack(self) -> RecurrentStack:
        stack = self._stack()
        assert stack is not None, "a window's graph outlived its stack"
        return stack

    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        return self.stack.parameters(recurse)

    def forward(self, x: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        state = rest[: self.state_size]
        keep = rest[self.state_size] if self.has_keep else None
        y, final = self.stack.run_layers(x, state, keep)
        loss = self.stack.regularization_loss()
        self.has_regularization = loss is not None
        statistics = self.stack.statistics()
        self.statistics = tuple(statistics)
        # Detached and copied: an output of the graph of its own, not a view that autograd would track.
        values = tuple(value.detach().clone() for value in statistics.values())
        return (y, *final, *values) if loss is None else (y, *final, loss, *values)


class WindowGraphs:
    """The captured windows of one stack, by signature; see the module doc.

    Kept in the stack's ``__dict__`` (not a submodule, not in its state dict); a copy of the stack (``deepcopy``,
    as weight averaging makes, or pickling) starts with none, since a graph replays on the memory it was captured
    on.
    """

    def __init__(self) -> None:
        self.graphs: dict[tuple, _Graph] = {}
        self.failed: dict[tuple, str] = {}
        self.past_limit: set[tuple] = set()  # signatures met after MAX_GRAPHS were captured: they run eagerly
        self.regularization: Tensor | None = None
        self.statistics: dict[str, Tensor] | None = None  # the last replayed window's layer statistics

    def __deepcopy__(self, memo: dict) -> WindowGraphs:
        return WindowGraphs()

    def __reduce__(self) -> tuple:
        return (WindowGraphs, ())

    @property
    def capture_seconds(self) -> list[float]:
        """Seconds each capture took (warm-up runs included), in the order the signatures came."""
        return [graph.capture_seconds for graph in self.graphs.values()]

    def run(
        self, stack: RecurrentStack, x: Tensor, state: State, reset: Tensor | Resets | None
    ) -> tuple[Tensor, State] | None:
        """The window through its graph (captured now if its signature is new), or ``None``: run the plain path.

        Args:
            stack: the stack whose window this is (its parameters are the graph's).
            x: ``(B, T, I)``.
            state: the stack's state, each ``(L, B, ...)``.
            reset: ``(B, T)`` bool or :class:`~zoo.state.Resets`, or ``None``.
        """
        self.regularization = self.statistics = None
        args = (x, *state) if reset is None else (x, *state, keep_mask(reset, x.dtype))
        key = _signature(stack, args, reset is not None)
        graph = self.graphs.get(key)
        if graph is None:
            if key in self.failed:
                return None
            if len(self.graphs) >= MAX_GRAPHS:
                if not self.past_limit:
                    warnings.warn(
                        f"lm-zoo: a training window of a new shape after {MAX_GRAPHS} captured ones runs eagerly, as "
                        "will any further new shape (each graph keeps a window's memory): round the window lengths to "
                        "a few values to replay them all",
                        stacklevel=3,
                    )
                self.past_limit.add(key)
                return None
            graph = self._capture(stack, args, key, reset is not None)
            if graph is None:
                return None
        outputs = graph.run(*args)
        y, final = outputs[0], tuple(outputs[1 : 1 + graph.state_size])
        rest = outputs[1 + graph.state_size :]
        self.regularization = rest[0] if graph.has_regularization else None
        self.statistics = dict(zip(graph.statistics, rest[graph.has_regularization :], strict=True))
        return y, final

    def _capture(self, stack: RecurrentStack, args: tuple[Tensor, ...], key: tuple, has_keep: bool) -> _Graph | None:
        window = _Window(stack, len(args) - 1 - has_keep, has_keep)
        start = time.perf_counter()
        collecting = gc.isenabled()
        gc.collect()  # what is garbage now is freed before the capture, not during it (see _Window)
        gc.disable()
        try:
            with _capturable_autocast(args[0].device.type):
                # The sample arguments are copies: capture writes into them, and the caller's own stay as they are.
                samples = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
                run = torch.cuda.make_graphed_callables(window, samples, allow_unused_input=True)
        except Exception as error:  # noqa: BLE001 - whatever capture refuses, the plain path computes the same
            self.failed[key] = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"lm-zoo: this window could not be captured as a CUDA graph ({self.failed[key]}); it runs the plain "
                "per-step path",
                stacklevel=3,
            )
            return None
        finally:
            if collecting:
                gc.enable()
        graph = _Graph(
            run, window.state_size, window.has_regularization, time.perf_counter() - start, window.statistics
        )
        self.graphs[key] = graph
        return graph


def _signature(stack: nn.Module, args: tuple[Tensor, ...], has_keep: bool) -> tuple:
    """What a captured window is valid for: the arguments' shapes, dtypes and gradient needs, the mode, the autocast
    dtype, and the parameters' storage (a graph reads them where they were at capture)."""
    device = args[0].device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return (
        tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args),
        has_keep,
        stack.training,
        autocast,
        tuple(p.data_ptr() for p in stack.parameters()),
    )


def _capturable_autocast(device: str) -> contextlib.AbstractContextManager:
    """Autocast as it is, without its cast cache, which :func:`torch.cuda.make_graphed_callables` refuses (a cached
    cast would be made once, at capture, and then stay stale across replays while the weights change)."""
    if not torch.is_autocast_enabled(device):
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)


def summary(model: nn.Module) -> str | None:
    """One line on how ``model``'s stacks ran their last training window (:func:`zoo.paths.window_path`) and on the
    windows captured so far (how many, the seconds their captures took, how many could not be, how many shapes came
    past :data:`MAX_GRAPHS`), or ``None`` where no stack has run a training window."""
    stacks = [m for m in model.modules() if "last_training_path" in m.__dict__]
    if not stacks:
        return None
    ways = sorted({m.__dict__["last_training_path"].describe() for m in stacks})
    line = f"training windows run {'; '.join(ways)}"
    tried = [m.__dict__["_graphs"] for m in stacks if "_graphs" in m.__dict__]
    seconds = [s for graphs in tried for s in graphs.capture_seconds]
    failed = sum(len(graphs.failed) for graphs in tried)
    past_limit = sum(len(graphs.past_limit) for graphs in tried)
    if seconds or failed:
        line += f"; {len(seconds)} window shape(s) captured in {sum(seconds):.2f} s"
    line += f"; {failed} could not be and run eagerly (warned above)" if failed else ""
    return line + (f"; {past_limit} more past the limit of {MAX_GRAPHS} run eagerly" if past_limit else "")
