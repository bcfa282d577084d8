"""A recurrent model of polyphonic music as a plain ``nn.Module``: piano-roll frames -> zoo stack -> 88 sigmoids.

::

    frames (B, T, 88) ──► input_dropout ──► stack ──► output_dropout ──► linear ──► logits (B, T, 88)

Each frame is a binary vector of the 88 piano notes sounding (:mod:`datamodules.music`). The model reads frame ``t``
and predicts frame ``t + 1`` with one Bernoulli per note, independent given the history: the output layer of
Boulanger-Lewandowski et al. 2012's RNN baseline, and the "sigmoid" of Jozefowicz et al. 2015 §3.5 ("we were required
to predict binary vectors so we used the sigmoid"). Their measure, the negative log-likelihood per time step, is the
sum over the notes of the binary cross-entropy (:func:`bernoulli_nll`), averaged over the frames.

Every zoo architecture drives it (``zoo.names()``): the frames go into the stack as they are, the input layer being the
cells' own input weights. Dropout (Jozefowicz et al.'s "N-dropout" rows) is Zaremba et al.'s, on the non-recurrent
connections: the input frames, between layers and before the output layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.architectures import build
from zoo.errors import ConfigError
from zoo.state import State

NUM_NOTES = 88  # piano keys A0 .. C8
LOWEST_NOTE = 21  # MIDI number of A0: column j of a frame is MIDI note 21 + j


def bernoulli_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """The negative log-likelihood of each frame under independent Bernoullis, in nats.

    ``-Σ_n [y_n log σ(z_n) + (1 - y_n) log(1 - σ(z_n))]`` over the notes ``n``, computed from the logits ``z`` in the
    stable form of ``binary_cross_entropy_with_logits``.

    Args:
        logits: ``(..., N)`` one logit per note.
        targets: ``(..., N)`` 0 or 1.

    Returns:
        ``(...)`` float32, one value per frame.
    """
    return F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none").sum(-1)


@dataclass
class PianoRollConfig:
    """Everything that describes a :class:`PianoRollLM`: the one place its settings are spelt.

    :class:`PianoRollLM` is built from one and keeps it as ``model.config``; :class:`lightning_modules.MusicModel`
    passes its arguments on to it (LightningCLI reads their types and defaults from these fields), and an export's
    ``config.json`` holds ``dataclasses.asdict(model.config)`` as its ``"model"``. The fields may be given by position
    in this order.

    Attributes:
        architecture: a zoo name (``lm-zoo models`` lists them).
        hidden_size: units per recurrent layer.
        num_layers: stacked recurrent layers.
        num_notes: frame width (88 piano keys).
        dropout: the default rate of ``input_dropout``, ``inter_layer_dropout`` and ``output_dropout``.
        input_dropout: on the input frames (default ``dropout``).
        inter_layer_dropout: between recurrent layers (default ``dropout``).
        output_dropout: on the last layer's output, before the note logits (default ``dropout``).
        init_range: if set, every weight starts Uniform(-r, r) (Jozefowicz et al. §3.7: ``r = scale / sqrt(units)``).
        cell_options: further options of the architecture and the stack (e.g. ``{"forget_bias": 1.0}`` for LSTM-b,
            ``state_dropout``, ``weight_drop``).
    """

    architecture: str = "lstm"
    hidden_size: int = 128
    num_layers: int = 1
    num_notes: int = NUM_NOTES
    dropout: float = 0.0
    input_dropout: float | None = None
    inter_layer_dropout: float | None = None
    output_dropout: float | None = None
    init_range: float | None = None
    cell_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # A copy, {} for None: an export records the options the model was built with, never the caller's dict.
        self.cell_options = dict(self.cell_options or {})


class PianoRollLM(nn.Module):
    """A recurrent next-frame model with a Bernoulli output per note.

    Args:
        *args: :class:`PianoRollConfig`'s fields by position, in its order.
        **settings: :class:`PianoRollConfig`'s fields by name (it documents them all).

    Raises:
        TypeError: a setting :class:`PianoRollConfig` does not have.
        ConfigError: a dropout rate outside [0, 1), or ``init_range`` among the cell's options.
    """

    def __init__(self, *args: Any, **settings: Any) -> None:
        super().__init__()
        # What an export's config.json stores to rebuild this model (dataclasses.asdict of it).
        self.config = config = PianoRollConfig(*args, **settings)
        cell_options = dict(config.cell_options)
        if "init_range" in cell_options:
            raise ConfigError("set init_range on the model, not in cell_options (it applies to every weight)")
        self.num_notes = num_notes = config.num_notes
        dropout = config.dropout
        self.input_dropout = dropout if config.input_dropout is None else config.input_dropout
        self.output_dropout = dropout if config.output_dropout is None else config.output_dropout
        inter_layer = dropout if config.inter_layer_dropout is None else config.inter_layer_dropout
        for name, rate in [
            ("dropout", dropout),
            ("input_dropout", self.input_dropout),
            ("inter_layer_dropout", inter_layer),
            ("output_dropout", self.output_dropout),
        ]:
            if not 0.0 <= rate < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {rate}")
        stack_options = {"dropout": inter_layer, **cell_options}
        init_range = config.init_range
        self.rnn = build(
            config.architecture,
            num_notes,
            config.hidden_size,
            config.num_layers,
            init_range=init_range,
            **stack_options,
        )
        self.decoder = nn.Linear(config.hidden_size, num_notes)
        if init_range is not None:
            nn.init.uniform_(self.decoder.weight, -init_range, init_range)
            nn.init.zeros_(self.decoder.bias)

    @classmethod
    def from_config(cls, config: PianoRollConfig) -> PianoRollLM:
        """The network ``config`` describes."""
        return cls(**asdict(config))

    def forward(self, frames: Tensor, state: State | None = None, reset: Tensor | None = None) -> tuple[Tensor, State]:
        """The logits of the next frame's notes.

        Args:
            frames: ``(B, T, N)`` the frames read, 0 or 1.
            state: the recurrent state after the previous window, or ``None`` (zeros).
            reset: ``(B, T)`` bool; zero stream b's state before step t.

        Returns:
            ``(logits (B, T, N), state)``: ``sigmoid(logits[b, t, n])`` is the probability that note n sounds in
            frame t + 1.
        """
        x = frames.to(self.decoder.weight.dtype)
        if self.training and self.input_dropout > 0:
            x = F.dropout(x, self.input_dropout, training=True)
        y, state = self.rnn(x, state, reset)  # (B, T, H)
        if self.training and self.output_dropout > 0:
            y = F.dropout(y, self.output_dropout, training=True)
        return self.decoder(y), state  # (B, T, N)

    def frame_nll(
        self, frames: Tensor, targets: Tensor, state: State | None = None, reset: Tensor | None = None
    ) -> tuple[Tensor, State]:
        """The negative log-likelihood of each target frame, in nats.

        Args:
            frames: ``(B, T, N)`` the frames read.
            targets: ``(B, T, N)`` the frames to predict.
            state: the state after the previous window, or ``None``.
            reset: ``(B, T)`` bool; zero stream b's state before step t.

        Returns:
            ``(nll (B, T) float32, state)``; the caller masks the steps that predict nothing.
        """
        logits, state = self(frames, state, reset)
        return bernoulli_nll(logits, targets), state

    def num_parameters(self) -> int:
        """Trainable numbers."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(
        self,
        num_frames: int,
        num_samples: int = 1,
        primer: Tensor | None = None,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Sample pieces frame by frame: each note of a frame drawn from its own Bernoulli, given the frames before.

        Args:
            num_frames: frames sampled per piece (after the primer).
            num_samples: pieces.
            primer: ``(P, N)`` frames to start from (e.g. the opening of a test piece), the same for every sample;
                ``None`` starts from silence, as every training piece does.
            temperature: divides the logits; below 1 keeps to the likelier notes.
            generator: for reproducible samples (a CPU generator: the draws are made on the CPU).

        Returns:
            ``(num_samples, num_frames, N)`` uint8, the sampled frames without the primer.
        """
        if temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        if num_frames < 1 or num_samples < 1:
            raise ConfigError(f"num_frames and num_samples must be at least 1, got {num_frames} and {num_samples}")
        device = self.decoder.weight.device
        silent = torch.zeros(num_samples, 1, self.num_notes, device=device)
        start = silent if primer is None else torch.cat([silent, primer.to(device).expand(num_samples, -1, -1)], 1)
        logits, state = self(start)  # the silent frame first: how every piece began in training
        frames = []
        for _ in range(num_frames):
            probabilities = torch.sigmoid(logits[:, -1].float() / temperature).cpu()  # (S, N)
            frame = torch.bernoulli(probabilities, generator=generator)  # (S, N)
            frames.append(frame)
            logits, state = self(frame.unsqueeze(1).to(device), state)
        return torch.stack(frames, 1).to(torch.uint8)  # (S, T, N)
