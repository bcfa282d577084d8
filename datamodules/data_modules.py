"""The Lightning data module every lm-zoo data module is: :class:`~datamodules.stream_data.StreamData` (the streams,
their hooks and loaders) with ``LightningDataModule``, which LightningCLI and the Trainer take; and the one for text
corpora, :class:`~datamodules.text_data.TextData` on it (the others, GBW, music, reverse-copy, sit with their data)."""

from __future__ import annotations

from typing import Any

import lightning as L

from datamodules.stream_data import StreamData
from datamodules.text_data import TextData


class StreamDataModule(StreamData, L.LightningDataModule):
    """The Lightning side of a corpus read as ordered streams: :class:`StreamData`'s hooks, on a LightningDataModule.

    With a ``Trainer`` of your own (not ``lm-zoo fit``, which sets it), pass ``reload_dataloaders_every_n_epochs=1``:
    an epoch's number of windows can change from one epoch to the next (shuffled sentences or examples packed into
    columns, variable BPTT), and Lightning, which reads a loader's length once, would otherwise skip the validation
    of an epoch one window shorter than the first and validate a longer one before its end.
    """

    def _save_settings(self, frame: Any) -> None:
        # The settings go into every checkpoint (``datamodule_hyper_parameters``), which exports read back.
        self.save_hyperparameters(frame=frame)


class TextDataModule(TextData, StreamDataModule):
    """:class:`~datamodules.text_data.TextData` as a LightningDataModule: what configs name (``class_path:
    datamodules.TextDataModule``) and LightningCLI builds; its arguments are :class:`TextData`'s."""
