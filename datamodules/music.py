"""Polyphonic music as piano rolls: the four datasets of Boulanger-Lewandowski, Bengio & Vincent 2012, which
Jozefowicz et al. 2015 (§3.5, Table 2) use to test every architecture outside language.

A piece is a sequence of frames; a frame is the set of the 88 piano notes (MIDI 21-108, A0 to C8) sounding in one time
step (an eighth note; a quarter note for JSB Chorales), stored as a binary vector. A model predicts each frame from
the ones before it with one sigmoid per note (:mod:`zoo.music`), and the measure is the negative log-likelihood per
frame, summed over the 88 notes.

Every piece starts from the zero state, and every one of its frames is predicted: the first from a silent input frame,
as Boulanger-Lewandowski et al. score whole sequences. (Code that feeds ``piece[:-1]`` to predict ``piece[1:]``, such
as TCN's ``poly_music``, leaves each first frame out, which changes the figure slightly.) A piece of ``T`` frames is
therefore stored as ``T + 1`` rows, a silent row first, and read exactly as :mod:`datamodules.multisequence` reads a
sentence ``<S> w1 .. wn``: the silent row is the ``<S>``, the last frame is the ``</S>`` whose step predicts nothing::

    piece [f1 f2 f3]   rows   0  f1 f2 f3       inputs   0  f1 f2 | ...     reset  1 0 0
                                                 targets f1 f2 f3 | ...     mask   1 1 1

Batching is the paper's: ``B = 20`` pieces side by side, unrolled 35 frames at a time, "moving the minibatch
sequentially through the sequence" with the state carried between windows and zeroed where a piece starts
(:class:`~datamodules.multisequence.MultiSequenceWindows`, which also shuffles the pieces every training epoch and
resumes mid-epoch). The windows carry row indices; :class:`MusicWindows` turns them into frames.

The datasets themselves (sources, checksums, the ``.mat`` reader) are :mod:`datamodules.piano_rolls`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from datamodules.corpora import ensure_files
from datamodules.data_modules import StreamDataModule
from datamodules.multisequence import EpochLayout, MultiSequenceWindows
from datamodules.piano_rolls import PianoRolls, music_dataset, read_pieces
from datamodules.stream_data import check_sizes
from datamodules.windows import training_position
from zoo.music import LOWEST_NOTE, NUM_NOTES


class FrameBatch(NamedTuple):
    """One window of piano-roll frames (batch-first).

    Attributes:
        inputs: ``(B, T, 88)`` float frames (a silent frame where a piece starts).
        targets: ``(B, T, 88)`` float next frames (0 where ``mask`` is False).
        mask: ``(B, T)`` bool; True where a frame is predicted.
        reset: ``(B, T)`` bool; True zeroes stream b's recurrent state before step t.
    """

    inputs: Tensor
    targets: Tensor
    mask: Tensor
    reset: Tensor


class MusicWindows(MultiSequenceWindows):
    """The :class:`FrameBatch` windows of one split for one rank: multi-sequence windows of row indices, gathered.

    Args:
        rolls: the split.
        batch_size, bptt, shuffle, seed, rank, world_size, epoch: as
            :class:`~datamodules.multisequence.MultiSequenceWindows`.
    """

    def __init__(self, rolls: PianoRolls, batch_size: int, bptt: int, **options: Any) -> None:
        indices = np.arange(len(rolls.rows), dtype=np.int64)
        # Padding reads row 0, a silent row, and predicts nothing.
        super().__init__(indices, rolls.offsets, batch_size, bptt, pad_id=0, **options)
        self.rows = torch.from_numpy(rolls.rows)  # (N + P, 88) uint8

    @property
    def num_predicted(self) -> int:
        """Frames predicted per epoch over all ranks."""
        return len(self.rows) - self.num_sentences

    def window(self, layout: EpochLayout, index: int) -> FrameBatch:  # type: ignore[override]
        rows = super().window(layout, index)  # LMBatch of row indices, target -100 where nothing is predicted
        mask = rows.targets >= 0  # (B, T)
        inputs = self.rows[rows.inputs].float()  # (B, T, 88)
        targets = self.rows[rows.targets.clamp(min=0)].float() * mask.unsqueeze(-1)  # (B, T, 88)
        return FrameBatch(inputs, targets, mask, rows.reset)


class MusicDataModule(StreamDataModule):
    """A piano-roll dataset as :class:`FrameBatch` windows for stateful truncated BPTT.

    Args:
        dataset: ``jsb-chorales``, ``musedata``, ``nottingham`` or ``piano-midi``.
        batch_size: pieces read side by side in training (Jozefowicz et al.: 20).
        bptt: frames per window (Jozefowicz et al.: 35).
        eval_batch_size: pieces side by side in evaluation (default ``batch_size``). Every piece starts from the zero
            state, so the figures do not depend on it.
        eval_bptt: frames per evaluation window (default ``bptt``); no effect on the figures either.
        data_root: where datasets live (default ``$LM_ZOO_DATA``); the file is ``<root>/music/<Name>.mat``.
        seed: seeds the order of the pieces in each training epoch.
        download: fetch a missing file from its canonical URL (checked by sha256).
        windows_per_step: consecutive training windows a step trains on, one update each (as
            :class:`~datamodules.text_data.TextData`'s).
    """

    level = "music"

    def __init__(
        self,
        dataset: str = "nottingham",
        batch_size: int = 20,
        bptt: int = 35,
        eval_batch_size: int | None = None,
        eval_bptt: int | None = None,
        data_root: str | None = None,
        seed: int = 0,
        download: bool = True,
        windows_per_step: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # a checkpoint records them: evaluation and sampling rebuild the data from them
        self.spec = music_dataset(dataset)
        check_sizes(batch_size=batch_size, bptt=bptt, eval_batch_size=eval_batch_size, eval_bptt=eval_bptt)
        self.dataset = dataset
        self.batch_size = batch_size
        self.bptt = bptt
        self.eval_batch_size = eval_batch_size or batch_size
        self.eval_bptt = eval_bptt or bptt
        self.data_root = data_root
        self.seed = seed
        self.download = download
        self.windows_per_step = windows_per_step
        self._rolls: dict[str, PianoRolls] = {}

    @property
    def vocab_size(self) -> int:
        """The notes of a frame: the model's output width (LightningCLI links it to the model's ``num_notes``)."""
        return NUM_NOTES

    def path(self) -> Path:
        """The dataset's ``.mat`` file, downloaded and checked if need be."""
        return ensure_files(self.spec, self.data_root, self.download) / self.spec.file_name

    def encoded(self, split: str) -> PianoRolls:
        if split not in self._rolls:
            self._rolls[split] = PianoRolls.from_pieces(read_pieces(self.path(), split))
        return self._rolls[split]

    def stream(self, split: str, batch_size: int | None = None, bptt: int | None = None) -> MusicWindows:
        return MusicWindows(self.encoded(split), **self._window_settings(split, batch_size, bptt))

    def state_dict(self) -> dict[str, Any]:
        """Stored in every checkpoint: which dataset (so evaluation and sampling find it), the frame layout, and during
        ``fit`` the training position."""
        state: dict[str, Any] = {"music": {"dataset": self.dataset, "num_notes": NUM_NOTES, "lowest_note": LOWEST_NOTE}}
        if self.trainer is not None:
            state["train_position"] = training_position(self.trainer, self.windows_per_step)
        return state
