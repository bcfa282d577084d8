"""Multi-sequence batching for corpora of independent sentences (Léonard 2016, dataload's ``MultiSequence``).

The sentences of a split, each stored as ``<S> w1 ... wn </S>``, are laid end to end in ``C = batch_size *
world_size`` columns; every column is an endless-looking stream of whole sentences, read ``bptt`` steps at a time
with the recurrent state carried from one window to the next. Where a sentence starts, ``reset`` zeroes that column's
state (so no sentence sees another's context), and the step whose input is ``</S>`` predicts nothing (its target
would be the next, unrelated sentence's ``<S>``)::

    sentences (training: shuffled every epoch)   [S a b /S] [S c /S] [S d e f /S] [S g /S]      (C = 2, bptt = 4)

    column 0   inputs   S  a  b /S | S  c /S  .       column 1   inputs   S  d  e  f | /S S  g /S
               targets  a  b /S  - | c /S  -  -                  targets  d  e  f /S |  - g /S  -
               reset    1  0  0  0 | 1  0  0  0                  reset    1  0  0  0 |  0 1  0  0
                        window 0     window 1   (- = -100; . = padding after the column's last sentence)

That is the paper's scheme with PyTorch conventions: dataload separates sentences by an input 0 that
``LookupTableMaskZero`` turns into a zero vector, which ``SeqLSTM`` detects to zero its state, and a target masked by
``MaskZeroCriterion``; here the reset is an explicit mask (id 0 is a real word) and the masked step is the one whose
input is ``</S>``. Every sentence predicts its words and its ``</S>``, none its ``<S>``: the benchmark's perplexity.

Layout of an epoch, computed with numpy, no Python loop over tokens or sentences:

- the sentence order is a permutation seeded by ``(seed, epoch)`` for training, identical on every rank, and the
  corpus order for evaluation;
- the columns are contiguous chunks of that order, cut at the sentence boundaries nearest to ``k * total / C``, so
  every sentence is in exactly one column and column lengths differ from ``total / C`` by at most one sentence (the
  Torch tracker instead hands the next sentence to whichever column runs out first, which balances the same way);
- rank ``r`` reads columns ``r*B .. (r+1)*B - 1``: ranks hold disjoint sentences, and all of them run
  ``ceil(longest column / bptt)`` windows, so DDP steps stay in lockstep; shorter columns are padded with target -100.

A window gathers its ``(B, bptt + 1)`` tokens straight from the flat (memory-mapped) id array: a position of the
epoch's concatenated stream maps to its sentence by ``searchsorted`` over the cumulative lengths.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from datamodules.windows import IGNORE_INDEX, LMBatch, ResumableStream
from zoo.errors import ConfigError
from zoo.state import Resets


@dataclass(frozen=True)
class EpochLayout:
    """Where every sentence goes in one epoch.

    Attributes:
        order: ``(N,)`` sentence ids in the order they are laid out.
        ends: ``(N + 1,)`` cumulative lengths of ``order``: sentence ``order[j]`` occupies ``[ends[j], ends[j+1])`` of
            the epoch's concatenated stream.
        column_start: ``(C,)`` where each column begins in that stream (always a sentence start).
        column_length: ``(C,)`` tokens in each column.
        cuts: ``(C + 1,)`` column ``c`` holds ``order[cuts[c]:cuts[c+1]]``.
    """

    order: np.ndarray
    ends: np.ndarray
    column_start: np.ndarray
    column_length: np.ndarray
    cuts: np.ndarray

    def num_windows(self, bptt: int) -> int:
        """Windows that cover the longest column."""
        return math.ceil(int(self.column_length.max()) / bptt)


def epoch_layout(lengths: np.ndarray, num_columns: int, order: np.ndarray) -> EpochLayout:
    """Cut the sentences, in ``order``, into ``num_columns`` balanced contiguous columns.

    Args:
        lengths: ``(N,)`` tokens of each sentence (markers included).
        num_columns: ``C``.
        order: ``(N,)`` a permutation of the sentence ids.
    """
    ends = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths[order], out=ends[1:])
    total = int(ends[-1])
    ideal = np.arange(num_columns + 1, dtype=np.float64) * (total / num_columns)  # (C + 1,)
    above = np.searchsorted(ends, ideal).clip(1, len(order))  # first boundary >= ideal
    below = above - 1
    cuts = np.where(ideal - ends[below] <= ends[above] - ideal, below, above)  # the nearer boundary
    cuts[0], cuts[-1] = 0, len(order)
    cuts = np.maximum.accumulate(cuts)
    column_start = ends[cuts[:-1]]
    return EpochLayout(order, ends, column_start, ends[cuts[1:]] - column_start, cuts)


class MultiSequenceWindows(ResumableStream):
    """The :class:`LMBatch` windows of one split for one rank, as laid out above.

    Args:
        ids: ``(T_total,)`` int32 ids of every sentence, ``<S> ... </S>`` each, end to end (a memmap is fine).
        offsets: ``(N + 1,)`` int64; sentence ``i`` is ``ids[offsets[i]:offsets[i+1]]``.
        batch_size: columns on this rank (``B``).
        bptt: window length (the last window of an epoch may be shorter).
        pad_id: the input id of padding steps (their targets are -100).
        shuffle: a new sentence order every epoch (training); otherwise the corpus order (evaluation).
        seed: with the epoch, seeds the order; the same on every rank.
        rank: this process's rank.
        world_size: number of ranks.
        epoch: called at the start of every epoch for its number (e.g. the trainer's ``current_epoch``, so a resumed
            run continues the same sequence of orders); ``None``: count the epochs iterated.
        unscored_prefix: ``(N,)`` for each sentence, how many of its first input steps predict nothing (a task that
            scores only the answer part of an example, as the reverse-copy task does); ``None``: every step but the
            last predicts.
    """

    def __init__(
        self,
        ids: np.ndarray,
        offsets: np.ndarray,
        batch_size: int,
        bptt: int,
        pad_id: int,
        shuffle: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        epoch: Callable[[], int] | None = None,
        unscored_prefix: np.ndarray | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1 or bptt < 1:
            raise ConfigError(f"batch_size and bptt must be >= 1, got {batch_size} and {bptt}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.ids = ids
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.diff(self.offsets)  # (N,)
        if len(self.lengths) == 0:
            raise ValueError("a multi-sequence stream needs at least one sentence")
        if unscored_prefix is not None:
            unscored_prefix = np.asarray(unscored_prefix, dtype=np.int64)
            if unscored_prefix.shape != self.lengths.shape or (unscored_prefix < 0).any():
                raise ValueError("unscored_prefix needs one count >= 0 per sentence")
            unscored_prefix = np.minimum(unscored_prefix, self.lengths - 1)
        self.unscored_prefix = unscored_prefix
        self.bptt = bptt
        self._batch_size = batch_size
        self.pad_id = pad_id
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._cached: tuple[int, EpochLayout] | None = None
        self._init_epochs(epoch)

    @property
    def batch_size(self) -> int:
        """Columns (parallel streams) on this rank."""
        return self._batch_size

    @property
    def num_sentences(self) -> int:
        return len(self.lengths)

    @property
    def num_predicted(self) -> int:
        """Tokens predicted per epoch over all ranks: every id but each sentence's ``<S>`` (and its unscored prefix)."""
        unscored = 0 if self.unscored_prefix is None else int(self.unscored_prefix.sum())
        return int(self.offsets[-1] - self.offsets[0]) - self.num_sentences - unscored

    # ------------------------------------------------------------------------------------------------ layouts
    def layout(self, epoch: int) -> EpochLayout:
        """The layout of one epoch, a pass over the sentences (all ranks' columns)."""
        key = epoch if self.shuffle else 0  # evaluation reads every epoch in the same order
        if self._cached is None or self._cached[0] != key:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_sentences)
            else:
                order = np.arange(self.num_sentences)
            self._cached = (key, epoch_layout(self.lengths, self._batch_size * self.world_size, order))
        return self._cached[1]

    def __len__(self) -> int:
        return self.num_windows(self._current_epoch())

    def num_windows(self, epoch: int) -> int:
        return self.layout(epoch).num_windows(self.bptt)

    # ------------------------------------------------------------------------------------------------ windows
    def window(self, layout: EpochLayout, index: int) -> LMBatch:
        """Window ``index`` of an epoch: ``(B, T)`` inputs, targets and resets for this rank's columns, the resets
        also as a :class:`zoo.state.Resets`."""
        columns = slice(self.rank * self._batch_size, (self.rank + 1) * self._batch_size)
        start, length = layout.column_start[columns], layout.column_length[columns]  # (B,)
        t0 = index * self.bptt
        steps = min(self.bptt, int(layout.column_length.max()) - t0)
        position = t0 + np.arange(steps + 1)  # (T + 1,) the window's inputs and one more for the last target
        inside = position[None, :] < length[:, None]  # (B, T + 1)
        # Positions past a column's end read its last token (an empty column reads nothing real) and are masked.
        stream = start[:, None] + np.minimum(position[None, :], np.maximum(length - 1, 0)[:, None])  # (B, T + 1)
        stream = np.minimum(stream, layout.ends[-1] - 1)
        sentence = np.searchsorted(layout.ends, stream, side="right") - 1  # (B, T + 1) index into layout.order
        sentence_start, sentence_end = layout.ends[sentence], layout.ends[sentence + 1]
        source = self.offsets[layout.order[sentence]] + (stream - sentence_start)
        tokens = torch.from_numpy(np.asarray(self.ids[source], dtype=np.int64))  # (B, T + 1)
        inside_t = torch.from_numpy(inside[:, :steps])
        last_of_sentence = torch.from_numpy(stream[:, :steps] + 1 == sentence_end[:, :steps])  # input is </S>
        unpredicted = ~inside_t | last_of_sentence
        if self.unscored_prefix is not None:
            prefix = self.unscored_prefix[layout.order[sentence[:, :steps]]]  # (B, T)
            unpredicted |= torch.from_numpy(stream[:, :steps] - sentence_start[:, :steps] < prefix)
        inputs = tokens[:, :steps].masked_fill(~inside_t, self.pad_id)
        targets = tokens[:, 1:].masked_fill(unpredicted, IGNORE_INDEX)
        reset = inside_t & torch.from_numpy(stream[:, :steps] == sentence_start[:, :steps])
        # Where the resets fall, worked out here on the host: a step on a GPU would otherwise wait to learn it.
        return LMBatch(inputs, targets, reset, Resets.from_mask(reset))

    def __iter__(self) -> Iterator[LMBatch]:
        epoch, skip = self._next_epoch()  # windows are addressed by index, so a resumed epoch skips for free
        layout = self.layout(epoch)
        for index in range(skip, layout.num_windows(self.bptt)):
            self._yielded(epoch, index + 1)
            yield self.window(layout, index)
