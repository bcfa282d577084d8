"""The training loop of a piano-roll model: a LightningModule around :class:`zoo.music.PianoRollLM`.

The same stateful truncated BPTT as :class:`~lightning_modules.language_model.LanguageModel` (the state carried from
window to window within each piece, zeroed where a piece starts, detached every window; exact resume and divergence
guards from :class:`~lightning_modules.stateful.StatefulTraining`), on :class:`~datamodules.music.FrameBatch` windows.

The loss is the negative log-likelihood per frame, summed over the 88 notes (Jozefowicz et al. 2015, Table 2's
measure), averaged over the predicted frames. Logged: ``{stage}_loss`` (nats per frame; ``val_loss`` is what
``best.ckpt`` keeps) and ``{stage}_nll_per_note`` (the same divided by 88).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from torch import Tensor

from datamodules.music import FrameBatch
from lightning_modules.language_model import copy_weights
from lightning_modules.stateful import StatefulTraining
from lightning_modules.training_step import TrainingObjective
from zoo.errors import ConfigError
from zoo.music import NUM_NOTES, PianoRollConfig, PianoRollLM
from zoo.state import detach_state

TRAINING_OPTIONS = ("divergence_threshold",)  # this module's own; every other argument is the network's


class MusicModel(StatefulTraining):
    """Trains a :class:`zoo.music.PianoRollLM` (``self.model``) on piano rolls.

    Args:
        vocab_size: the notes of a frame (88). The data module's ``vocab_size``, which LightningCLI links here as it
            does a text corpus's vocabulary; the network calls it ``num_notes``.
        divergence_threshold: stop training with one line when a window's mean loss exceeds this many nats per
            frame. ``None``: ten times a model that gives every note probability 1/2 (``10 x 88 ln 2``); ``0``: off.

    Every other argument is the network's, by name: the fields of :class:`zoo.music.PianoRollConfig`, which documents
    them.
    """

    # The network's settings arrive as **network and go to PianoRollConfig, one call that LightningCLI follows (as in
    # LanguageModel): their types and defaults are read from its fields, spelt once, in zoo/music.py.
    def __init__(
        self, *, vocab_size: int = NUM_NOTES, divergence_threshold: float | None = None, **network: Any
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # the arguments as given (LightningCLI gives every one)
        config = PianoRollConfig(num_notes=vocab_size, **network)  # TypeError for a setting the network lacks
        # and the network's settings left at their defaults: a .ckpt records every one.
        settings = {name: value for name, value in asdict(config).items() if name != "num_notes"}
        self.hparams.update({name: value for name, value in settings.items() if name not in self.hparams})
        if divergence_threshold is not None and divergence_threshold < 0:
            raise ConfigError(f"divergence_threshold must be >= 0 (0: off), got {divergence_threshold}")
        self.divergence_threshold = (
            10 * vocab_size * math.log(2) if divergence_threshold is None else divergence_threshold
        )
        self.model = PianoRollLM.from_config(config)

    @classmethod
    def from_network(cls, network: PianoRollLM, **overrides: Any) -> MusicModel:
        """A LightningModule around a trained piano-roll network, e.g. to fine-tune it on another dataset::

            module = MusicModel.from_network(checkpoints.load("nottingham-gru").model)

        Args:
            network: the network (:func:`checkpoints.from_pretrained` loads one); its weights are copied.
            overrides: constructor arguments to change (dropout rates, ...); the network's shape must stay that of
                its weights.

        Raises:
            ConfigError: ``network`` is not a piano-roll model, or the overrides change its weights' shapes.
        """
        if not isinstance(network, PianoRollLM):
            raise ConfigError(
                f"{type(network).__name__} is not a model of piano rolls (zoo.music.PianoRollLM): a language model "
                "trains in lightning_modules.LanguageModel"
            )
        settings = asdict(network.config)
        settings["vocab_size"] = settings.pop("num_notes")  # the module's name for it (LightningCLI links it)
        module = cls(**{**settings, **overrides})
        copy_weights(network, module.model)
        return module

    def forward(self, frames: Tensor, state: Any = None, reset: Tensor | None = None) -> tuple[Tensor, Any]:
        """Note logits ``(B, T, 88)`` and the state: :meth:`zoo.music.PianoRollLM.forward`."""
        return self.model(frames, state, reset)

    def window_nll(self, batch: FrameBatch, stage: str) -> tuple[Tensor, Tensor]:
        """Summed nats over the window's predicted frames, and how many there were."""
        state = self._state[stage]
        if state is not None and state[0].size(1) != batch.inputs.size(0):
            state = None  # a different number of streams: start afresh
        nll, state = self.model.frame_nll(batch.inputs, batch.targets, state, batch.reset)  # (B, T)
        self._state[stage] = detach_state(state)  # truncated BPTT
        mask = batch.mask.to(nll.dtype)
        return (nll * mask).sum(), batch.mask.sum()

    def training_objective(self, batch: FrameBatch, figures: bool = True) -> TrainingObjective:
        """Mean nats per predicted frame: the objective and the loss alike."""
        total, count = self.window_nll(batch, "train")
        loss = total / count.clamp(min=1)  # mean nats per predicted frame
        return TrainingObjective(loss, loss, count, batch.mask.numel())

    def log_epoch_figures(self, stage: str, loss: Tensor) -> None:
        """The same nats per frame divided by the 88 notes."""
        self.log(f"{stage}_nll_per_note", loss / self.model.num_notes, prog_bar=stage != "train")

    def generate(self, num_frames: int, *options: Any, **named: Any) -> Tensor:
        """Sample pieces: :meth:`zoo.music.PianoRollLM.generate`, which takes the options."""
        return self.model.generate(num_frames, *options, **named)
