"""The softmax temperature that minimises validation cross-entropy, found by a 1-D golden-section search.

The Mogrifier paper determines the optimal softmax temperature on the validation set (Melis et al. 2020 §3.3; LAMB's
``eval_softmax_temperature`` searches it on validation). The objective is well suited to golden-section search: with
``β = 1/T`` the mean NLL ``mean_t [logsumexp_v(β z_tv) - β z_t,y_t]`` is convex in β (log-sum-exp of linear functions
plus a linear term), and T ↦ 1/T is monotone, so it is unimodal in T on any interval. (For MC dropout's average of
tempered softmaxes unimodality is no longer guaranteed; in practice the curve stays smooth and single-dipped.)

Golden-section is written out here because scipy is not a dependency of lm-zoo, and its ~20 lines need no tuning:
the bracket shrinks by 0.618 per evaluation, so ``[0.5, 2]`` narrows to 0.01 in 13 evaluations.

The recurrent features do not depend on T, so one pass over the validation split is kept (:class:`FeatureCache`,
memory permitting) and only the head is re-run per trial temperature, through its own ``token_nll``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field

import torch
from torch import Tensor

from datamodules.windows import IGNORE_INDEX, LMBatch
from zoo.errors import ConfigError
from zoo.language_model import RecurrentLM
from zoo.state import State, detach_state

#: Bracket of the search (the issue's choice; LAMB searches [0.8, 1]).
TEMPERATURE_RANGE = (0.5, 2.0)
#: Width of the final bracket. The loss is flat at its minimum (quadratic): missing the optimum by 0.005 costs ~1e-5
#: nats, far below anything reported, while each halving of the tolerance costs 1.4 more passes over the head.
TEMPERATURE_TOLERANCE = 1e-2
#: Most bytes of features kept for the search; beyond this every trial temperature re-runs the pass.
CACHE_BYTES = 2 * 2**30

_INVERSE_GOLDEN = (math.sqrt(5) - 1) / 2  # 0.618...


@dataclass
class TemperatureSearch:
    """The outcome of :func:`golden_section_search`.

    Attributes:
        temperature: the best temperature evaluated.
        loss: the objective there.
        evaluations: every ``(temperature, loss)`` evaluated, in order.
    """

    temperature: float
    loss: float
    evaluations: list[tuple[float, float]] = field(default_factory=list)


def golden_section_search(
    objective: Callable[[float], float],
    low: float = TEMPERATURE_RANGE[0],
    high: float = TEMPERATURE_RANGE[1],
    tolerance: float = TEMPERATURE_TOLERANCE,
) -> TemperatureSearch:
    """Minimise a unimodal ``objective`` on ``[low, high]`` to a bracket narrower than ``tolerance``.

    Returns the best point evaluated (an optimum at an end of the range comes back within ``tolerance`` of it).
    """
    if not 0 < low < high:
        raise ConfigError(f"the temperature search needs 0 < low < high, got [{low}, {high}]")
    evaluations: list[tuple[float, float]] = []

    def f(x: float) -> float:
        value = objective(x)
        evaluations.append((x, value))
        return value

    a, b = low, high
    c, d = b - _INVERSE_GOLDEN * (b - a), a + _INVERSE_GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tolerance:
        if fc <= fd:  # the minimum is in [a, d]
            b, d, fd = d, c, fc
            c = b - _INVERSE_GOLDEN * (b - a)
            fc = f(c)
        else:  # the minimum is in [c, b]
            a, c, fc = c, d, fd
            d = a + _INVERSE_GOLDEN * (b - a)
            fd = f(d)
    best = min(evaluations, key=lambda point: point[1])
    return TemperatureSearch(best[0], best[1], evaluations)


@dataclass(frozen=True)
class FeaturePass:
    """How a procedure's pass over a split yields the head's inputs, and how one window's NLLs combine.

    Attributes:
        run: windows -> per window, ``[(features, targets)]`` per forward call and the window's targets ``(B, T)``.
        combine: the calls' NLLs concatenated, and the window's targets -> the window's NLL ``(B, T)`` in float64
            (MC dropout: the probability-space average of its replicas).
    """

    run: Callable[[Iterable[LMBatch]], Iterator[tuple[list[tuple[Tensor, Tensor]], Tensor]]]
    combine: Callable[[Tensor, Tensor], Tensor]


def plain_pass(model: RecurrentLM) -> FeaturePass:
    """The deterministic pass: dropout off, one call per window, state carried between windows."""

    def run(windows: Iterable[LMBatch]) -> Iterator[tuple[list[tuple[Tensor, Tensor]], Tensor]]:
        device = next(model.parameters()).device
        state: State | None = None
        for batch in windows:
            inputs, targets, reset = batch.on(device)
            features, state = model.features(inputs, state, reset)
            state = detach_state(state)
            yield [(features, targets)], targets

    return FeaturePass(run, lambda nll, targets: nll.double())


class FeatureCache:
    """One pass's head inputs and targets, scored at any temperature by the head's ``token_nll``.

    For MC dropout it keeps every replica's features (the masks of one seed), and the head must not sample dropout
    itself (MoS's ``dropoutl``): then scoring the cache at T equals re-running the seeded MC pass at T.
    """

    def __init__(self, model: RecurrentLM, combine: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.model = model
        self.combine = combine
        self.windows: list[tuple[list[tuple[Tensor, Tensor]], Tensor]] = []  # [(features, targets) per call], targets
        self.bytes = 0

    @torch.no_grad()
    def nll(self, temperature: float) -> Iterable[tuple[Tensor, Tensor]]:
        """Per window: the NLL ``(B, T)`` (float64) at ``temperature`` and the targets, as the pass would give."""
        head = self.model.decoder
        for calls, targets in self.windows:
            pieces = [head.token_nll(features, call_targets, temperature) for features, call_targets in calls]
            yield self.combine(torch.cat(pieces), targets), targets

    def loss(self, temperature: float) -> tuple[float, int]:
        """Summed nats and the number of predicted tokens at ``temperature``."""
        return total_nll(self.nll(temperature))


def total_nll(scored: Iterable[tuple[Tensor, Tensor]]) -> tuple[float, int]:
    """Sum per-window NLLs (float64) and count the predicted tokens."""
    nats, count = 0.0, 0
    for nll, targets in scored:
        nats += float(nll.double().sum())
        count += int((targets != IGNORE_INDEX).sum())
    return nats, count


@torch.no_grad()
def collect_features(
    model: RecurrentLM,
    windows: Iterable[LMBatch],
    max_bytes: int = CACHE_BYTES,
    feature_pass: FeaturePass | None = None,
) -> FeatureCache | None:
    """Run one pass (``feature_pass``, by default the deterministic one: :func:`plain_pass`) and keep its features;
    ``None`` if they would take more than ``max_bytes`` (predicted from the first window when the stream knows its
    length)."""
    feature_pass = feature_pass or plain_pass(model)
    cache = FeatureCache(model, feature_pass.combine)
    num_windows = len(windows) if hasattr(windows, "__len__") else None  # type: ignore[arg-type]
    with closing(feature_pass.run(windows)) as passes:  # closing: a pass cut short leaves sampled dropout at once
        for calls, targets in passes:
            cache.windows.append((calls, targets))
            cache.bytes += sum(f.numel() * f.element_size() for f, _ in calls)
            predicted = cache.bytes * num_windows if num_windows and len(cache.windows) == 1 else cache.bytes
            if predicted > max_bytes:
                return None
    return cache
