"""Which evaluation scores a model: its kind's. A text model is scored by :func:`evaluation.perplexity.evaluate`
(deterministic, or a procedure: temperature, MC dropout, dynamic evaluation), a music model by
:func:`evaluation.music.evaluate_music` (NLL per frame), which takes no procedure (``lm-zoo evaluate`` refuses one
first: :meth:`datamodules.kinds.ModelKind.refuse`). ``lm-zoo evaluate`` and an export's model card both score here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from datamodules.kinds import MUSIC, ModelKind
from evaluation.music import evaluate_music
from evaluation.perplexity import evaluate
from evaluation.results import EvaluationResult

if TYPE_CHECKING:
    from datamodules.stream_data import StreamData


def score_split(
    network: Any,
    kind: ModelKind,
    datamodule: StreamData,
    split: str,
    batch_size: int | None = None,
    bptt: int | None = None,
    device: str = "cpu",
    max_tokens: int | None = None,
    **procedure: Any,
) -> EvaluationResult:
    """Score one split of ``datamodule`` with ``network``, a model of ``kind``, as its kind is scored (the module's
    docstring); ``procedure``: a text model's procedure settings, the keyword arguments of
    :func:`evaluation.perplexity.evaluate`; ``max_tokens``: only the windows up to the one holding the split's
    this-many-th token (or frame)."""
    sizes = (split, batch_size, bptt, device)
    if kind is MUSIC:
        return evaluate_music(network, datamodule, *sizes, max_tokens=max_tokens)  # type: ignore[arg-type]
    return evaluate(network, datamodule, *sizes, max_tokens=max_tokens, **procedure)  # type: ignore[arg-type]
