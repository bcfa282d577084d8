"""Which way a window of a recurrent stack runs: decided here, and only here.

The same network can run a window in several ways, each computing the same function (the tests hold them equal):

* ``merged``: the whole stack as one multi-layer ``nn.LSTM``/``nn.GRU``/``nn.RNN`` call over the layers' own weights
  (inference on the CPU, no resets: sampling's step; :meth:`zoo.stack.RecurrentStack._merged_kernel`);
* ``captured``: the stack's training window replayed from a CUDA graph (:mod:`zoo.window`), its layers each running
  their per-step loop inside it;
* ``layers``: each layer in turn, by its own path:

  * ``fused``: cuDNN's or oneDNN's kernel over the window (one ``nn.LSTM`` call a layer);
  * ``packed``: that kernel over the window's sentence segments, packed, where the window has resets inside;
  * ``per-step``: the cell's own loop, one step at a time (:class:`zoo.layers.CellLayer`).

An int8 layer (:func:`zoo.quantization.quantize_int8`) has no float weights for a loop: it always runs its kernel,
fused or packed. The stack asks :func:`window_path` once a window, a layer asks :func:`layer_path` (the same rules:
the stack's answer lists each layer's), and the capture is decided from the layers' answers: a window is captured only
where every layer would run its per-step loop, since a fused layer is already one kernel a window and a packed one
works out its segments on the host. So a fused layer with state dropout, which runs its loop, is captured too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from zoo import settings

StackPath = Literal["merged", "captured", "layers"]
LayerPath = Literal["fused", "packed", "per-step"]


@dataclass(frozen=True)
class WindowPath:
    """How a window runs: the stack's way and, under it, each layer's (bottom first)."""

    stack: StackPath
    layers: tuple[LayerPath, ...]

    def describe(self) -> str:
        """``captured as a CUDA graph (layers: per-step, per-step)``, for the start-up summary."""
        way = {
            "merged": "one multi-layer kernel call",
            "captured": "captured as a CUDA graph",
            "layers": "layer by layer",
        }
        return f"{way[self.stack]} (layers: {', '.join(self.layers)})"


def layer_path(layer: nn.Module, x: Tensor, *, resets: bool, state_dropout: bool) -> LayerPath:
    """The way ``layer`` runs a window over ``x``.

    Args:
        layer: a :class:`zoo.layers.RecurrentLayer`; only a :class:`zoo.layers.FusedLayer` has a kernel to run.
        x: the window's input ``(B, T, I)`` (its device and the autocast state in force decide).
        resets: some stream resets inside the window.
        state_dropout: a state-dropout mask applies to this window (training with ``state_dropout``).
    """
    if getattr(layer, "int8", False):
        return "packed" if resets else "fused"
    if not getattr(layer, "fused", False) or state_dropout or settings.current().plain_kernels:
        return "per-step"
    if not layer.fused_kernel_runs(x):
        return "per-step"
    if not resets:
        return "fused"
    # cuDNN's packed kernel beats the per-step loop; on the CPU oneDNN's does not (FusedLayer.packed_segments).
    packed = layer.packed_segments if layer.packed_segments is not None else x.device.type == "cuda"
    return "packed" if packed else "per-step"


def window_path(stack: nn.Module, x: Tensor, *, resets: bool) -> WindowPath:
    """The way ``stack`` (a :class:`zoo.stack.RecurrentStack`) runs a window over ``x``; ``resets``: some stream
    resets inside it."""
    state_dropout = stack.training and stack.state_dropout > 0
    layers = tuple(layer_path(layer, x, resets=resets, state_dropout=state_dropout) for layer in stack.layers)
    if not resets and _merged_runs(stack, x) and stack._merged_kernel() is not None:
        return WindowPath("merged", layers)
    if all(path == "per-step" for path in layers) and _captures(stack, x):
        return WindowPath("captured", layers)
    return WindowPath("layers", layers)


def _merged_runs(stack: nn.Module, x: Tensor) -> bool:
    """Inference on the CPU, where nothing runs between the layers and no gradient is taken (the per-layer path stays
    the one trained and differentiated through, dynamic evaluation's included)."""
    return (
        not stack.training
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and not stack.sum_layer_outputs
        and not settings.current().plain_kernels
        and not torch.is_autocast_enabled("cpu")
    )


def _captures(stack: nn.Module, x: Tensor) -> bool:
    """Training on CUDA with gradients, window graphs on (:mod:`zoo.settings`), not already inside a capture (a whole
    training step's: ``lightning_modules.training_step``)."""
    return (
        x.device.type == "cuda"
        and stack.training
        and torch.is_grad_enabled()
        and settings.current().window_graphs
        and not settings.current().plain_kernels
        and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    )
