"""The deterministic pass, ``lm-zoo evaluate``'s default scoring procedure: dropout off, every window scored once,
the state carried from window to window (Melis et al. 2020 §3.3)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from datamodules.windows import LMBatch
from evaluation.scoring import EvaluationSetup, Scorer, ScoringProcedure
from evaluation.temperature import plain_pass, total_nll
from zoo.language_model import RecurrentLM
from zoo.state import State, detach_state


@torch.no_grad()
def deterministic_nll(
    model: RecurrentLM, windows: Iterable[LMBatch], temperature: float = 1.0
) -> Iterator[tuple[Tensor, Tensor]]:
    """Each window's NLL ``(B, T)`` (dropout off, state carried between windows) and its targets."""
    device = next(model.parameters()).device
    state: State | None = None
    for batch in windows:
        inputs, targets, reset = batch.on(device)
        nll, state = model.token_nll(inputs, targets, state, reset, temperature)
        state = detach_state(state)
        yield nll, targets


class Deterministic(ScoringProcedure):
    """Dropout off: every window scored once, the default procedure."""

    method = "deterministic"

    def prepare(self, setup: EvaluationSetup) -> Scorer:
        def score(windows: Iterable[LMBatch], t: float) -> tuple[float, int]:
            return total_nll(deterministic_nll(setup.model, windows, t))

        return Scorer(score, setup.bptt, features=plain_pass(setup.model))
