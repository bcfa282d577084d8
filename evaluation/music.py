"""Scoring a piano-roll model: the negative log-likelihood per frame of a split (Jozefowicz et al. 2015, Table 2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from datamodules.progress import Progress
from evaluation.results import MusicResult
from zoo.errors import ConfigError
from zoo.music import PianoRollLM

if TYPE_CHECKING:  # a music model's data module is a LightningDataModule: imported by whoever builds one
    from datamodules.music import MusicDataModule


@torch.no_grad()
def evaluate_music(
    model: PianoRollLM,
    datamodule: MusicDataModule,
    split: str = "test",
    batch_size: int | None = None,
    bptt: int | None = None,
    device: str | torch.device = "cpu",
    max_tokens: int | None = None,
) -> MusicResult:
    """The negative log-likelihood per frame of a split (Jozefowicz et al. 2015, Table 2), every piece from zero state.

    Args:
        model: the network.
        datamodule: its dataset.
        split: ``train``, ``valid`` or ``test``.
        batch_size: pieces side by side (default: the data module's evaluation batch); it does not change the figure.
        bptt: frames per window (default: the data module's); it does not change the figure either.
        device: where to run.
        max_tokens: score only up to the window holding the this-many-th frame (a fixed part of the split, quick to
            re-measure: a registered model's check figure); ``None``: the whole split.

    Returns:
        The NLL per frame (nats, summed over the notes) and per note, the frames read and the split's pieces, the eval
        batch size and BPTT, and ``max_tokens`` when only a part was scored.

    Raises:
        ConfigError: ``max_tokens`` below 1.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {max_tokens}")
    batch_size, bptt = batch_size or datamodule.eval_batch_size, bptt or datamodule.eval_bptt
    model.eval().to(device)
    stream = datamodule.stream(split, batch_size=batch_size, bptt=bptt)
    total = torch.zeros((), dtype=torch.float64, device=device)
    frames = 0
    state = None
    for batch in Progress(stream, split):
        if max_tokens is not None and frames >= max_tokens:
            break
        mask = batch.mask.to(device)
        nll, state = model.frame_nll(batch.inputs.to(device), batch.targets.to(device), state, batch.reset.to(device))
        total += (nll.double() * mask).sum()
        frames += int(batch.mask.sum())
    nll_per_step = float(total) / max(frames, 1)
    return MusicResult(
        split=split,
        dataset=datamodule.dataset,
        nll_per_step=nll_per_step,
        nll_per_note=nll_per_step / model.num_notes,
        frames=frames,
        pieces=datamodule.encoded(split).num_pieces,
        eval_batch_size=batch_size,
        bptt=bptt,
        max_tokens=max_tokens,
    )
