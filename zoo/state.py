"""The zoo's state format and its resets: what a training loop or a data module needs to know of a stack's state.

* A *state* is a tuple of tensors, each shaped ``(num_layers, B, ...)`` (for the LSTM: ``(h, c)``, the layout of
  ``nn.LSTM``'s ``hx``). ``None`` means zeros. Callers treat it as opaque apart from :func:`detach_state`.
* ``reset[b, t] = True`` zeroes stream b's state *before* step t. A reset at ``t = 0`` is applied to the incoming state;
  a reset later in the window needs more than one fused call, since cuDNN cannot zero a state mid-sequence: on CUDA the
  window's sentence segments run as one packed sequence (:meth:`zoo.layers.FusedLayer._segments`), elsewhere the
  per-step loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

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


def _moved(tensor: Tensor, device: torch.device | str, non_blocking: bool | None) -> Tensor:
    """``tensor.to(device)``; ``non_blocking=None`` copies from the CPU asynchronously (CUDA stages pageable memory
    before returning, so nothing waits for the device: Lightning passes ``non_blocking`` to tensors only) and to the
    CPU synchronously (an asynchronous copy to the host could be read before it lands)."""
    return tensor.to(device, non_blocking=tensor.device.type == "cpu" if non_blocking is None else non_blocking)


@dataclass(frozen=True)
class Segments:
    """A window cut at its resets into sentence segments, laid out as one ``PackedSequence`` for
    :meth:`zoo.layers.FusedLayer._segments`.

    Each stream's window is cut where it resets; every piece is a sequence of its own, the first starting from the
    stream's carried state and the others from zeros. The packed layout puts the pieces longest first, step by step
    (time-major), so packed row ``row_start[j] + rank[piece]`` holds step ``j`` of a piece: since every step of the
    window is in exactly one piece, packing is a permutation of the window's ``B * T`` steps, and so is unpacking.
    Built on the host (:meth:`from_reset`), then moved with the batch.

    Attributes:
        step_of_row: ``(B*T,)`` long, the flat step ``b * T + t`` at each packed row (gathers the packed input).
        row_of_step: ``(B*T,)`` long, the packed row of each flat step (gathers the output back).
        batch_sizes: pieces still running at each step, the ``PackedSequence``'s: host data, Python ints.
        first: ``(P,)`` bool, pieces in packed order that begin the window (they start from the carried state).
        owner: ``(P,)`` long, each piece's stream.
        last: ``(B,)`` long, each stream's last piece (whose final state is the stream's).
    """

    step_of_row: Tensor
    row_of_step: Tensor
    batch_sizes: tuple[int, ...]
    first: Tensor
    owner: Tensor
    last: Tensor

    _tensor_fields: ClassVar[tuple[str, ...]] = ("step_of_row", "row_of_step", "first", "owner", "last")

    @classmethod
    def from_reset(cls, reset: Tensor) -> Segments:
        """The segments of a window from its ``(B, T)`` bool reset mask, computed where the mask is (the host)."""
        batch, steps = reset.shape
        cut = reset.clone()
        cut[:, 0] = True  # every stream's window starts a piece, from the state it carries in
        cut = cut.flatten()  # (B*T,)
        starts = cut.nonzero().squeeze(1)  # (P,) flat step of each piece's first step, stream by stream
        lengths = torch.diff(starts, append=starts.new_tensor([batch * steps]))  # (P,)
        piece = cut.cumsum(0) - 1  # (B*T,) the piece of each step
        offset = torch.arange(batch * steps) - starts[piece]  # (B*T,) the step's position in its piece
        order = torch.sort(lengths, descending=True, stable=True).indices  # (P,) pieces, longest first
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))  # (P,) each piece's place in the packed order
        running = lengths[order].unsqueeze(0) > torch.arange(int(lengths.max())).unsqueeze(1)  # (L, P)
        batch_sizes = running.sum(1)  # (L,)
        row_start = batch_sizes.cumsum(0) - batch_sizes  # (L,) the first packed row of each step
        row_of_step = row_start[offset] + rank[piece]  # (B*T,)
        step_of_row = torch.empty_like(row_of_step)
        step_of_row[row_of_step] = torch.arange(batch * steps)
        streams_pieces = cut.view(batch, steps).sum(1)  # (B,)
        return cls(
            step_of_row=step_of_row,
            row_of_step=row_of_step,
            batch_sizes=tuple(batch_sizes.tolist()),
            first=starts[order] % steps == 0,
            owner=starts[order] // steps,
            last=rank[streams_pieces.cumsum(0) - 1],
        )

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> Segments:
        """The index tensors on ``device`` (``batch_sizes`` stay host ints); see :func:`_moved` for ``non_blocking``."""
        moved = {name: _moved(getattr(self, name), device, non_blocking) for name in self._tensor_fields}
        return replace(self, **moved)


@dataclass(frozen=True)
class Resets:
    """A window's ``(B, T)`` reset mask with where its resets fall, worked out on the host.

    Learning where a reset falls from a mask on a GPU makes the host wait for the device (``nonzero``, ``.tolist()``),
    once per window and again per layer for packed segments. :meth:`from_mask` does it while the mask is still on the
    host (where the data module builds the window: ``datamodules.multisequence``), and :meth:`to` moves the result
    with the batch (Lightning moves any object with a ``to`` method). A stack's ``forward`` takes one wherever it
    takes a mask.

    Attributes:
        mask: ``(B, T)`` bool, ``True`` zeroes stream b's state before step t.
        steps: the steps ``t > 0`` at which some stream resets (host data, Python ints).
        segments: the window's :class:`Segments`, or ``None`` when no stream resets after step 0.
    """

    mask: Tensor
    steps: tuple[int, ...]
    segments: Segments | None

    @classmethod
    def from_mask(cls, reset: Tensor) -> Resets:
        """Work out where ``reset``'s resets fall. A mask on the CPU costs no synchronisation; one on a GPU is copied
        to the host once (the result's tensors go back asynchronously)."""
        host = reset.cpu()  # (B, T); the mask itself on the CPU
        steps = tuple((host[:, 1:].any(0).nonzero().flatten() + 1).tolist())
        segments = Segments.from_reset(host).to(reset.device) if steps else None
        return cls(reset, steps, segments)

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> Resets:
        """The mask and segments on ``device``; see :func:`_moved` for ``non_blocking``."""
        segments = None if self.segments is None else self.segments.to(device, non_blocking)
        return Resets(_moved(self.mask, device, non_blocking), self.steps, segments)


class KeepAt(dict[int, Tensor]):
    """step ``t > 0`` -> ``(B,)`` keep-mask, for the steps where some stream resets: what every layer reads; with the
    window's :class:`Segments` (or ``None``) for a layer that runs it as packed segments."""

    def __init__(self, keep: dict[int, Tensor], segments: Segments | None) -> None:
        super().__init__(keep)
        self.segments = segments
