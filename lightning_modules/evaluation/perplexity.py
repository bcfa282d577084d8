"""Evaluation of a language model over a whole split: the numbers ``lm-zoo evaluate`` reports.

The procedures of the Mogrifier paper (Melis et al. 2020 §3.3, Appendix A), each recorded in the result:

* **deterministic** (dropout off), the default, at an eval batch size and BPTT that the result records (each of the
  B streams starts without context, so perplexity depends on them); ``long_context``: one stream over the whole split;
* **softmax temperature**: a given one, or ``"auto"``: the one minimising validation cross-entropy
  (:mod:`lightning_modules.evaluation.temperature`), then applied to the requested split;
* **MC dropout**: predictions averaged over sampled dropout masks in probability space, dropout rates optionally
  scaled (:mod:`lightning_modules.evaluation.mc_dropout`);
* **dynamic evaluation** (Krause et al. 2017): the weights adapt to the text as it is read, hyperparameters optionally
  tuned on validation over Table 6's ranges (:mod:`lightning_modules.evaluation.dynamic`).

The loops are written out rather than run through ``Trainer.test`` so that the result carries exact counts (summed in
float64) and every setting perplexity depends on. Every procedure scores through ``RecurrentLM.token_nll`` (the
full softmax, whatever the training head); the temperature search re-scores kept features through the head's own
``token_nll``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from datamodules.kinds import BPC, TEXT, WORD_PPL
from datamodules.progress import Progress
from datamodules.text_data import TextData
from datamodules.tokenizers import TextUnits
from datamodules.windows import IGNORE_INDEX, LMBatch
from lightning_modules.evaluation.dynamic import (
    DynamicEvaluation,
    TuningTrial,
    adapting,
    dynamic_nll,
    mean_squared_gradients,
    tune,
)
from lightning_modules.evaluation.mc_dropout import (
    DEFAULT_ROWS_PER_CALL,
    MCDropout,
    head_is_stochastic,
    mc_nll,
    row_groups,
    shares_masks_across_rows,
)
from lightning_modules.evaluation.results import ProcedureSettings, TextResult
from lightning_modules.evaluation.temperature import (
    CACHE_BYTES,
    TEMPERATURE_RANGE,
    TEMPERATURE_TOLERANCE,
    collect_features,
    golden_section_search,
    total_nll,
)
from zoo.errors import ConfigError
from zoo.language_model import RecurrentLM
from zoo.state import State, detach_state

AUTO = "auto"


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


def first_tokens(windows: Iterable[LMBatch], tokens: int | None) -> Iterator[LMBatch]:
    """The windows up to the one holding the ``tokens``-th predicted token (all if ``None``), in whole windows: of a
    one-stream split its first tokens; of ``B`` streams the same first windows of every stream (the split's text is
    cut into ``B`` columns, so each column's beginning)."""
    seen = 0
    for batch in windows:
        if tokens is not None and seen >= tokens:
            return
        seen += int((batch.targets != IGNORE_INDEX).sum())
        yield batch


def parse_temperature(text: str | float) -> float | str:
    """A softmax temperature: a number > 0, or ``auto``.

    Raises:
        ConfigError: anything else.
    """
    if isinstance(text, str) and text.strip().lower() == AUTO:
        return AUTO
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"--temperature must be a number > 0 or 'auto', got {text!r}")
    return value


def check_settings(
    batch_size: int | None = None,
    bptt: int | None = None,
    long_context: bool = False,
    temperature: float | str = 1.0,
    mc: MCDropout | None = None,
    dynamic: DynamicEvaluation | None = None,
    tune_trials: int = 0,
    tune_tokens: int | None = None,
    max_tokens: int | None = None,
) -> None:
    """Refuse settings that cannot work together, with one line that says what to do.

    Raises:
        ConfigError: the first problem found.
    """
    parse_temperature(temperature)
    for flag, value in (("--batch-size", batch_size), ("--bptt", bptt)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if long_context and batch_size not in (None, 1):
        raise ConfigError(
            f"--long-context reads the split as one stream (batch size 1): drop --batch-size {batch_size}"
        )
    if tune_trials < 0:
        raise ConfigError(f"--tune-trials must be at least 1, got {tune_trials}")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {max_tokens}")
    if tune_tokens is not None and tune_tokens < 1:
        raise ConfigError(f"--tune-tokens must be at least 1, got {tune_tokens}")
    if tune_tokens is not None and not tune_trials:
        raise ConfigError("--tune-tokens applies only with --tune: add it or drop the flag")
    if tune_trials and dynamic is None:
        raise ConfigError("--tune searches dynamic evaluation's hyperparameters: add --dynamic")
    if dynamic is not None:
        if mc is not None:
            raise ConfigError("--dynamic with --mc-samples is not supported: run them separately")
        if batch_size not in (None, 1):
            raise ConfigError(
                f"--dynamic reads the split as one stream (batch size 1; with more, a step on later text would change "
                f"the weights before earlier text is scored): drop --batch-size {batch_size}"
            )
        if bptt is not None:
            raise ConfigError("--dynamic takes one gradient step per segment: set its length with --dyn-max-time-steps")


@dataclass
class _Procedure:
    """How :func:`evaluate` scores a split, and what its result records of the procedure.

    Attributes:
        method: ``deterministic``, ``mc-dropout`` or ``dynamic``.
        score: windows and a temperature -> summed nats and predicted tokens.
        steps: the window length every split is read in (dynamic evaluation's segment length, else the BPTT).
        cacheable: whether the temperature search may keep one pass's features and re-score only the softmax (not
            when the weights change as they read, nor when the head samples its own dropout).
        mc_rows_per_call: MC dropout's most rows per forward pass; ``None`` for the other procedures.
        dynamic: dynamic evaluation's settings, gradient statistics and tuning; ``None`` for the other procedures.
        best_trial: with tuning: the winning trial, itself a dynamic evaluation of the validation split.
    """

    method: str
    score: Callable[[Iterable[LMBatch], float], tuple[float, int]]
    steps: int
    cacheable: bool = True
    mc_rows_per_call: int | None = None
    dynamic: dict[str, Any] | None = None
    best_trial: TuningTrial | None = None


def _windows(datamodule: TextData, split: str, batch_size: int, steps: int) -> Progress:
    """A split's windows at the evaluation's batch size, with progress shown under the split's name."""
    return Progress(datamodule.stream(split, batch_size=batch_size, bptt=steps), split)


def _deterministic_procedure(model: RecurrentLM, bptt: int) -> _Procedure:
    """Dropout off: every window scored once."""

    def score(windows: Iterable[LMBatch], t: float) -> tuple[float, int]:
        return total_nll(deterministic_nll(model, windows, t))

    return _Procedure("deterministic", score, bptt)


def _mc_procedure(model: RecurrentLM, mc: MCDropout, seed: int, bptt: int, streams: int) -> _Procedure:
    """MC dropout: predictions averaged over sampled masks; ``streams``: the scored split's parallel streams."""

    def score(windows: Iterable[LMBatch], t: float) -> tuple[float, int]:
        return total_nll(mc_nll(model, windows, mc, t, seed))

    per_replica = mc.dropout_scale > 0 and shares_masks_across_rows(model)
    groups = row_groups(streams, mc.samples, mc.rows_per_call or DEFAULT_ROWS_PER_CALL, per_replica)
    return _Procedure(
        "mc-dropout",
        score,
        bptt,
        cacheable=mc.dropout_scale == 0 or not head_is_stochastic(model),
        mc_rows_per_call=max(hi - lo for lo, hi in groups),
    )


def _dynamic_procedure(
    model: RecurrentLM,
    datamodule: TextData,
    dynamic: DynamicEvaluation,
    tune_trials: int,
    tune_tokens: int | None,
    seed: int,
    temperature: float,
) -> _Procedure:
    """Dynamic evaluation: the gradient statistics on train, then, with ``tune_trials``, the settings tuned on valid.

    Args:
        model: the language model.
        datamodule: provides the train and valid streams.
        dynamic: the settings (already for the data module's level); tuning starts from them.
        tune_trials: settings to try on validation; 0: no tuning.
        tune_tokens: score each trial on the first this many validation tokens only; ``None``: the whole split.
        seed: seeds the tuning draws.
        temperature: the softmax temperature the trials score at (1 when it is searched afterwards).
    """
    train_windows = datamodule.stream("train", batch_size=dynamic.stat_batch_size, bptt=dynamic.max_time_steps)
    total = min(dynamic.stat_batches, len(train_windows))
    train = Progress(train_windows, "gradient statistics on train", total=total)
    statistics = mean_squared_gradients(model, train, dynamic.stat_batches)
    tuning: dict[str, Any] | None = None
    best_trial = None
    if tune_trials:
        trials = tune(
            model,
            statistics,
            lambda steps: first_tokens(
                Progress(datamodule.stream("valid", batch_size=1, bptt=steps), "trial"), tune_tokens
            ),
            dynamic,
            tune_trials,
            datamodule.level,
            seed,
            temperature,
        )
        best_trial = min(trials, key=lambda trial: trial.loss)
        dynamic = best_trial.settings
        tuning = {
            "split": "valid",
            "trials": [trial.record() for trial in trials],
            "best_valid_loss": best_trial.loss,
            "valid_tokens": best_trial.tokens,
            "temperature": temperature,
            "seed": seed,
            "search": "Optuna TPE over Table 6 (trial 0: the given settings)",
        }

    def score(windows: Iterable[LMBatch], t: float) -> tuple[float, int]:
        with adapting(model, statistics, dynamic) as adaptation:
            return total_nll(dynamic_nll(model, windows, adaptation, t))

    return _Procedure(
        "dynamic",
        score,
        dynamic.max_time_steps,  # the tuned segment length, when tuning chose one
        cacheable=False,
        dynamic={**dynamic.record(), **statistics.record(), "tuning": tuning},
        best_trial=best_trial,
    )


def _search_temperature(
    model: RecurrentLM,
    datamodule: TextData,
    valid: Iterable[LMBatch],
    procedure: _Procedure,
    mc: MCDropout | None,
    seed: int,
    temperature_range: tuple[float, float],
    cache_bytes: int,
) -> tuple[float, dict[str, Any], tuple[float, int]]:
    """The temperature minimising validation cross-entropy (golden-section search).

    Returns:
        The temperature, the result's ``temperature_search`` record, and the validation nats and tokens at it.
    """
    cache = collect_features(model, valid, mc, seed, cache_bytes) if procedure.cacheable else None
    seen: dict[float, tuple[float, int]] = {}

    def objective(t: float) -> float:
        seen[t] = cache.loss(t) if cache is not None else procedure.score(valid, t)
        return seen[t][0] / seen[t][1]

    found = golden_section_search(objective, *temperature_range, TEMPERATURE_TOLERANCE)
    at_one = objective(1.0)
    search = {
        "method": "golden-section",
        "split": "valid",
        "range": list(temperature_range),
        "tolerance": TEMPERATURE_TOLERANCE,
        "evaluations": len(found.evaluations),
        "features_cached": cache is not None,
        "valid": _metrics(datamodule, "valid", *seen[found.temperature]),
        "valid_loss_at_1": at_one,
    }
    return found.temperature, search, seen[found.temperature]


def evaluate(
    model: RecurrentLM,
    datamodule: TextData,
    split: str = "test",
    batch_size: int | None = None,
    bptt: int | None = None,
    device: str | torch.device = "cpu",
    *,
    long_context: bool = False,
    temperature: float | str = 1.0,
    mc: MCDropout | None = None,
    dynamic: DynamicEvaluation | None = None,
    tune_trials: int = 0,
    tune_tokens: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    temperature_range: tuple[float, float] = TEMPERATURE_RANGE,
    cache_bytes: int = CACHE_BYTES,
) -> TextResult:
    """Score a split with the full softmax, by one of the paper's procedures.

    Args:
        model: the language model (its vocabulary must be the data module's). It ends in eval mode with its trained
            weights and dropout rates, whatever the procedure did to them meanwhile.
        datamodule: provides the split's stream and its size in tokens/characters/words.
        split: ``train``, ``valid`` or ``test``.
        batch_size: parallel streams; ``None`` uses the data module's eval batch size.
        bptt: window length; ``None`` uses the data module's eval BPTT.
        device: where to run.
        long_context: one stream over the whole split (batch size 1), as the strongest published numbers use.
        temperature: softmax temperature, or ``"auto"``: golden-section search on the validation split within
            ``temperature_range``, then applied to ``split``.
        mc: MC-dropout settings, or ``None`` for deterministic evaluation.
        dynamic: dynamic-evaluation settings (batch size 1, segments of ``max_time_steps``), or ``None``.
        tune_trials: with ``dynamic``: try this many settings over Table 6 on validation (Optuna TPE), keep the best.
        tune_tokens: score each trial on the first this many validation tokens only (Krause et al.'s ``--gridfast``
            uses 30,000); ``None``: the whole split.
        max_tokens: score ``split`` only up to the window holding its this-many-th predicted token
            (:func:`first_tokens`): a fixed part of it, quick to re-measure (a registered model's check figure);
            ``None``: the whole split. What is tuned or searched on validation first still reads all it reads.
        seed: seeds the MC masks and the tuning draws.
        temperature_range: the bracket of the temperature search.
        cache_bytes: most memory kept for the temperature search's features (beyond it, each trial re-runs).

    Returns:
        The figures (loss in mean nats per token, ppl, and bpc / word_ppl where
        :func:`datamodules.kinds.text_figures` reports them) with the eval batch size, BPTT and every setting of the
        procedure (:class:`~lightning_modules.evaluation.results.ProcedureSettings`: the temperature and how an
        ``auto`` one was found, MC dropout's samples, dynamic evaluation's settings, statistics and tuning trials).

    Raises:
        ConfigError: settings that cannot work together (:func:`check_settings`).
    """
    check_settings(batch_size, bptt, long_context, temperature, mc, dynamic, tune_trials, tune_tokens, max_tokens)
    temperature = parse_temperature(temperature)
    # Every split is scored at the evaluation sizes, the training split too (its stream would default to training's).
    batch_size, bptt = batch_size or datamodule.eval_batch_size, bptt or datamodule.eval_bptt
    model.eval().to(device)
    if dynamic is not None:
        dynamic = dynamic.for_level(datamodule.level)
    if long_context or dynamic is not None:
        batch_size = 1
    fixed_temperature = 1.0 if temperature == AUTO else float(temperature)

    procedure: _Procedure
    if dynamic is not None:
        procedure = _dynamic_procedure(model, datamodule, dynamic, tune_trials, tune_tokens, seed, fixed_temperature)
    elif mc is not None:
        streams = 1 if batch_size == 1 else _windows(datamodule, split, batch_size, bptt).batch_size
        procedure = _mc_procedure(model, mc, seed, bptt, streams)
    else:
        procedure = _deterministic_procedure(model, bptt)

    scored: tuple[float, int] | None = None
    search: dict[str, Any] | None = None
    if temperature == AUTO:
        valid = _windows(datamodule, "valid", batch_size, procedure.steps)
        temperature, search, at_found = _search_temperature(
            model, datamodule, valid, procedure, mc, seed, temperature_range, cache_bytes
        )
        if split == "valid" and max_tokens is None:
            scored = at_found
    elif procedure.best_trial is not None and tune_tokens is None and max_tokens is None and split == "valid":
        scored = procedure.best_trial.nats, procedure.best_trial.tokens  # the winning trial was this very evaluation

    stream = _windows(datamodule, split, batch_size, procedure.steps)
    if scored is None:
        scored = procedure.score(first_tokens(stream, max_tokens), float(temperature))
    settings = ProcedureSettings(
        method=procedure.method,
        long_context=batch_size == 1,
        temperature=float(temperature),
        temperature_search=search,
        mc_samples=mc.samples if mc is not None else 0,
        dropout_scale=mc.dropout_scale if mc is not None else None,
        dynamic=procedure.dynamic,
        mc_rows_per_call=procedure.mc_rows_per_call,
        seed=seed,
    )
    figures = _metrics(datamodule, split, *scored, whole=max_tokens is None)
    return TextResult(
        **figures, eval_batch_size=stream.batch_size, bptt=stream.bptt, procedure=settings, max_tokens=max_tokens
    )


def _metrics(datamodule: TextData, split: str, nats: float, count: int, whole: bool = True) -> dict[str, Any]:
    """``split, corpus, tokenizer, tokens, loss, ppl``, ``unk_rate`` and ``bpc`` / ``word_ppl`` where they apply: a
    :class:`TextResult`'s figures, and a temperature search's record of the validation split.

    ``whole``: ``count`` tokens are the whole split. Of a part of it only the tokens are counted, so a part has a
    ``bpc`` only where every token is one character (the split's characters are its tokens) and no ``word_ppl``.
    """
    units = datamodule.units(split)
    if not whole:
        units = TextUnits(tokens=count, chars=count if units.chars == units.tokens else 0, words=0)
    loss = nats / count
    result: dict[str, Any] = {
        "split": split,
        "corpus": datamodule.corpus_name,
        "tokenizer": datamodule.tokenizer.kind,
        "tokens": count,
        "loss": loss,
        "ppl": math.exp(loss),
    }
    unk_id = getattr(datamodule.tokenizer, "unk_id", None)
    if unk_id is not None and whole:  # how much of the text the vocabulary does not cover (another corpus: maybe much)
        encoded = datamodule.encoded(split)
        ids = np.asarray(getattr(encoded, "ids", encoded))
        result["unk_rate"] = float(np.count_nonzero(ids == unk_id)) / max(ids.size, 1)
    figures = TEXT.figures(datamodule.level == "char", datamodule.tokenizer.kind)
    if BPC in figures and units.chars:
        result["bpc"] = nats / units.chars / math.log(2)
    if WORD_PPL in figures and units.words:  # per-word perplexity over the original text
        result["word_ppl"] = math.exp(nats / units.words)
    return result
