"""What every lm-zoo data module shares, without Lightning: ordered window streams for stateful truncated BPTT, one
per rank, whose training position survives a checkpoint.

A subclass provides ``tokenizer``, ``encoded(split)`` (prepares a split, cached on disk) and ``stream(split,
batch_size, bptt)`` (the split's windows for this rank); this base turns them into the hooks and loaders a
``LightningDataModule`` has. :class:`StreamData` is that class without Lightning, so that scoring a trained model
(``lm-zoo evaluate``, ``score``) reads its corpus without importing Lightning, which costs more than the scoring of a
small model; :class:`datamodules.data_modules.StreamDataModule` adds ``LightningDataModule`` for training.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from datamodules.corpora import SPLITS
from datamodules.tokenizers import Tokenizer
from datamodules.windows import training_position
from zoo.errors import ConfigError, DataError

STAGE_SPLITS = {"fit": ("train", "valid"), "validate": ("valid",), "test": ("test",)}


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write through a temp file beside ``path`` and rename, so a killed run never leaves a half-written cache entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_sizes(**sizes: int | None) -> None:
    """Refuse a batch size or BPTT below 1 (``None`` stands for a default) when a data module is made: found only when
    its first loader is built, the bad size would come after a fit has announced its devices and batch.

    Raises:
        ConfigError: naming the first size below 1.
    """
    for name, value in sizes.items():
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")


def cache_key(*parts: Any) -> str:
    """A short, stable name for a cache entry derived from JSON-serialisable ``parts``."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


class StreamData:
    """A corpus read as ordered streams (see :mod:`datamodules.windows`), with a LightningDataModule's hooks."""

    tokenizer: Any
    batch_size: int  # the subclass's sizes and seed, which _window_settings reads
    eval_batch_size: int
    bptt: int
    eval_bptt: int
    seed: int
    _windows_per_step = 1

    trainer: Any = None  # the Lightning Trainer, once StreamDataModule is attached to one

    def __init__(self) -> None:
        super().__init__()
        self._train_position: dict[str, int] | None = None  # from a checkpoint, for the next train_dataloader()

    @property
    def windows_per_step(self) -> int:
        """The training windows a Lightning step trains on, each with an update of its own (the subclasses'
        argument; :func:`group_windows`): 1 unless a subclass sets it."""
        return self._windows_per_step

    @windows_per_step.setter
    def windows_per_step(self, value: int) -> None:
        check_sizes(windows_per_step=value)  # when the data module is made, as its other sizes
        self._windows_per_step = value

    def _save_settings(self, frame: Any) -> None:
        """Record the constructor's arguments (``frame``: the subclass's ``__init__``): LightningDataModule's
        ``save_hyperparameters`` in :class:`~datamodules.data_modules.StreamDataModule`; nothing to record without
        it."""

    def encoded(self, split: str) -> Any:
        """Prepare ``split`` (tokenise into the cache, or map it back from there)."""
        raise NotImplementedError

    def stream(self, split: str, batch_size: int | None = None, bptt: int | None = None) -> IterableDataset:
        """The windows of ``split`` for this rank (evaluation sizes unless it is the training split)."""
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Fill the caches (runs once per node before ``setup``)."""
        for split in SPLITS:
            self.encoded(split)

    def setup(self, stage: str | None = None) -> None:
        for split in STAGE_SPLITS.get(stage or "", SPLITS):
            self.encoded(split)

    def _window_settings(self, split: str, batch_size: int | None, bptt: int | None) -> dict[str, Any]:
        """What a multi-sequence stream of ``split`` takes besides its data
        (:class:`~datamodules.multisequence.MultiSequenceWindows`): the training sizes or the evaluation ones unless
        given, a new order every training epoch (fixed otherwise), and this rank's share."""
        training = split == "train"
        rank, world_size = self._rank_world()
        return {
            "batch_size": batch_size or (self.batch_size if training else self.eval_batch_size),
            "bptt": bptt or (self.bptt if training else self.eval_bptt),
            "shuffle": training,
            "seed": self.seed,
            "rank": rank,
            "world_size": world_size,
            "epoch": self._training_epoch(split),
        }

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _training_epoch(self, split: str) -> Any:
        """The trainer's epoch as the training stream's epoch source, so a resumed run reads the epochs (orders,
        variable lengths) it would have read; ``None`` for evaluation streams and outside a trainer."""
        trainer = self.trainer
        return (lambda: trainer.current_epoch) if split == "train" and trainer is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Stored in every checkpoint: the tokenizer, so a model is always used with its own vocabulary, and during
        ``fit`` the training stream's position, so a resumed run continues mid-epoch where it stopped."""
        state: dict[str, Any] = {"tokenizer": self.tokenizer.state_dict()}
        if self.trainer is not None:
            state["train_position"] = training_position(self.trainer, self.windows_per_step)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Use the checkpoint's tokenizer (:meth:`use_tokenizer`) and keep its stream position for the next training
        loader."""
        if "tokenizer" in state_dict:
            self.use_tokenizer(Tokenizer.from_state_dict(state_dict["tokenizer"]))
        self._train_position = state_dict.get("train_position")

    def use_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Encode the splits with ``tokenizer`` (a checkpoint's or a loaded model's own) instead of building one from
        the training split; the object itself is kept, not a copy.

        Raises:
            DataError: this data cannot be read with that tokenizer.
        """
        raise DataError(f"{type(self).__name__} reads no tokens: it cannot use a {tokenizer.kind!r} tokenizer")

    def _loader(self, split: str) -> DataLoader:
        # batch_size=None: the dataset yields whole windows; one process keeps the columns in order. A generator of its
        # own, or iterating the loader draws a seed from the global RNG (a resumed run would get other dropout masks).
        return DataLoader(self.stream(split), batch_size=None, num_workers=0, generator=torch.Generator())

    def train_dataloader(self) -> DataLoader:
        loader = ResumableLoader(
            self.stream("train"), num_workers=0, generator=torch.Generator(), **group_windows(self.windows_per_step)
        )
        if self._train_position is not None:  # resuming: continue the interrupted epoch where its training stopped
            # Kept for every loader made while the trainer is still in that epoch: Lightning makes the loader again
            # when it restores its epoch counter (lm-zoo fit reloads loaders every epoch, cli.py). The stream reads
            # the position only until the trainer's epoch is past it.
            loader.dataset.load_state_dict(self._train_position)
            trainer = self.trainer
            if trainer is None or trainer.current_epoch > self._train_position["epoch"]:
                self._train_position = None
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


def group_windows(windows_per_step: int) -> dict[str, Any]:
    """The training loader's batching: each window a batch of its own (``batch_size=None``: the stream yields whole
    windows), or ``windows_per_step`` consecutive windows of an epoch as one batch, a ``list`` of them (the epoch's
    last one shorter where they do not divide its windows), which lm-zoo's training step trains one after another
    (:mod:`lightning_modules.training_step`)."""
    if windows_per_step == 1:
        return {"batch_size": None}
    return {"batch_size": windows_per_step, "collate_fn": list}


class ResumableLoader(DataLoader):
    """The training loader, which says it can resume mid-epoch, because it can.

    Lightning warns that a run resumed mid-epoch "is not resumable ... unreliable results" unless each loader has
    ``state_dict`` / ``load_state_dict``. lm-zoo resumes the stream's position through the data module's state (it
    travels with the tokenizer in every checkpoint, :meth:`StreamData.state_dict`, and is restored when the loader
    is made), so the loader's own state is empty and nothing is restored twice.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
