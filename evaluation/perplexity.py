"""Evaluation of a language model over a whole split: the numbers ``lm-zoo evaluate`` reports.

The procedures of the Mogrifier paper (Melis et al. 2020 §3.3, Appendix A), each recorded in the result:

* **deterministic** (dropout off, :mod:`evaluation.deterministic`), the default, at an eval batch size and BPTT that
  the result records (each of the B streams starts without context, so perplexity depends on them); ``long_context``:
  one stream over the whole split;
* **softmax temperature**: a given one, or ``"auto"``: the one minimising validation cross-entropy
  (:mod:`evaluation.temperature`), then applied to the requested split;
* **MC dropout**: predictions averaged over sampled dropout masks in probability space, dropout rates optionally
  scaled (:mod:`evaluation.mc_dropout`);
* **dynamic evaluation** (Krause et al. 2017): the weights adapt to the text as it is read, hyperparameters optionally
  tuned on validation over Table 6's ranges (:mod:`evaluation.dynamic`).

Each procedure is a :class:`~evaluation.scoring.ScoringProcedure` (its flags, checks and scorer in its own module), and
:func:`evaluate` runs any of them the same way. The loops are written out rather than run through ``Trainer.test`` so
that the result carries exact counts (summed in float64) and every setting perplexity depends on. Every procedure scores
through ``RecurrentLM.token_nll`` (the full softmax, whatever the training head); the temperature search re-scores kept
features through the head's own ``token_nll``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from datamodules.kinds import BPC, TEXT, WORD_PPL, bits_per_character
from datamodules.progress import Progress
from datamodules.text_data import TextData
from datamodules.tokenizers import TextUnits
from datamodules.windows import LMBatch
from evaluation.deterministic import Deterministic
from evaluation.results import ProcedureSettings, TextResult
from evaluation.scoring import EvaluationSetup, Scorer, ScoringProcedure, first_tokens
from evaluation.temperature import (
    CACHE_BYTES,
    TEMPERATURE_RANGE,
    TEMPERATURE_TOLERANCE,
    collect_features,
    golden_section_search,
)
from zoo.errors import ConfigError
from zoo.language_model import RecurrentLM

AUTO = "auto"


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
    procedure: ScoringProcedure | None = None,
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
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {max_tokens}")
    if procedure is not None:
        procedure.check(batch_size, bptt)


def _windows(datamodule: TextData, split: str, batch_size: int, steps: int) -> Progress:
    """A split's windows at the evaluation's batch size, with progress shown under the split's name."""
    return Progress(datamodule.stream(split, batch_size=batch_size, bptt=steps), split)


def _search_temperature(
    model: RecurrentLM,
    datamodule: TextData,
    valid: Iterable[LMBatch],
    scorer: Scorer,
    temperature_range: tuple[float, float],
    cache_bytes: int,
) -> tuple[float, dict[str, Any], tuple[float, int]]:
    """The temperature minimising validation cross-entropy (golden-section search).

    Returns:
        The temperature, the result's ``temperature_search`` record, and the validation nats and tokens at it.
    """
    features = scorer.features
    cache = collect_features(model, valid, cache_bytes, features) if features is not None else None
    seen: dict[float, tuple[float, int]] = {}

    def objective(t: float) -> float:
        seen[t] = cache.loss(t) if cache is not None else scorer.score(valid, t)
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
    procedure: ScoringProcedure | None = None,
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
        procedure: how to score, one of :data:`evaluation.procedures.SCORING_PROCEDURES`
            (:class:`~evaluation.mc_dropout.MCDropout`,
            :class:`~evaluation.dynamic.DynamicEvaluation`, tuned on validation or not);
            ``None``: the deterministic pass.
        max_tokens: score ``split`` only up to the window holding its this-many-th predicted token
            (:func:`~evaluation.scoring.first_tokens`): a fixed part of it, quick to re-measure (a
            registered model's check figure); ``None``: the whole split. What is tuned or searched on validation
            first still reads all it reads.
        seed: seeds the MC masks and the tuning draws.
        temperature_range: the bracket of the temperature search.
        cache_bytes: most memory kept for the temperature search's features (beyond it, each trial re-runs).

    Returns:
        The figures (loss in mean nats per token, ppl, and bpc / word_ppl where
        :func:`datamodules.kinds.text_figures` reports them) with the eval batch size, BPTT and every setting of the
        procedure (:class:`~evaluation.results.ProcedureSettings`: the temperature and how an
        ``auto`` one was found, MC dropout's samples, dynamic evaluation's settings, statistics and tuning trials).

    Raises:
        ConfigError: settings that cannot work together (:func:`check_settings`).
    """
    check_settings(batch_size, bptt, long_context, temperature, procedure, max_tokens)
    procedure = procedure or Deterministic()
    temperature = parse_temperature(temperature)
    # Every split is scored at the evaluation sizes, the training split too (its stream would default to training's).
    batch_size, bptt = batch_size or datamodule.eval_batch_size, bptt or datamodule.eval_bptt
    model.eval().to(device)
    if long_context or procedure.one_stream:
        batch_size = 1
    fixed_temperature = 1.0 if temperature == AUTO else float(temperature)
    scorer = procedure.prepare(EvaluationSetup(model, datamodule, split, batch_size, bptt, seed, fixed_temperature))

    scored: tuple[float, int] | None = None
    search: dict[str, Any] | None = None
    if temperature == AUTO:
        valid = _windows(datamodule, "valid", batch_size, scorer.steps)
        temperature, search, at_found = _search_temperature(
            model, datamodule, valid, scorer, temperature_range, cache_bytes
        )
        if split == "valid" and max_tokens is None:
            scored = at_found
    elif scorer.scored_valid is not None and max_tokens is None and split == "valid":
        scored = scorer.scored_valid  # preparing the procedure scored this very evaluation already

    stream = _windows(datamodule, split, batch_size, scorer.steps)
    if scored is None:
        scored = scorer.score(first_tokens(stream, max_tokens), float(temperature))
    settings = ProcedureSettings(
        method=procedure.method,
        long_context=batch_size == 1,
        temperature=float(temperature),
        temperature_search=search,
        recorded=scorer.record,
        run_record=scorer.run_record,
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
        result["bpc"] = bits_per_character(nats, units.chars)
    if WORD_PPL in figures and units.words:  # per-word perplexity over the original text
        result["word_ppl"] = math.exp(nats / units.words)
    return result
