"""Stream batching for stateful truncated BPTT: the pytorch/examples ``batchify``/``get_batch`` idiom, made exact.

The id stream of a split (with one start-of-stream ``<eos>`` prepended, so its first word is predicted too) gives
``N`` (input, target) pairs. They are cut into ``C = batch_size * world_size`` contiguous columns whose lengths differ
by at most one; nothing is dropped, so every token is predicted exactly once per epoch. Rank ``r`` takes columns
``r*B .. (r+1)*B - 1``. Windows of ``bptt`` steps are then read left to right, in order, never shuffled, and the
recurrent state carries from one window to the next::

    stream:  e a b c d e f g h i j k l m      (e = <eos>; N = 13 pairs, B = 3, bptt = 2)

    column 0: e a b c d  -> targets a b c d e      window 0   window 1   window 2
    column 1: e f g h    -> targets f g h i        [e a]      [b c]      [d]
    column 2: i j k l    -> targets j k l m        [e f]      [g h]      [-]  <- padding, target -100
                                                   [i j]      [k l]      [-]

The last window is shorter when ``bptt`` does not divide the column length (kept, not dropped). Columns shorter than
the longest are padded with target ``-100``. All ranks get the same number of windows (DDP steps stay in lockstep).

Resuming (the protocol every training stream follows, so that ``lm-zoo fit --ckpt_path last`` continues mid-epoch):
``state_dict()`` returns ``{"epoch": e, "windows": n}``, the epoch being read (or the next one, before it starts) and
how many of its windows were yielded; after ``load_state_dict({"epoch": e, "windows": n})`` iterations read epoch
``e`` from its window ``n`` on, computing where that is (never by generating the skipped windows), until the
trainer's epoch is past ``e``; ``n`` at or past the end of epoch ``e`` means epoch ``e + 1`` from its start. Otherwise
the epoch comes from the trainer (the ``epoch`` argument): when Lightning restores a run it may start an iterator
before restoring its counters, or start one, fetch a window and drop it, so counting iterations would drift. The data
module saves the position the trainer has *trained* (:func:`training_position`), not ``state_dict()``'s count of
windows *yielded*: Lightning fetches one window ahead when a loader has no length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset

from zoo.errors import ConfigError
from zoo.language_model import IGNORE_INDEX  # a target that predicts nothing: the batch contract's, defined once
from zoo.state import Resets


class LMBatch(NamedTuple):
    """One window of a language-modelling batch (batch-first).

    Attributes:
        inputs: ``(B, T)`` token ids.
        targets: ``(B, T)`` next-token ids; ``-100`` where nothing is predicted.
        reset: ``(B, T)`` bool or ``None``; ``True`` zeroes stream b's recurrent state before step t.
        resets: ``reset`` with where its resets fall, worked out on the host (:class:`zoo.state.Resets`), so that a
            step on a GPU never waits to learn it; the window builders add it (``datamodules.multisequence``). ``None``:
            the model works it out from ``reset``.
    """

    inputs: Tensor
    targets: Tensor
    reset: Tensor | None = None
    resets: Resets | None = None

    @property
    def model_reset(self) -> Resets | Tensor | None:
        """What a model's ``reset`` argument takes for this window: :attr:`resets` where the window builder made it,
        else the bare mask, else ``None``."""
        return self.resets if self.resets is not None else self.reset

    def on(self, device: torch.device | str) -> tuple[Tensor, Tensor, Resets | Tensor | None]:
        """``(inputs, targets, reset)`` on ``device``, as a model's ``token_nll`` / ``features`` take them
        (:attr:`model_reset`: an evaluation loop on a GPU then never waits to learn where the resets fall)."""
        reset = self.model_reset
        return self.inputs.to(device), self.targets.to(device), None if reset is None else reset.to(device)


def column_spans(num_pairs: int, num_columns: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each column: contiguous, covering ``range(num_pairs)``, lengths differing by <= 1."""
    base, extra = divmod(num_pairs, num_columns)
    spans, start = [], 0
    for column in range(num_columns):
        length = base + (column < extra)
        spans.append((start, length))
        start += length
    return spans


def sample_window_length(bptt: int, rng: np.random.Generator, max_delta: int = 20) -> int:
    """AWD-LSTM's variable BPTT (Merity et al. 2017 §4.1): ``bptt`` or ``bptt/2`` with p = 0.05, then N(·, 5), >= 5.

    The length is capped at ``bptt + max_delta`` as in the MoS code, so a window never gets far past the memory budget.
    """
    base = bptt if rng.random() < 0.95 else bptt / 2
    return int(min(bptt + max_delta, max(5, round(rng.normal(base, 5)))))


def training_position(trainer: Any, windows_per_step: int = 1) -> dict[str, int]:
    """Where the training stream of a checkpoint saved now must resume: ``{"epoch": e, "windows": n}``.

    ``n`` counts the windows of epoch ``e`` whose training step has run, from Lightning's own progress counters (what
    it restores to resume), so it is exact whatever the loader fetched ahead. Between epochs it is ``(next epoch, 0)``;
    after an epoch that training left early (:func:`epoch_cut_short`), the position inside that epoch.

    Args:
        trainer: the ``lightning.Trainer`` that is fitting.
        windows_per_step: the windows each of its steps trains on (the data module's ``windows_per_step``); past an
            epoch's last, shorter step the count is past its windows, which resumes at the next epoch's start.
    """
    epochs = trainer.fit_loop.epoch_progress.current
    if epochs.completed == epochs.ready and not epoch_cut_short(trainer):  # before the first epoch, or past one
        return {"epoch": epochs.completed, "windows": 0}
    steps = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return {"epoch": epochs.ready - 1, "windows": steps * windows_per_step}


def epoch_cut_short(trainer: Any) -> bool:
    """Whether the trainer's epoch has run its loop but stopped before its last step: training ended inside it
    (``max_steps``, ``max_time``, a callback's ``should_stop``).

    Lightning counts such an epoch as ended, and so would resume the run at the next one, the rest of this one never
    trained, and an epoch-counted schedule ahead. A checkpoint written now records the position inside it
    (:func:`training_position`) and counts the epoch as under way
    (``lightning_modules.stateful.StatefulTraining.on_save_checkpoint``), so that ``--ckpt_path`` carries on with it.
    """
    epochs = trainer.fit_loop.epoch_progress.current
    steps = trainer.fit_loop.epoch_loop.batch_progress
    if epochs.processed != epochs.ready or steps.current.ready == 0:  # inside an epoch's steps, or before the first
        return False
    # Lightning's own test of an epoch that reached its end (its epoch loop's _num_ready_batches_reached).
    return not (steps.is_last_batch or steps.current.ready >= trainer.num_training_batches)


class ResumableStream(IterableDataset):
    """The resuming protocol of every training stream (module docstring): a checkpoint holds the trained position
    ``{"epoch": e, "windows": n}`` and a resumed run reads epoch e from its window n on.

    A subclass calls :meth:`_init_epochs` in its constructor, implements :meth:`num_windows`, starts each iteration
    with ``epoch, skip = self._next_epoch()`` and calls ``self._yielded(epoch, index + 1)`` before yielding window
    ``index``.
    """

    def _init_epochs(self, epoch_source: Callable[[], int] | None) -> None:
        self.epoch = 0  # the epoch the next __iter__ reads, without an epoch source
        self._epoch_source = epoch_source
        self._resume: tuple[int, int] | None = None  # (epoch, windows of it trained before the run was interrupted)
        self._position = (0, 0)  # (epoch, windows yielded) of the epoch being read

    def num_windows(self, epoch: int) -> int:
        """Windows of ``epoch`` (deterministic, identical across ranks)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "windows": n}``: the epoch being read (before it starts: the next one) and the windows of it
        yielded so far."""
        epoch, windows = self._position
        return {"epoch": epoch, "windows": windows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next iterations read epoch ``state["epoch"]`` after its first ``state["windows"]`` windows (if that
        is the whole epoch: the next epoch from its start): until the epoch source is past it, or (without one) once."""
        epoch, windows = int(state["epoch"]), int(state["windows"])
        if windows >= self.num_windows(epoch):
            epoch, windows = epoch + 1, 0
        self.epoch, self._resume = epoch, (epoch, windows)
        self._position = (epoch, windows)

    def _current_epoch(self) -> int:
        return int(self._epoch_source()) if self._epoch_source is not None else self.epoch

    def _next_epoch(self) -> tuple[int, int]:
        """The epoch the next iteration reads and the windows of it to skip."""
        epoch = self._current_epoch()
        skip = 0
        if self._resume is not None:
            if self._epoch_source is None or epoch <= self._resume[0]:
                # Every iteration until the trainer is past the resumed epoch reads the resumed position: also one
                # Lightning starts before restoring its epoch counter (trainer.estimated_stepping_batches in a hook),
                # or one it starts, fetches a window from and drops.
                epoch, skip = self._resume
            if self._epoch_source is None or epoch > self._resume[0]:
                self._resume = None
        self.epoch = epoch + 1
        self._position = (epoch, skip)
        return epoch, skip

    def _yielded(self, epoch: int, windows: int) -> None:
        self._position = (epoch, windows)


class StreamWindows(ResumableStream):
    """Yields the :class:`LMBatch` windows of one split, in order, for one rank.

    Args:
        ids: the split's id stream ``(N,)`` (without the start token; ``start_id`` is prepended).
        batch_size: columns per rank (``B``).
        bptt: window length (the last window of an epoch may be shorter).
        start_id: the id that opens the stream (``<eos>``), so the first token has a context and is predicted.
        rank: this process's rank.
        world_size: number of ranks; the columns are split between them.
        variable_bptt: draw each window's length with :func:`sample_window_length` (training only).
        seed: seed of the variable lengths; epoch ``e`` uses ``(seed, e)``, the same on every rank.
        epoch: called when an iteration starts for the epoch it reads (the trainer's ``current_epoch``); ``None``:
            count the iterations.
        bptt_multiple: with ``variable_bptt``, round each drawn length to the nearest multiple of this (at least one
            multiple), and pad the epoch's last window up to one, its extra targets ignored (``-100``) and its extra
            inputs ``start_id``: a few window shapes instead of some thirty, so that a GPU replays a captured step
            for every window (:mod:`lightning_modules.training_step`). ``None``: AWD-LSTM's lengths as drawn.
    """

    def __init__(
        self,
        ids: Tensor | np.ndarray,
        batch_size: int,
        bptt: int,
        start_id: int,
        rank: int = 0,
        world_size: int = 1,
        variable_bptt: bool = False,
        seed: int = 0,
        epoch: Callable[[], int] | None = None,
        bptt_multiple: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1 or bptt < 1:
            raise ConfigError(f"batch_size and bptt must be >= 1, got {batch_size} and {bptt}")
        if bptt_multiple is not None and bptt_multiple < 1:
            raise ConfigError(f"bptt_multiple must be >= 1 (null: lengths as drawn), got {bptt_multiple}")
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))  # a writable int64 copy of a (memory-mapped) array
        stream = torch.cat([torch.tensor([start_id]), ids])  # (N + 1,)
        num_pairs = ids.numel()
        spans = column_spans(num_pairs, batch_size * world_size)[rank * batch_size : (rank + 1) * batch_size]
        self.column_length = math.ceil(num_pairs / (batch_size * world_size))  # same on every rank
        # Row b holds column b's inputs plus one more token: its last target.
        self.tokens = torch.full((batch_size, self.column_length + 1), start_id, dtype=torch.long)
        self.lengths = torch.tensor([length for _, length in spans])  # (B,)
        for row, (start, length) in enumerate(spans):
            self.tokens[row, : length + 1] = stream[start : start + length + 1]
        self.bptt, self.start_id = bptt, start_id
        self.variable_bptt = variable_bptt
        self.bptt_multiple = bptt_multiple if variable_bptt else None
        self.seed = seed
        self._init_epochs(epoch)

    @property
    def batch_size(self) -> int:
        """Columns (parallel streams) on this rank."""
        return self.tokens.size(0)

    @property
    def num_predicted(self) -> int:
        """Tokens this rank predicts per epoch."""
        return int(self.lengths.sum())

    def window_lengths(self, epoch: int) -> list[int]:
        """Lengths of the windows of ``epoch`` (deterministic, identical across ranks)."""
        if not self.variable_bptt:
            full, last = divmod(self.column_length, self.bptt)
            return [self.bptt] * full + ([last] if last else [])
        rng = np.random.default_rng([self.seed, epoch])
        lengths, total = [], 0
        while total < self.column_length:
            length = sample_window_length(self.bptt, rng)
            if self.bptt_multiple:
                length = self.bptt_multiple * max(1, round(length / self.bptt_multiple))
            length = min(length, self.column_length - total)
            lengths.append(length)
            total += length
        return lengths

    def __len__(self) -> int:
        if self.variable_bptt:
            raise TypeError("the number of windows varies per epoch with variable_bptt")
        return len(self.window_lengths(0))

    def num_windows(self, epoch: int) -> int:
        return len(self.window_lengths(epoch))

    def __iter__(self) -> Iterator[LMBatch]:
        epoch, skip = self._next_epoch()
        position = torch.arange(self.column_length).unsqueeze(0)  # (1, L)
        padding = position >= self.lengths.unsqueeze(1)  # (B, L): beyond this column's end
        lengths = self.window_lengths(epoch)
        start = sum(lengths[:skip])  # a resumed epoch starts after the windows trained before the interruption
        for index, length in enumerate(lengths[skip:], start=skip):
            inputs = self.tokens[:, start : start + length]
            targets = self.tokens[:, start + 1 : start + length + 1].masked_fill(
                padding[:, start : start + length], IGNORE_INDEX
            )
            short = -length % self.bptt_multiple if self.bptt_multiple else 0  # the epoch's last window, padded
            if short:
                inputs = torch.cat([inputs, inputs.new_full((inputs.size(0), short), self.start_id)], 1)
                targets = torch.cat([targets, targets.new_full((targets.size(0), short), IGNORE_INDEX)], 1)
            self._yielded(epoch, index + 1)
            yield LMBatch(inputs, targets, None)
            start += length
