"""Monte-Carlo dropout evaluation: predictions averaged over sampled dropout masks, in probability space.

Gal & Ghahramani 2016 (arXiv:1506.02142); Melis et al. 2018, "Pushing the bounds of dropout" (arXiv:1805.09208), whose
evaluation code (deepmind/lamb ``eval_method=arithmetic``, ``num_eval_samples``, ``eval_dropout_multiplier``) the
Mogrifier paper uses with 200 samples (Melis et al. 2020 §3.3)::

    p(x_t | x_<t) ≈ 1/N Σ_n p(x_t | x_<t; mask_n)      nll_t = -logsumexp_n(log p_n) + log N

and "all dropout probabilities used for training are multiplied by" ``dropout_scale`` at evaluation (LAMB's
``eval_dropout_multiplier``).

Batched: each of the B streams is replicated N times along the batch dimension (row ``n * B + b`` is replica n of
stream b), so the N masks cost one pass over ``B * N`` rows instead of N passes; every replica carries its own
recurrent state and draws fresh masks every window, exactly as a training stream does. Rows are cut into calls of at
most ``rows_per_call`` (``--mc-batch``) to bound memory.

Two masks are drawn once per call for *all* rows in training, not per row: AWD-LSTM's word-level embedding dropout
(one ``(V,)`` mask) and DropConnect ``weight_drop`` (one mask per recurrent matrix). Replicas that shared them would
be one sample, not N. So :func:`sampled_dropout` draws the embedding mask per row instead (same distribution for each
row), and a model with ``weight_drop`` runs one replica of each stream per call (per-row weight masks would need a
``(rows, 4H, H)`` copy of every recurrent matrix): still batched over the B streams, but N calls per window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from datamodules.windows import IGNORE_INDEX, LMBatch
from evaluation.scoring import EvaluationSetup, Flag, Scorer, ScoringProcedure
from evaluation.temperature import FeaturePass, total_nll
from zoo.errors import ConfigError
from zoo.heads import MixtureOfSoftmaxes
from zoo.language_model import RecurrentLM
from zoo.stack import RecurrentStack
from zoo.state import Resets, State, detach_state

#: Every dropout rate in the model, by the module that holds it; these modules switch their dropout on with
#: ``self.training``. (tests/test_evaluation_procedures.py checks that no module has a ``*drop*`` rate missing here.)
DROPOUT_RATES: dict[type[nn.Module], tuple[str, ...]] = {
    RecurrentLM: ("embedding_dropout", "input_dropout", "output_dropout"),
    RecurrentStack: ("dropout", "state_dropout", "weight_drop"),
    MixtureOfSoftmaxes: ("dropout",),
    nn.modules.dropout._DropoutNd: ("p",),  # any nn.Dropout a cell may use
    nn.RNNBase: ("dropout",),  # between the layers of a multi-layer nn.LSTM/GRU/RNN (the zoo's have one layer each)
}

#: Rows per forward call when ``--mc-batch`` is not given: 1024 rows of a 2 x 650 LSTM over a 70-step window hold
#: about 1 GB of activations; the softmax is scored in vocabulary slices by the head, so V does not enter.
DEFAULT_ROWS_PER_CALL = 1024


@dataclass(frozen=True)
class MCDropout(ScoringProcedure):
    """MC-dropout evaluation, a scoring procedure: its settings, flags and scorer.

    Attributes:
        samples: N, the dropout masks averaged per token (the Mogrifier paper: 200).
        dropout_scale: every dropout rate is multiplied by this while sampling (Melis et al. 2018; 1: as trained,
            0: no dropout, i.e. the deterministic model).
        rows_per_call: most rows (stream replicas) per forward call; ``None``: :data:`DEFAULT_ROWS_PER_CALL`.
    """

    samples: int = 200
    dropout_scale: float = 1.0
    rows_per_call: int | None = None

    method: ClassVar[str] = "mc-dropout"
    flag: ClassVar[str | None] = "--mc-samples"
    flags: ClassVar[tuple[Flag, ...]] = (
        Flag(
            "--mc-samples",
            "MC dropout: average the predictions of N sampled dropout masks in probability space (paper: 200)",
            "samples",
            int,
            1,
            "N",
        ),
        Flag(
            "--dropout-scale",
            "MC dropout: every dropout rate times F while sampling (Melis et al. 2018; default 1)",
            "dropout_scale",
            float,
            0,
            "F",
        ),
        Flag(
            "--mc-batch",
            f"MC dropout: most stream replicas (streams x samples) per forward call (default {DEFAULT_ROWS_PER_CALL})",
            "rows_per_call",
            int,
            1,
            "ROWS",
        ),
    )
    needs_float_weights: ClassVar[str | None] = "needs dropout"
    records: ClassVar[tuple[str, ...]] = ("mc_samples", "dropout_scale")
    run_records: ClassVar[tuple[str, ...]] = ("mc_rows_per_call",)  # the batching: the same figure either way

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ConfigError(f"MC dropout needs at least 1 sample, got {self.samples}")
        if not (self.dropout_scale >= 0 and math.isfinite(self.dropout_scale)):
            raise ConfigError(f"the dropout scale must be a number >= 0, got {self.dropout_scale}")
        if self.rows_per_call is not None and self.rows_per_call < 1:
            raise ConfigError(f"rows per call (--mc-batch) must be at least 1, got {self.rows_per_call}")

    @classmethod
    def summary(cls, record: Mapping[str, Any]) -> list[str]:
        return [f"{record['mc_samples']} samples, dropout scale {record['dropout_scale']}"]

    @classmethod
    def details(cls, record: Mapping[str, Any], seed: int) -> list[str]:
        return [f"MC dropout {record['mc_samples']} samples, dropout scale {record['dropout_scale']:g}, seed {seed}"]

    def prepare(self, setup: EvaluationSetup) -> Scorer:
        """Masks sampled per replica and window, reproducible per ``seed``; the temperature search keeps the features
        unless the head samples dropout of its own."""

        model, seed, batch_size = setup.model, setup.seed, setup.batch_size

        def score(windows: Iterable[LMBatch], t: float) -> tuple[float, int]:
            return total_nll(mc_nll(model, windows, self, t, seed))

        streams = batch_size
        if batch_size > 1:  # as many as the split's stream holds
            streams = setup.datamodule.stream(setup.split, batch_size=batch_size, bptt=setup.bptt).batch_size
        per_replica = self.dropout_scale > 0 and shares_masks_across_rows(model)
        groups = row_groups(streams, self.samples, self.rows_per_call or DEFAULT_ROWS_PER_CALL, per_replica)
        cacheable = self.dropout_scale == 0 or not head_is_stochastic(model)
        return Scorer(
            score,
            setup.bptt,
            features=self.feature_pass(model, seed) if cacheable else None,
            record={"mc_samples": self.samples, "dropout_scale": self.dropout_scale},
            run_record={"mc_rows_per_call": max(hi - lo for lo, hi in groups)},
        )

    def feature_pass(self, model: RecurrentLM, seed: int) -> FeaturePass:
        """The seeded MC pass's head inputs, every replica's, averaged in probability space once scored."""

        def call(rows: LMBatch, state: State | None) -> tuple[Tensor, State]:
            return model.features(rows.inputs, state, rows.model_reset)

        def run(windows: Iterable[LMBatch]) -> Iterator[tuple[list[tuple[Tensor, Tensor]], Tensor]]:
            with closing(replica_windows(model, windows, self, seed, call)) as passes:  # leave sampled dropout now
                for outputs, targets in passes:
                    yield [(features, rows.targets) for rows, features in outputs], targets

        def combine(nll: Tensor, targets: Tensor) -> Tensor:
            return log_mean_exp_nll(nll.view(self.samples, *targets.shape), targets)

        return FeaturePass(run, combine)


def _rate_names(module: nn.Module) -> tuple[str, ...]:
    return tuple(name for kind, names in DROPOUT_RATES.items() if isinstance(module, kind) for name in names)


def head_is_stochastic(model: RecurrentLM) -> bool:
    """Whether the output head itself samples dropout when MC dropout is on (MoS's ``dropoutl``)."""
    return any(float(getattr(m, name)) > 0 for m in model.decoder.modules() for name in _rate_names(m))


@contextmanager
def sampled_dropout(model: RecurrentLM, scale: float = 1.0) -> Iterator[None]:
    """Inside: every dropout of ``model`` is sampled at ``scale`` x its rate; everything else stays deterministic.

    Only the modules that hold a dropout rate (:data:`DROPOUT_RATES`) are put in training mode, not their children, so
    e.g. a cell's training-only loss terms stay off. Word-level embedding dropout is drawn per row (see the module
    docstring). On exit the modes and rates are restored exactly, also after an error.

    Raises:
        ConfigError: a scaled rate would reach 1.
    """
    modes = {module: module.training for module in model.modules()}
    changed: list[tuple[nn.Module, str, float]] = []
    hook = None
    try:
        for module in model.modules():
            names = _rate_names(module)
            for name in names:
                rate = getattr(module, name)
                if rate * scale >= 1:
                    raise ConfigError(
                        f"dropout scale {scale} makes {type(module).__name__}.{name} = {rate} x {scale} >= 1: "
                        "use a smaller --dropout-scale"
                    )
                changed.append((module, name, rate))
                setattr(module, name, rate * scale)
            if names:
                module.training = True
        word_rate = model.embedding_dropout
        if word_rate > 0:
            model.embedding_dropout = 0.0  # RecurrentLM.run would draw one (V,) mask for all rows
            hook = model.embedding.register_forward_hook(_per_row_word_dropout(word_rate, model.vocab_size))
        yield
    finally:
        if hook is not None:
            hook.remove()
        for module, name, rate in reversed(changed):
            setattr(module, name, rate)
        for module, training in modes.items():
            module.training = training


def _per_row_word_dropout(p: float, vocab_size: int) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], Tensor]:
    """Whole-word dropout (Merity et al. 2017 §4.3) with one mask per row: every occurrence of a word type in a row
    shares its draw, rows draw independently. Only the (row, word) pairs that occur are drawn."""

    def hook(module: nn.Module, args: tuple[Tensor, ...], embedded: Tensor) -> Tensor:
        ids = args[0]  # (R, T)
        rows = torch.arange(ids.size(0), device=ids.device).unsqueeze(1)  # (R, 1)
        pairs, which = torch.unique(rows * vocab_size + ids, return_inverse=True)  # distinct (row, word) keys
        keep = torch.bernoulli(embedded.new_full(pairs.shape, 1 - p)) / (1 - p)
        return embedded * keep[which].unsqueeze(-1)  # (R, T, E)

    return hook


def shares_masks_across_rows(model: RecurrentLM) -> bool:
    """Whether a forward call draws a mask shared by all its rows that cannot be made per-row (DropConnect)."""
    return any(
        isinstance(m, RecurrentStack) and m.weight_drop > 0 and any(layer.recurrent_weights for layer in m.layers)
        for m in model.modules()
    )


def row_groups(streams: int, samples: int, rows_per_call: int, per_replica: bool) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges of the forward calls over ``streams * samples`` replicated rows.

    ``per_replica``: no call holds two replicas of one stream (for masks shared by a call's rows).
    """
    if per_replica:
        size = min(rows_per_call, streams)
        return [
            (n * streams + lo, n * streams + min(lo + size, streams))
            for n in range(samples)
            for lo in range(0, streams, size)
        ]
    total = streams * samples
    return [(lo, min(lo + rows_per_call, total)) for lo in range(0, total, rows_per_call)]


def replicate(batch: LMBatch, samples: int) -> LMBatch:
    """The window with each stream repeated ``samples`` times along the batch: row ``n * B + b`` is stream b."""
    reset = None if batch.reset is None else batch.reset.repeat(samples, 1)
    return LMBatch(batch.inputs.repeat(samples, 1), batch.targets.repeat(samples, 1), reset)


def rows_on(rows: LMBatch, lo: int, hi: int, device: torch.device) -> LMBatch:
    """Rows ``[lo, hi)`` of a replicated window on ``device``, with where their resets fall (:class:`Resets`) worked
    out while the mask is still on the host: handed the bare mask, a forward call on a GPU would wait to learn it,
    once per call."""
    reset = None if rows.reset is None else Resets.from_mask(rows.reset[lo:hi]).to(device)
    inputs, targets = rows.inputs[lo:hi].to(device), rows.targets[lo:hi].to(device)
    return LMBatch(inputs, targets, None if reset is None else reset.mask, reset)


def log_mean_exp_nll(replica_nll: Tensor, targets: Tensor) -> Tensor:
    """``-log(1/N Σ_n exp(-nll_n))`` per token in float64, 0 where nothing is predicted.

    Args:
        replica_nll: ``(N, B, T)`` each replica's NLL.
        targets: ``(B, T)``.
    """
    samples = replica_nll.size(0)
    mixed = math.log(samples) - torch.logsumexp(-replica_nll.double(), dim=0)  # (B, T)
    return mixed.masked_fill(targets == IGNORE_INDEX, 0.0)


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run with the global RNG seeded, restoring the caller's RNG state afterwards (masks reproducible per seed)."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def replica_windows(
    model: RecurrentLM,
    windows: Iterable[LMBatch],
    settings: MCDropout,
    seed: int,
    call: Callable[[LMBatch, State | None], tuple[Tensor, State]],
) -> Iterator[tuple[list[tuple[LMBatch, Tensor]], Tensor]]:
    """Run ``call`` on every group of replicated rows of every window, under sampled dropout.

    Every replica carries its own state from window to window; the masks are reproducible for a given ``seed``.

    Args:
        call: ``(rows, state) -> (output, state)`` for one forward call, e.g. :meth:`RecurrentLM.token_nll`.

    Yields:
        Per window: ``[(rows, output)]`` per call in row order, and the window's targets ``(B, T)`` (on the model's
        device).
    """
    device = next(model.parameters()).device
    samples = settings.samples
    rows_per_call = settings.rows_per_call or DEFAULT_ROWS_PER_CALL
    with sampled_dropout(model, settings.dropout_scale), seeded(seed, device):
        per_replica = shares_masks_across_rows(model)
        groups: list[tuple[int, int]] | None = None
        states: list[State | None] = []
        for batch in windows:
            streams = batch.inputs.size(0)
            if groups is None:
                groups = row_groups(streams, samples, rows_per_call, per_replica)
                states = [None] * len(groups)
            rows = replicate(batch, samples)  # on the host, where a data module makes its windows
            outputs = []
            for index, (lo, hi) in enumerate(groups):
                group = rows_on(rows, lo, hi, device)
                output, state = call(group, states[index])
                states[index] = detach_state(state)
                outputs.append((group, output))
            yield outputs, batch.targets.to(device)


@torch.no_grad()
def replica_nll(
    model: RecurrentLM,
    windows: Iterable[LMBatch],
    settings: MCDropout,
    temperature: float = 1.0,
    seed: int = 0,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Each window's per-replica NLL ``(N, B, T)`` under sampled dropout, with the window's targets ``(B, T)``."""

    def call(rows: LMBatch, state: State | None) -> tuple[Tensor, State]:
        return model.token_nll(rows.inputs, rows.targets, state, rows.model_reset, temperature)

    for outputs, targets in replica_windows(model, windows, settings, seed, call):
        yield torch.cat([nll for _, nll in outputs]).view(settings.samples, *targets.shape), targets


def mc_nll(
    model: RecurrentLM,
    windows: Iterable[LMBatch],
    settings: MCDropout,
    temperature: float = 1.0,
    seed: int = 0,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Each window's MC-dropout NLL ``(B, T)`` (float64, probability-space average of the replicas) and targets."""
    for nll, targets in replica_nll(model, windows, settings, temperature, seed):
        yield log_mean_exp_nll(nll, targets), targets
