"""Dynamic evaluation (Krause et al. 2017, "Dynamic evaluation of neural sequence models", arXiv:1709.07432): the model
adapts to the evaluation text as it reads it.

The split is read as one stream (batch size 1) cut into segments of ``max_time_steps`` tokens. Each segment is
scored first, with the weights adapted on the segments before it only, and THEN the weights take one gradient step
on that segment's mean NLL; the recurrent state carries on from the forward pass that scored it. The step is
Krause et al.'s RMS-normalised update with an RMS-scaled decay towards the trained weights θ0 (their §5, "RMS with
an RMS global prior"), as the Mogrifier paper's code (deepmind/lamb ``dyneval.py``) implements it::

    MS_g  = 1/K Σ_k (∂L_k/∂θ_g)²          over K training batches, once, before evaluation
    r_g   = sqrt(MS_g),   r̄ = mean of r_g over every weight of the model
    d_g   = min(1, λ · r_g / r̄)            the decay, clipped at 1 so a step never overshoots θ0
    θ_g  ← θ_g − η · ∂L(s_i)/∂θ_g / (r_g + ε) + d_g · (θ0_g − θ_g)

with η the learning rate, λ the decay rate and ε the epsilon of Table 6 (Melis et al. 2020, Appendix A). L is the
mean NLL per predicted token of a training batch (for MS) or of the segment s_i; training statistics come from the
deterministic model (dropout off, as Krause's ``gradstat``), batches of 1024 x ``max_time_steps`` (Appendix A: "The
batch size for estimating the mean squared gradients over the training data was set to 1024, gradient clipping was
turned off, and the l2 penalty was set to zero"). Krause's code normalises r̄ as the mean of per-tensor means; LAMB's,
followed here, as the mean over all weights.

Batch size 1 is not a choice: with B parallel streams a step on stream 2's segment (later text) would change the
weights before stream 1's next segment (earlier text) is scored.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from datamodules.progress import Progress
from datamodules.windows import IGNORE_INDEX, LMBatch
from evaluation.scoring import EvaluationSetup, Flag, Scorer, ScoringProcedure, first_tokens
from evaluation.temperature import total_nll
from zoo.errors import ConfigError
from zoo.language_model import RecurrentLM
from zoo.state import State, detach_state

#: Table 6 of the Mogrifier paper: log-spaced tuning ranges, and the highest ``max_time_steps`` (word / character).
TABLE6_RANGES = {"learning_rate": (1e-6, 1e-3), "decay_rate": (1e-6, 1e-2), "epsilon": (1e-8, 1e-2)}
MAX_TIME_STEPS_RANGE = {"word": (1, 20), "char": (1, 50)}
DEFAULT_TUNE_TRIALS = 20  # settings --tune tries


def dense_gradients(grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """The gradients with sparse ones (the embedding of a model with ``sparse_gradients``) made dense: the update
    below is elementwise over whole weights (it decays every row towards θ0), and ``addcmul_`` has no sparse kernel."""
    return [g.to_dense() if g is not None and g.is_sparse else g for g in grads]


def _log_middle(name: str) -> float:
    low, high = TABLE6_RANGES[name]
    return float(f"{math.sqrt(low * high):.3g}")


@dataclass(frozen=True)
class DynamicEvaluation(ScoringProcedure):
    """Dynamic evaluation, a scoring procedure: its hyperparameters (the defaults are the middles of Table 6's
    log-spaced ranges), optionally tuned on validation first, its flags and its scorer.

    Attributes:
        learning_rate: η (Table 6: 1e-6 .. 1e-3).
        decay_rate: λ, the pull towards the trained weights (1e-6 .. 1e-2).
        epsilon: ε in the RMS normalisation (1e-8 .. 1e-2).
        max_time_steps: segment length, one gradient step per segment (1 .. 20 word-level, 1 .. 50 character-level);
            ``None``: the middle of the range for the corpus's level (10 or 25).
        stat_batches: most training batches for the mean squared gradients (LAMB's ``max_training_eval_batches``
            default, 100); fewer if the training split runs out.
        stat_batch_size: streams per training batch (the paper: 1024).
        tune_trials: settings to try on validation over Table 6 (Optuna TPE) before scoring, the best of which
            scores the split; 0: no tuning. Not part of :meth:`record`: the tuning has its own record.
        tune_tokens: score each trial on the first this many validation tokens only (Krause et al.'s ``--gridfast``
            uses 30,000); ``None``: the whole split.
    """

    learning_rate: float = _log_middle("learning_rate")
    decay_rate: float = _log_middle("decay_rate")
    epsilon: float = _log_middle("epsilon")
    max_time_steps: int | None = None
    stat_batches: int = 100
    stat_batch_size: int = 1024
    tune_trials: int = 0
    tune_tokens: int | None = None

    method: ClassVar[str] = "dynamic"
    flag: ClassVar[str | None] = "--dynamic"
    flags: ClassVar[tuple[Flag, ...]] = (
        Flag(
            "--dynamic",
            "dynamic evaluation (Krause et al. 2017): one stream; after scoring each segment, a gradient step on it",
        ),
        *(
            Flag(name, text, setting, float, 0, metavar)
            for name, setting, metavar, text in (
                (
                    "--dyn-lr",
                    "learning_rate",
                    "ETA",
                    f"learning rate (default {learning_rate:g}; Table 6: 1e-6 .. 1e-3)",
                ),
                (
                    "--dyn-decay",
                    "decay_rate",
                    "LAMBDA",
                    f"decay towards the trained weights (default {decay_rate:g}; 1e-6 .. 1e-2)",
                ),
                (
                    "--dyn-eps",
                    "epsilon",
                    "EPS",
                    f"epsilon of the RMS-normalised step (default {epsilon:g}; 1e-8 .. 1e-2)",
                ),
            )
        ),
        *(
            Flag(name, text, setting, int, 1, metavar)
            for name, setting, metavar, text in (
                (
                    "--dyn-max-time-steps",
                    "max_time_steps",
                    "T",
                    "segment length (default 10 for words, 25 for characters; 1 .. 20 / 50)",
                ),
                (
                    "--dyn-stat-batches",
                    "stat_batches",
                    "K",
                    f"training batches for the mean squared gradients (default {stat_batches})",
                ),
                (
                    "--dyn-stat-batch-size",
                    "stat_batch_size",
                    "B",
                    f"streams per such batch (default {stat_batch_size}, the paper's)",
                ),
            )
        ),
        Flag(
            "--tune",
            "with --dynamic: search Table 6's ranges on the valid split (Optuna TPE); the best settings score --split",
        ),
        Flag(
            "--tune-trials",
            f"settings --tune tries (default {DEFAULT_TUNE_TRIALS}; the first is the given one)",
            "tune_trials",
            int,
            1,
            "N",
            needs="--tune",
        ),
        Flag(
            "--tune-tokens",
            "score each --tune trial on the first N valid tokens only (default: all; Krause et al. used 30000)",
            "tune_tokens",
            int,
            1,
            "N",
            needs="--tune",
        ),
    )
    # With more streams, a step on later text would change the weights before earlier text is scored.
    one_stream: ClassVar[bool] = True
    needs_float_weights: ClassVar[str | None] = "trains the weights"
    # One key for the settings, the gradient statistics and the tuning: {"dynamic": {...}}.
    records: ClassVar[tuple[str, ...]] = ("dynamic",)

    def __post_init__(self) -> None:
        for name in ("learning_rate", "decay_rate", "epsilon"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"dynamic evaluation's {name} must be a number >= 0, got {value}")
        for name in ("max_time_steps", "stat_batches", "stat_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"dynamic evaluation's {name} must be at least 1, got {value}")
        if self.tune_trials < 0:
            raise ConfigError(f"--tune-trials must be at least 1, got {self.tune_trials}")
        if self.tune_tokens is not None and self.tune_tokens < 1:
            raise ConfigError(f"--tune-tokens must be at least 1, got {self.tune_tokens}")
        if self.tune_tokens is not None and not self.tune_trials:
            raise ConfigError("--tune-tokens applies only with --tune: add it or drop the flag")

    def for_level(self, level: str) -> DynamicEvaluation:
        """These settings with ``max_time_steps`` filled in for a ``word`` or ``char`` corpus."""
        if self.max_time_steps is not None:
            return self
        low, high = MAX_TIME_STEPS_RANGE.get(level, MAX_TIME_STEPS_RANGE["word"])
        return replace(self, max_time_steps=(low + high) // 2)

    @classmethod
    def summary(cls, record: Mapping[str, Any]) -> list[str]:
        dyn = record["dynamic"]
        return [
            f"lr {dyn['learning_rate']:.3g}, decay {dyn['decay_rate']:.3g}, {dyn['max_time_steps']} steps per segment"
        ]

    @classmethod
    def details(cls, record: Mapping[str, Any], seed: int) -> list[str]:
        dyn = record["dynamic"]
        tuned = f", tuned over {len(dyn['tuning']['trials'])} trials" if dyn.get("tuning") else ""
        return [
            f"dynamic eval lr {dyn['learning_rate']:.3g}, decay {dyn['decay_rate']:.3g}, eps {dyn['epsilon']:.3g}, "
            f"{dyn['max_time_steps']} steps/segment, MS from {dyn['stat_tokens']:,} training tokens{tuned}"
        ]

    def record(self) -> dict[str, float | int | None]:
        """The hyperparameters as a results-JSON entry."""
        return {name: value for name, value in asdict(self).items() if name not in ("tune_trials", "tune_tokens")}

    @classmethod
    def from_settings(cls, settings: dict[str, Any], given: Mapping[str, Any]) -> DynamicEvaluation:
        """``--tune`` tunes over :data:`DEFAULT_TUNE_TRIALS` settings unless ``--tune-trials`` says how many."""
        trials = settings.get("tune_trials", DEFAULT_TUNE_TRIALS) if "--tune" in given else 0
        return cls(**{**settings, "tune_trials": trials})

    def check(self, batch_size: int | None, bptt: int | None) -> None:
        if batch_size not in (None, 1):
            raise ConfigError(
                f"--dynamic reads the split as one stream (batch size 1; with more, a step on later text would change "
                f"the weights before earlier text is scored): drop --batch-size {batch_size}"
            )
        if bptt is not None:
            raise ConfigError("--dynamic takes one gradient step per segment: set its length with --dyn-max-time-steps")

    def prepare(self, setup: EvaluationSetup) -> Scorer:
        """The gradient statistics on train, then, with :attr:`tune_trials`, the settings tuned on valid."""
        model, datamodule = setup.model, setup.datamodule
        settings = self.for_level(datamodule.level)
        train_windows = datamodule.stream("train", batch_size=settings.stat_batch_size, bptt=settings.max_time_steps)
        total = min(settings.stat_batches, len(train_windows))
        train = Progress(train_windows, "gradient statistics on train", total=total)
        statistics = mean_squared_gradients(model, train, settings.stat_batches)
        tuning: dict[str, Any] | None = None
        scored_valid = None
        if settings.tune_trials:
            trials = tune(
                model,
                statistics,
                lambda steps: first_tokens(
                    Progress(datamodule.stream("valid", batch_size=1, bptt=steps), "trial"), settings.tune_tokens
                ),
                settings,
                settings.tune_trials,
                datamodule.level,
                setup.seed,
                setup.temperature,
            )
            best = min(trials, key=lambda trial: trial.loss)
            settings = best.settings
            tuning = {
                "split": "valid",
                "trials": [trial.record() for trial in trials],
                "best_valid_loss": best.loss,
                "valid_tokens": best.tokens,
                "temperature": setup.temperature,
                "seed": setup.seed,
                "search": "Optuna TPE over Table 6 (trial 0: the given settings)",
            }
            if settings.tune_tokens is None:  # the winning trial scored the whole valid split at its settings
                scored_valid = best.nats, best.tokens

        def score(windows: Iterable[LMBatch], t: float) -> tuple[float, int]:
            with adapting(model, statistics, settings) as adaptation:
                return total_nll(dynamic_nll(model, windows, adaptation, t))

        return Scorer(
            score,
            settings.max_time_steps,  # the tuned segment length, when tuning chose one
            record={"dynamic": {**settings.record(), **statistics.record(), "tuning": tuning}},
            scored_valid=scored_valid,
        )


def adapted_parameters(model: RecurrentLM) -> dict[str, Tensor]:
    """The weights dynamic evaluation adapts: every trainable parameter (a tied matrix once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


@dataclass
class GradientStatistics:
    """Mean squared gradients of the training loss, per parameter name.

    Attributes:
        mean_squared: name -> MS, shaped like the parameter.
        batches: training batches they average.
        tokens: training tokens those batches predict.
        batch_size: streams per batch.
        bptt: steps per batch.
    """

    mean_squared: dict[str, Tensor]
    batches: int
    tokens: int
    batch_size: int
    bptt: int

    def record(self) -> dict[str, int]:
        return {"stat_batches_used": self.batches, "stat_tokens": self.tokens, "stat_bptt": self.bptt}


def gradients_in_eval_mode() -> contextlib.AbstractContextManager:
    """Where gradients are taken with the model in eval mode (dropout off): without cuDNN, which refuses an RNN's
    backward outside training mode (pytorch/pytorch#5878), so ``nn.LSTM``/``nn.GRU``/``nn.RNN`` layers run PyTorch's
    own CUDA kernels for this pass. Same numbers; on CPU nothing changes."""
    return torch.backends.cudnn.flags(enabled=False)


def mean_squared_gradients(model: RecurrentLM, windows: Iterable[LMBatch], max_batches: int) -> GradientStatistics:
    """``MS = 1/K Σ_k g_k²`` with ``g_k`` the gradient of training batch k's mean NLL per token (state carried
    between batches, dropout off, no clipping, no L2), over at most ``max_batches`` batches.

    Raises:
        ConfigError: no training batch predicts a token.
    """
    model.eval()
    params = adapted_parameters(model)
    device = next(model.parameters()).device
    sums = {name: torch.zeros_like(p) for name, p in params.items()}
    batches = tokens = streams = steps = 0
    state: State | None = None
    for batch in windows:
        if batches >= max_batches:
            break
        inputs, targets, reset = batch.on(device)
        with torch.enable_grad(), gradients_in_eval_mode():
            nll, state = model.token_nll(inputs, targets, state, reset)
            count = int((targets != IGNORE_INDEX).sum())
            state = detach_state(state)
            if count == 0:
                continue
            grads = dense_gradients(torch.autograd.grad(nll.sum() / count, list(params.values()), allow_unused=True))
        for name, grad in zip(params, grads):
            if grad is not None:
                sums[name] += grad.detach() ** 2
        batches += 1
        tokens += count
        streams, steps = max(streams, inputs.size(0)), max(steps, inputs.size(1))
    if batches == 0:
        raise ConfigError("the training split predicts no token: dynamic evaluation needs its gradient statistics")
    return GradientStatistics({n: s / batches for n, s in sums.items()}, batches, tokens, streams, steps)


class RMSAdaptation:
    """The update rule of the module docstring, applied in place to the model's weights.

    Args:
        model: the model to adapt (its current weights are θ0).
        statistics: MS per parameter name (from :func:`mean_squared_gradients`).
        settings: η, λ, ε.
    """

    def __init__(self, model: RecurrentLM, statistics: GradientStatistics, settings: DynamicEvaluation) -> None:
        self.params = adapted_parameters(model)
        missing = sorted(set(self.params) - set(statistics.mean_squared))
        if missing:
            raise ConfigError(f"gradient statistics lack {missing[:3]}: compute them on this model")
        self.learning_rate = settings.learning_rate
        self.initial = {name: p.detach().clone() for name, p in self.params.items()}  # θ0
        rms = {name: statistics.mean_squared[name].sqrt() for name in self.params}
        numel = sum(r.numel() for r in rms.values())
        mean_rms = float(sum(float(r.double().sum()) for r in rms.values()) / numel)  # r̄
        # d_g = min(1, λ r_g / r̄); all-zero statistics (a model that cannot learn) give no decay, never 0/0.
        self.decay = {
            n: (settings.decay_rate * r / mean_rms if mean_rms > 0 else r * 0).clamp(max=1.0) for n, r in rms.items()
        }
        # Two in-place passes over each weight per segment, no temporaries: θ.lerp_(θ0, d) is θ + d (θ0 − θ) (exactly
        # θ0 when θ = θ0), then θ −= (η / (r + ε)) g. The update touches every weight, the embedding included, at every
        # segment, so at batch size 1 its memory traffic is much of what a step costs.
        self.step_size = {n: settings.learning_rate / (r + settings.epsilon) for n, r in rms.items()}  # η / (r + ε)
        self.steps = 0

    @torch.no_grad()
    def step(self, grads: dict[str, Tensor | None]) -> None:
        """``θ ← θ − η g / (r + ε) + d ⊙ (θ0 − θ)`` for every adapted weight (``None``: a zero gradient)."""
        for name, p in self.params.items():
            p.lerp_(self.initial[name], self.decay[name])
            grad = grads.get(name)
            if grad is not None:
                p.addcmul_(grad, self.step_size[name], value=-1.0)
        self.steps += 1

    @torch.no_grad()
    def restore(self) -> None:
        """Put θ0 back exactly."""
        for name, p in self.params.items():
            p.copy_(self.initial[name])


@contextmanager
def adapting(
    model: RecurrentLM, statistics: GradientStatistics, settings: DynamicEvaluation
) -> Iterator[RMSAdaptation]:
    """An :class:`RMSAdaptation` of ``model`` whose trained weights are restored on exit, also after an error."""
    adaptation = RMSAdaptation(model, statistics, settings)
    try:
        yield adaptation
    finally:
        adaptation.restore()


def dynamic_nll(
    model: RecurrentLM,
    windows: Iterable[LMBatch],
    adaptation: RMSAdaptation,
    temperature: float = 1.0,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Each segment's NLL ``(B, T)`` (float64) scored before the step on it, with its targets.

    ``windows`` are the segments (a batch-size-1 stream with ``bptt = max_time_steps``). The gradient is that of the
    segment's mean NLL at ``temperature``, the loss being reported.
    """
    model.eval()  # dropout off, as in Krause et al.'s code
    device = next(model.parameters()).device
    names = list(adaptation.params)
    state: State | None = None
    for batch in windows:
        inputs, targets, reset = batch.on(device)
        with torch.enable_grad(), gradients_in_eval_mode():
            nll, state = model.token_nll(inputs, targets, state, reset, temperature)
            scored = nll.detach().double()  # the score, computed before any step on this segment
            count = int((targets != IGNORE_INDEX).sum())
            if count > 0:
                grads = dense_gradients(
                    torch.autograd.grad(nll.sum() / count, list(adaptation.params.values()), allow_unused=True)
                )
                adaptation.step(dict(zip(names, grads)))
        state = detach_state(state)
        yield scored, targets


@dataclass
class TuningTrial:
    """One trial of :func:`tune`: its settings and what it scored on validation."""

    settings: DynamicEvaluation
    nats: float
    tokens: int

    @property
    def loss(self) -> float:
        """Mean nats per predicted token."""
        return self.nats / max(self.tokens, 1)

    def record(self) -> dict[str, float | int | None]:
        return {
            "learning_rate": self.settings.learning_rate,
            "decay_rate": self.settings.decay_rate,
            "epsilon": self.settings.epsilon,
            "max_time_steps": self.settings.max_time_steps,
            "loss": self.loss,
        }


def tune(
    model: RecurrentLM,
    statistics: GradientStatistics,
    segments: Callable[[int], Iterable[LMBatch]],
    base: DynamicEvaluation,
    trials: int,
    level: str = "word",
    seed: int = 0,
    temperature: float = 1.0,
) -> list[TuningTrial]:
    """Search Table 6 on validation with Optuna's TPE sampler: trial 0 is ``base``, the others are suggested from
    log-uniform η, λ, ε and a uniform ``max_time_steps`` over the level's range.

    The paper tuned with Vizier (a Gaussian-process bandit); TPE is the open stand-in the project's ``lm-zoo tune``
    uses too. All trials share one set of gradient statistics (computed with ``base.max_time_steps`` steps per
    training batch): MS is the per-weight scale of a training batch's mean gradient, and recomputing it per segment
    length would multiply the cost of a trial.

    Args:
        segments: ``max_time_steps -> the validation stream`` (batch size 1).
        base: the first trial, and the source of the statistics settings.
        trials: how many settings to try (>= 1).
        seed: seeds the sampler (the same seed suggests the same settings).

    Returns:
        Every trial, in the order run.
    """
    import optuna  # deferred: only --tune needs the tune extra (pip install "lm-zoo[tune]")

    if trials < 1:
        raise ConfigError(f"tuning needs at least 1 trial, got {trials}")
    low, high = MAX_TIME_STEPS_RANGE.get(level, MAX_TIME_STEPS_RANGE["word"])
    ranges = {**TABLE6_RANGES, "max_time_steps": (low, high)}
    results: list[TuningTrial] = []

    def run(settings: DynamicEvaluation) -> float:
        with adapting(model, statistics, settings) as adaptation:
            nats, count = total_nll(dynamic_nll(model, segments(settings.max_time_steps), adaptation, temperature))
        results.append(TuningTrial(settings, nats, count))
        return results[-1].loss

    def objective(trial: optuna.Trial) -> float:
        values: dict[str, float | int] = {
            name: trial.suggest_float(name, *TABLE6_RANGES[name], log=True) for name in TABLE6_RANGES
        }
        values["max_time_steps"] = trial.suggest_int("max_time_steps", low, high)
        return run(replace(base, **values))

    with _warnings_only(optuna):  # one line per trial on stderr otherwise
        study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
        first = base.for_level(level)
        loss = run(first)
        given = {name: getattr(first, name) for name in ranges}
        if all(lo <= given[name] <= hi for name, (lo, hi) in ranges.items()):
            # The given settings inform the sampler too, when they lie inside Table 6's ranges.
            space = _search_space(optuna, low, high)
            study.add_trial(optuna.trial.create_trial(params=given, distributions=space, value=loss))
        study.optimize(objective, n_trials=trials - 1)
    return results


@contextmanager
def _warnings_only(optuna: Any) -> Iterator[None]:
    """Optuna's logging at warnings only while inside, its own level put back after."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _search_space(optuna: Any, low: int, high: int) -> dict[str, Any]:
    """Table 6's ranges as Optuna distributions (η, λ, ε log-uniform), with ``max_time_steps`` in ``[low, high]``:
    what :func:`tune`'s objective suggests from."""
    floats = {name: optuna.distributions.FloatDistribution(*TABLE6_RANGES[name], log=True) for name in TABLE6_RANGES}
    return {**floats, "max_time_steps": optuna.distributions.IntDistribution(low, high)}
