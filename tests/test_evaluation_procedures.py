"""The Mogrifier paper's evaluation procedures (Melis et al. 2020 §3.3, Appendix A): long context, softmax temperature
(given or searched on validation), MC dropout (batched replicas, dropout scaling) and dynamic evaluation (Krause et al.
2017), through ``evaluate`` and ``lm-zoo evaluate``."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import cli
from datamodules import TextDataModule
from datamodules.windows import IGNORE_INDEX, LMBatch, StreamWindows
from evaluation.deterministic import Deterministic, deterministic_nll
from evaluation.dynamic import (
    DynamicEvaluation,
    adapted_parameters,
    adapting,
    dynamic_nll,
    mean_squared_gradients,
)
from evaluation.mc_dropout import (
    DROPOUT_RATES,
    MCDropout,
    mc_nll,
    replica_nll,
    row_groups,
    sampled_dropout,
)
from evaluation.perplexity import evaluate
from evaluation.procedures import SCORING_PROCEDURES, chosen_by_flag, procedure_class
from evaluation.results import result_from_json
from evaluation.scoring import EvaluationSetup, Scorer, ScoringProcedure
from evaluation.temperature import collect_features, golden_section_search, total_nll
from lightning_modules import LanguageModel
from tests.conftest import one_line_error, quiet_trainer, write_word_corpus
from zoo.errors import CheckpointError
from zoo.language_model import RecurrentLM
from zoo.state import detach_state

PRETRAINED = Path(__file__).resolve().parents[1] / "pretrained"
DROPOUTS = {"input_dropout": 0.3, "inter_layer_dropout": 0.25, "output_dropout": 0.35}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """These models are tiny: one thread beats two (no OpenMP hand-offs), and much more so on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def dm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TextDataModule:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = write_word_corpus(tmp_path / "corpus", "procedures", words=25)
    return TextDataModule(str(corpus), batch_size=4, bptt=6, eval_batch_size=3, eval_bptt=7)


def _model(vocab: int, seed: int = 0, **options) -> RecurrentLM:
    torch.manual_seed(seed)
    return RecurrentLM(vocab, "lstm", **{"embedding_size": 8, "hidden_size": 12, "num_layers": 2, **options}).eval()


def _loss(scored: Iterator) -> float:
    nats, count = total_nll(scored)
    return nats / count


# ------------------------------------------------------------------------------------------------ long context
def test_long_context_is_one_stream_over_the_split(dm: TextDataModule) -> None:
    model = _model(dm.vocab_size)
    result = evaluate(model, dm, "test", bptt=9, long_context=True)
    # Independently: one forward pass over the whole split from <eos>, log-softmax summed by hand.
    ids = torch.as_tensor(dm.encoded("test"), dtype=torch.long)
    stream = torch.cat([torch.tensor([dm.tokenizer.eos_id]), ids])
    with torch.no_grad():
        logits, _ = model(stream[:-1].unsqueeze(0))
    nats = -float(torch.log_softmax(logits[0].double(), -1).gather(1, stream[1:, None]).sum())
    assert result.loss == pytest.approx(nats / ids.numel(), rel=1e-6)
    assert (result.procedure.long_context, result.eval_batch_size, result.bptt) == (True, 1, 9)
    assert result.procedure.method == "deterministic" and result.procedure.temperature == 1.0
    assert evaluate(model, dm, "test").procedure.long_context is False


# --------------------------------------------------------------------------------------------------- temperature
def test_temperature_one_and_the_feature_cache_reproduce_the_deterministic_pass(dm: TextDataModule) -> None:
    model = _model(dm.vocab_size, **DROPOUTS)
    stream = dm.stream("valid")
    cache = collect_features(model, stream)
    assert cache is not None
    for temperature in (1.0, 0.7, 1.6):  # the cache re-scores with the head: exactly the full pass's numbers
        assert cache.loss(temperature) == total_nll(deterministic_nll(model, stream, temperature))
    plain = evaluate(model, dm, "valid")
    assert evaluate(model, dm, "valid", temperature=1.0).loss == plain.loss
    assert plain.loss == cache.loss(1.0)[0] / cache.loss(1.0)[1]
    assert collect_features(model, stream, max_bytes=100) is None  # too big: the search re-runs the pass instead


def test_a_given_temperature_divides_the_logits(dm: TextDataModule) -> None:
    model = _model(dm.vocab_size)
    result = evaluate(model, dm, "test", long_context=True, temperature=0.8)
    ids = torch.as_tensor(dm.encoded("test"), dtype=torch.long)
    stream = torch.cat([torch.tensor([dm.tokenizer.eos_id]), ids])
    with torch.no_grad():
        logits, _ = model(stream[:-1].unsqueeze(0))
    log_probs = torch.log_softmax(logits[0].double() / 0.8, -1)  # softmax(z / T)
    assert result.loss == pytest.approx(-float(log_probs.gather(1, stream[1:, None]).mean()), rel=1e-6)
    assert result.procedure.temperature == 0.8 and result.procedure.temperature_search is None


def test_golden_section_search_finds_a_known_minimum() -> None:
    found = golden_section_search(lambda x: (x - 1.37) ** 2 + 3.0, 0.5, 2.0, tolerance=1e-3)
    assert found.temperature == pytest.approx(1.37, abs=1e-3)
    assert len(found.evaluations) < 25  # the bracket shrinks by 0.618 per evaluation
    at_edge = golden_section_search(lambda x: -x, 0.5, 2.0, tolerance=1e-3)  # monotone: the optimum is the end
    assert at_edge.temperature == pytest.approx(2.0, abs=1e-3)


def test_auto_temperature_recovers_a_known_optimum() -> None:
    """A model scored on text sampled from itself is calibrated: its optimal temperature is 1 (cross-entropy is a
    proper scoring rule), up to sampling noise. The same model with its logits doubled is then optimal at T = 2."""
    model = _model(30, num_layers=1)
    with torch.no_grad():
        model.decoder.weight.mul_(6)  # a peaked distribution, so the optimum is sharp
    # 8 streams of 250 tokens, each sampled from <eos> (id 0) and a zero state, scored the same way.
    samples = model.generate(torch.zeros(8, 1, dtype=torch.long), 250, generator=torch.Generator().manual_seed(1))
    tokens = torch.cat([torch.zeros(8, 1, dtype=torch.long), torch.tensor(samples)], 1)  # (8, 251)
    windows = [LMBatch(tokens[:, t : t + 50], tokens[:, t + 1 : t + 51]) for t in range(0, 250, 50)]

    def optimum(m: LanguageModel) -> float:
        cache = collect_features(m, windows)
        return golden_section_search(lambda t: cache.loss(t)[0] / cache.loss(t)[1], 0.5, 3.0, 1e-3).temperature

    calibrated = optimum(model)
    doubled = copy.deepcopy(model)
    with torch.no_grad():
        doubled.decoder.weight.mul_(2)
        doubled.decoder.bias.mul_(2)
    assert calibrated == pytest.approx(1.0, abs=0.08)
    assert optimum(doubled) == pytest.approx(2 * calibrated, abs=3e-3)  # NLL_doubled(T) = NLL(T / 2) exactly


def test_auto_temperature_is_searched_on_valid_and_applied_to_the_split(dm: TextDataModule) -> None:
    model = _model(dm.vocab_size)
    with torch.no_grad():
        model.decoder.weight.mul_(4)  # over-confident: the optimum is well above 1
    result = evaluate(model, dm, "test", temperature="auto")
    search = result.procedure.temperature_search
    assert (search["split"], search["method"], search["features_cached"]) == ("valid", "golden-section", True)
    assert 1.05 < result.procedure.temperature < 2.0
    assert search["valid"]["loss"] < search["valid_loss_at_1"]
    assert search["valid"]["loss"] == evaluate(model, dm, "valid", temperature=result.procedure.temperature).loss
    assert result.loss == evaluate(model, dm, "test", temperature=result.procedure.temperature).loss
    # Without the cache every trial re-runs the pass: the same search.
    rerun = evaluate(model, dm, "test", temperature="auto", cache_bytes=0)
    assert rerun.procedure.temperature_search["features_cached"] is False
    assert rerun.procedure.temperature == pytest.approx(result.procedure.temperature, abs=1e-9)


def test_mc_temperature_search_over_kept_features_equals_re_running_the_seeded_passes(dm: TextDataModule) -> None:
    model = _model(dm.vocab_size, **DROPOUTS, embedding_dropout=0.1)
    mc = MCDropout(samples=4)
    cached = evaluate(model, dm, "valid", temperature="auto", procedure=mc, seed=7)
    rerun = evaluate(model, dm, "valid", temperature="auto", procedure=mc, seed=7, cache_bytes=0)
    assert (
        cached.procedure.temperature_search["features_cached"]
        and not rerun.procedure.temperature_search["features_cached"]
    )
    assert cached.procedure.temperature == pytest.approx(rerun.procedure.temperature, abs=1e-9)
    assert cached.loss == pytest.approx(rerun.loss, rel=1e-6)
    fixed = evaluate(model, dm, "valid", temperature=cached.procedure.temperature, procedure=mc, seed=7)
    assert cached.loss == pytest.approx(fixed.loss, rel=1e-6)  # the same masks: common random numbers


# -------------------------------------------------------------------------------------------------- MC dropout
def _hand_mc(model: LanguageModel, stream: StreamWindows, samples: int, seed: int) -> list[torch.Tensor]:
    """N sampled passes, each with its own carried state, averaged in probability space: the definition, by hand.

    Window-major (every replica takes window k before any takes k + 1) so that with the same seed the masks are drawn
    in the order the batched evaluator draws them when it runs one replica per call.
    """
    out = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model.train()
        states = [None] * samples
        for batch in stream:
            probs = []
            for n in range(samples):
                nll, state = model.token_nll(batch.inputs, batch.targets, states[n], batch.reset)
                states[n] = detach_state(state)
                probs.append(torch.exp(-nll.double()))
            nll = -torch.log(torch.stack(probs).mean(0))
            out.append(nll.masked_fill(batch.targets == IGNORE_INDEX, 0.0))
        model.eval()
    return out


def test_mc_equals_separate_sampled_passes_given_the_same_masks(dm: TextDataModule) -> None:
    # Every per-element, per-row and per-call dropout (word-level embedding dropout draws per row under MC, not per
    # call as training does, so it is left out of this bit-for-bit comparison and checked below).
    model = _model(dm.vocab_size, **DROPOUTS, cell_options={"state_dropout": 0.2, "weight_drop": 0.3})
    stream = dm.stream("test")
    calls = []
    model.rnn.register_forward_hook(lambda *args: calls.append(1))
    settings = MCDropout(samples=4, rows_per_call=stream.batch_size)  # one replica of each stream per call
    batched = [nll for nll, _ in mc_nll(model, stream, settings, seed=3)]
    assert len(calls) == 4 * len(stream)  # weight drop: a call's rows share its mask, so replicas get their own calls
    hand = _hand_mc(model, stream, samples=4, seed=3)
    for ours, theirs in zip(batched, hand, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
    assert _loss((nll, b.targets) for nll, b in zip(hand, stream)) != evaluate(model, dm, "test").loss


def test_mc_is_one_batched_call_per_window_and_agrees_with_separate_passes(dm: TextDataModule) -> None:
    rates = {"input_dropout": 0.5, "inter_layer_dropout": 0.5, "output_dropout": 0.5, "embedding_dropout": 0.1}
    model = _model(dm.vocab_size, **rates)
    with torch.no_grad():
        model.decoder.weight.mul_(6)  # peaked predictions, so that dropout moves them a lot
    stream = dm.stream("test")
    samples = 24
    calls = []
    model.rnn.register_forward_hook(lambda *args: calls.append(1))
    batched = list(replica_nll(model, stream, MCDropout(samples), seed=1))
    assert len(calls) == len(stream)  # B x N rows in one forward call per window
    calls.clear()
    hand_passes = []  # N separate passes, each a full sampled pass with its own seed
    for n in range(samples):
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(100 + n)
            model.train()
            hand_passes.append([nll for nll, _ in deterministic_nll(model, stream)])
            model.eval()
    assert len(calls) == samples * len(stream)

    def predicted_probs(per_window: list[torch.Tensor]) -> torch.Tensor:  # (N, tokens)
        mask = torch.cat([b.targets.flatten() != IGNORE_INDEX for b in stream])
        return torch.exp(-torch.cat([w.reshape(samples, -1) for w in per_window], 1).double())[:, mask]

    def estimate(p: torch.Tensor) -> tuple[float, float]:
        """MC loss -mean_t log mean_n p_tn and its standard error (delta method, replicas i.i.d.)."""
        mean = p.mean(0)
        per_replica = (p / mean).mean(1)  # (N,) each replica's share of the estimate
        return float(-mean.log().mean()), float(per_replica.std() / math.sqrt(p.size(0)))

    ours, ours_se = estimate(predicted_probs([nll for nll, _ in batched]))
    hand_probs = predicted_probs([torch.stack([h[w] for h in hand_passes]) for w in range(len(stream))])
    theirs, theirs_se = estimate(hand_probs)
    se = math.hypot(ours_se, theirs_se)
    assert abs(ours - theirs) < 4 * se
    # The check has power: replicas that shared their masks would score like one sample, which is far off.
    one_sample = float(-hand_probs.log().mean())
    assert one_sample - theirs > 10 * se
    # And the log-mean-exp over the batched replicas is the evaluator's number.
    assert _loss(mc_nll(model, stream, MCDropout(samples), seed=1)) == pytest.approx(ours, rel=1e-9)


@pytest.mark.parametrize("how", ["no dropout", "scale 0"])
def test_mc_without_dropout_reproduces_the_deterministic_result(dm: TextDataModule, how: str) -> None:
    options = {} if how == "no dropout" else {**DROPOUTS, "embedding_dropout": 0.1}
    model = _model(dm.vocab_size, **options)
    mc = MCDropout(samples=5, dropout_scale=0.0 if how == "scale 0" else 1.0)
    result = evaluate(model, dm, "test", procedure=mc)
    assert result.loss == pytest.approx(evaluate(model, dm, "test").loss, rel=1e-6)
    assert (
        result.procedure.method,
        result.procedure.recorded["mc_samples"],
        result.procedure.run_record["mc_rows_per_call"],
    ) == (
        "mc-dropout",
        5,
        15,
    )


def test_sampled_dropout_scales_every_rate_and_restores_the_model_exactly(dm: TextDataModule) -> None:
    model = _model(dm.vocab_size, **DROPOUTS, embedding_dropout=0.1, cell_options={"state_dropout": 0.2})
    before = evaluate(model, dm, "test").loss
    modes = {name: m.training for name, m in model.named_modules()}
    with sampled_dropout(model, 0.5):
        assert (model.input_dropout, model.rnn.dropout, model.rnn.state_dropout) == (0.15, 0.125, 0.1)
        assert model.embedding_dropout == 0.0  # drawn per row by a hook instead (next test)
        assert model.training and model.rnn.training and not model.rnn.layers[0].training
    with pytest.raises(RuntimeError), sampled_dropout(model, 2.0):
        raise RuntimeError("an error inside")
    assert (model.input_dropout, model.rnn.dropout, model.embedding_dropout) == (0.3, 0.25, 0.1)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert not model.embedding._forward_hooks
    assert evaluate(model, dm, "test").loss == before
    with pytest.raises(Exception, match="dropout scale 3.0"):  # 0.35 x 3 >= 1
        evaluate(model, dm, "test", procedure=MCDropout(2, dropout_scale=3.0))


def test_word_dropout_is_drawn_per_row_under_mc() -> None:
    model = _model(50, embedding_dropout=0.5)
    ids = torch.tensor([[3, 7, 3, 9, 7, 3] * 5] * 2)  # two identical rows
    with sampled_dropout(model), torch.no_grad():
        torch.manual_seed(0)
        embedded = model.embedding(ids)  # (2, 30, E)
    plain = model.embedding(ids).detach()
    factor = (embedded / plain)[..., 0]  # (2, 30): 0 or 1 / (1 - p) per position
    assert set(factor.unique().tolist()) <= {0.0, 2.0}
    for row in range(2):
        for word in (3, 7, 9):
            assert factor[row][ids[row] == word].unique().numel() == 1  # every occurrence shares its word's draw
    assert not torch.equal(factor[0], factor[1])  # rows draw independently (2^-3 chance of equal per draw: seeded)


def test_every_dropout_rate_in_the_model_is_known_to_mc_dropout() -> None:
    model = RecurrentLM(
        40,
        "lstm",
        embedding_size=8,
        hidden_size=8,
        head="mos",
        mos_components=2,
        mos_dropout=0.1,
        embedding_dropout=0.1,
        **DROPOUTS,
        cell_options={"state_dropout": 0.1, "weight_drop": 0.1},
    )
    for module in model.modules():
        rates = {k for k, v in vars(module).items() if "drop" in k and isinstance(v, float)}
        known = {name for kind, names in DROPOUT_RATES.items() if isinstance(module, kind) for name in names}
        assert rates <= known, f"{type(module).__name__} has dropout rates MC dropout would not sample: {rates - known}"


def test_row_groups() -> None:
    assert row_groups(3, 4, 1024, per_replica=False) == [(0, 12)]
    assert row_groups(3, 4, 5, per_replica=False) == [(0, 5), (5, 10), (10, 12)]
    assert row_groups(3, 2, 1024, per_replica=True) == [(0, 3), (3, 6)]
    assert row_groups(3, 2, 2, per_replica=True) == [(0, 2), (2, 3), (3, 5), (5, 6)]


# ------------------------------------------------------------------------------------------ dynamic evaluation
def _dynamic(**kw) -> DynamicEvaluation:
    return DynamicEvaluation(**{"max_time_steps": 6, "stat_batches": 4, "stat_batch_size": 8, **kw})


@pytest.mark.parametrize("decay", [0.0, 0.01])
def test_dynamic_with_learning_rate_zero_reproduces_the_deterministic_result(dm: TextDataModule, decay: float) -> None:
    model = _model(dm.vocab_size, **DROPOUTS)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    result = evaluate(model, dm, "test", procedure=_dynamic(learning_rate=0.0, decay_rate=decay))
    plain = evaluate(model, dm, "test", batch_size=1, bptt=6)
    assert result.loss == pytest.approx(plain.loss, rel=1e-6)
    assert tuple(result.procedure.recorded) == DynamicEvaluation.records
    assert (result.procedure.method, result.eval_batch_size, result.bptt, result.procedure.long_context) == (
        "dynamic",
        1,
        6,
        True,
    )
    assert (
        result.procedure.recorded["dynamic"]["stat_batches_used"] == 4
        and result.procedure.recorded["dynamic"]["stat_tokens"] == 4 * 8 * 6
    )
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())


def test_dynamic_evaluation_takes_its_gradients_without_cudnn(dm: TextDataModule, monkeypatch) -> None:
    """cuDNN refuses an RNN's backward in eval mode: every gradient pass (statistics and adaptation) runs without it,
    and scoring without gradients is left to it."""
    model = _model(dm.vocab_size)
    seen: list[tuple[bool, bool]] = []
    token_nll = model.token_nll

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((torch.is_grad_enabled(), torch.backends.cudnn.enabled))
        return token_nll(*args, **kwargs)

    monkeypatch.setattr(model, "token_nll", recording)
    evaluate(model, dm, "test", procedure=_dynamic())
    assert seen and all(not cudnn for grad, cudnn in seen if grad)
    assert torch.backends.cudnn.enabled  # restored


def test_dynamic_evaluation_is_causal(dm: TextDataModule) -> None:
    """Changing the text after position t never changes the score of tokens <= t, with real adaptation."""
    model = _model(dm.vocab_size, **DROPOUTS)
    statistics = mean_squared_gradients(model, dm.stream("train", batch_size=8, bptt=6), 4)
    ids = torch.as_tensor(dm.encoded("valid"), dtype=torch.long)[:120]
    changed = ids.clone()
    t = 62  # inside the 11th segment of 6
    changed[t + 1 :] = torch.randint(
        0, dm.vocab_size, (ids.numel() - t - 1,), generator=torch.Generator().manual_seed(0)
    )
    assert not torch.equal(changed[t + 1 :], ids[t + 1 :])

    def scores(text: torch.Tensor, learning_rate: float) -> torch.Tensor:
        stream = StreamWindows(text, batch_size=1, bptt=6, start_id=dm.tokenizer.eos_id)
        with adapting(model, statistics, _dynamic(learning_rate=learning_rate, decay_rate=1e-3)) as adaptation:
            return torch.cat([nll[0] for nll, _ in dynamic_nll(model, stream, adaptation)])  # (tokens,)

    original, edited = scores(ids, 1e-2), scores(changed, 1e-2)
    assert torch.equal(original[: t + 1], edited[: t + 1])
    assert not torch.equal(original[t + 1 :], edited[t + 1 :])
    frozen = scores(ids, 0.0)
    assert torch.equal(original[:6], frozen[:6])  # the first segment is scored before any step
    assert (original[6:] - frozen[6:]).abs().max() > 1e-3  # and the model does adapt after it


def test_dynamic_update_is_krause_rms_rule(dm: TextDataModule) -> None:
    """MS and two steps of θ ← θ − η g / (sqrt(MS) + ε) + min(1, λ sqrt(MS) / mean sqrt(MS)) (θ0 − θ), by hand."""
    model = _model(dm.vocab_size)
    train = dm.stream("train", batch_size=4, bptt=5)
    statistics = mean_squared_gradients(model, train, max_batches=3)
    params = dict(model.named_parameters())
    ms = {name: torch.zeros_like(p) for name, p in params.items()}
    state = None
    for _, batch in zip(range(3), train):
        nll, state = model.token_nll(batch.inputs, batch.targets, state)
        loss = nll.sum() / (batch.targets != IGNORE_INDEX).sum()
        for name, grad in zip(params, torch.autograd.grad(loss, list(params.values()))):
            ms[name] += grad**2 / 3
        state = detach_state(state)
    for name in params:
        torch.testing.assert_close(statistics.mean_squared[name], ms[name])

    lr, decay, eps = 0.05, 0.5, 1e-3
    rms = {name: ms[name].sqrt() for name in params}
    mean_rms = sum(r.sum() for r in rms.values()) / sum(r.numel() for r in rms.values())
    d = {name: torch.clamp(decay * rms[name] / mean_rms, max=1.0) for name in params}
    assert any((x == 1).any() for x in d.values()) and any((x < 1).any() for x in d.values())  # the clip matters
    segments = list(StreamWindows(torch.as_tensor(dm.encoded("valid"))[:12], 1, 6, start_id=dm.tokenizer.eos_id))
    theta0 = {name: p.detach().clone() for name, p in params.items()}
    with adapting(model, statistics, DynamicEvaluation(lr, decay, eps)) as adaptation:
        list(dynamic_nll(model, segments, adaptation))
        adapted = {name: p.detach().clone() for name, p in params.items()}
    assert all(torch.equal(p, theta0[name]) for name, p in params.items())  # restored

    reference = copy.deepcopy(model)
    ref_params = dict(reference.named_parameters())
    theta, state = theta0, None
    for segment in segments:
        with torch.no_grad():
            for name, p in ref_params.items():
                p.copy_(theta[name])
        nll, state = reference.token_nll(segment.inputs, segment.targets, state)
        grads = torch.autograd.grad(nll.mean(), list(ref_params.values()))
        state = detach_state(state)
        theta = {
            name: theta[name] - lr * g / (rms[name] + eps) + d[name] * (theta0[name] - theta[name])
            for name, g in zip(ref_params, grads)
        }
    for name in params:
        torch.testing.assert_close(adapted[name], theta[name], rtol=1e-5, atol=1e-7)
    assert not torch.equal(adapted["decoder.weight"], theta0["decoder.weight"])


def test_dynamic_tuning_reports_its_trials_and_keeps_the_best(dm: TextDataModule) -> None:
    model = _model(dm.vocab_size)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    given = _dynamic(learning_rate=1e-4)
    result = evaluate(model, dm, "valid", procedure=replace(given, tune_trials=3), seed=5)
    trials = result.procedure.recorded["dynamic"]["tuning"]["trials"]
    assert len(trials) == 3 and trials[0]["learning_rate"] == 1e-4 and trials[0]["max_time_steps"] == 6
    best = min(trials, key=lambda trial: trial["loss"])
    assert result.loss == best["loss"] == result.procedure.recorded["dynamic"]["tuning"]["best_valid_loss"]
    assert result.procedure.recorded["dynamic"]["learning_rate"] == best["learning_rate"]
    assert result.bptt == best["max_time_steps"]
    for trial in trials[1:]:  # drawn from Table 6
        assert 1e-6 <= trial["learning_rate"] <= 1e-3 and 1e-6 <= trial["decay_rate"] <= 1e-2
        assert 1e-8 <= trial["epsilon"] <= 1e-2 and 1 <= trial["max_time_steps"] <= 20
    again = evaluate(model, dm, "valid", procedure=replace(given, tune_trials=3), seed=5)
    assert again.procedure.recorded["dynamic"]["tuning"]["trials"] == trials  # seeded
    # Trials on a prefix of validation (Krause's --gridfast); the result then scores the whole split.
    prefix = evaluate(model, dm, "valid", procedure=replace(given, tune_trials=2, tune_tokens=100))
    assert 100 <= prefix.procedure.recorded["dynamic"]["tuning"]["valid_tokens"] < 100 + 20
    assert prefix.tokens == result.tokens == dm.units("valid").tokens
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert adapted_parameters(model).keys() == dict(model.named_parameters()).keys()


# ----------------------------------------------------------------------------------------------------- the CLI
class _Trainable(LanguageModel):
    """The model as ``lm-zoo fit`` trains it (LightningCLI supplies the optimizer there)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("procedures_cli")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LM_ZOO_CACHE", str(root / "cache"))
        corpus = write_word_corpus(root / "corpus", "cli", words=25)
        data = TextDataModule(str(corpus), batch_size=4, bptt=6, eval_batch_size=3, eval_bptt=7)
        torch.manual_seed(0)
        model = _Trainable(data.vocab_size, "lstm", embedding_size=8, hidden_size=12, num_layers=2, dropout=0.2)
        trainer = quiet_trainer(max_steps=3, limit_val_batches=0)
        trainer.fit(model, data)
        trainer.save_checkpoint(root / "tiny.ckpt")
        yield root / "tiny.ckpt"


def _run(capsys: pytest.CaptureFixture[str], checkpoint: Path, *flags: str) -> dict:
    assert cli.main(["evaluate", str(checkpoint), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_runs_every_procedure(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LM_ZOO_CACHE", str(checkpoint.parent / "cache"))
        plain = _run(capsys, checkpoint)
        assert (plain["method"], plain["eval_batch_size"], plain["bptt"], plain["temperature"]) == (
            "deterministic",
            3,
            7,
            1.0,
        )
        auto = _run(capsys, checkpoint, "--temperature", "auto", "--long-context")
        assert auto["long_context"] and auto["temperature_search"]["split"] == "valid"
        assert 0.5 <= auto["temperature"] <= 2.0
        mc = _run(capsys, checkpoint, "--mc-samples", "3", "--dropout-scale", "0.5", "--mc-batch", "4", "--seed", "2")
        assert (mc["method"], mc["mc_samples"], mc["dropout_scale"], mc["mc_rows_per_call"], mc["seed"]) == (
            "mc-dropout",
            3,
            0.5,
            4,
            2,
        )
        flags = ("--dynamic", "--dyn-lr", "1e-4", "--dyn-max-time-steps", "5", "--dyn-stat-batches", "2")
        dynamic = _run(capsys, checkpoint, *flags, "--dyn-stat-batch-size", "4", "--split", "valid")
        assert dynamic["dynamic"]["learning_rate"] == 1e-4 and dynamic["dynamic"]["stat_tokens"] == 2 * 4 * 5
        assert (dynamic["bptt"], dynamic["eval_batch_size"], dynamic["dynamic"]["tuning"]) == (5, 1, None)
        tune = ("--tune", "--tune-trials", "2", "--tune-tokens", "150")
        tuned = _run(capsys, checkpoint, *flags, "--dyn-stat-batch-size", "4", *tune)
        assert len(tuned["dynamic"]["tuning"]["trials"]) == 2 and tuned["dynamic"]["tuning"]["valid_tokens"] >= 150
        # The human-readable line names the settings.
        assert cli.main(["evaluate", str(checkpoint), "--mc-samples", "2", "--temperature", "0.9"]) == 0
        line = capsys.readouterr().out
        assert "ppl" in line and "MC dropout 2 samples" in line and "temperature 0.9" in line


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--temperature", "abc"], "--temperature must be a number > 0 or 'auto', got 'abc'"),
        (["--temperature", "0"], "--temperature must be"),
        (["--mc-samples", "0"], "--mc-samples must be an integer >= 1, got '0'"),
        (["--mc-samples", "x"], "--mc-samples must be an integer"),
        (["--dropout-scale", "-1", "--mc-samples", "2"], "--dropout-scale must be a number >= 0"),
        (["--dropout-scale", "0.5"], "--dropout-scale applies only with --mc-samples N"),
        (["--dyn-lr", "1e-3"], "--dyn-lr applies only with --dynamic"),
        (["--tune"], "--tune applies only with --dynamic"),
        (["--dynamic", "--tune-trials", "3"], "--tune-trials applies only with --tune"),
        (["--dynamic", "--tune-tokens", "300"], "--tune-tokens applies only with --tune"),
        (["--dynamic", "--batch-size", "4"], "batch size 1"),
        (["--dynamic", "--bptt", "4"], "--dyn-max-time-steps"),
        (["--dynamic", "--mc-samples", "2"], "--dynamic with --mc-samples is not supported"),
        (["--long-context", "--batch-size", "3"], "drop --batch-size 3"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--dynamic", "--dyn-max-time-steps", "0"], "--dyn-max-time-steps must be an integer >= 1"),
    ],
)
def test_cli_bad_procedure_settings_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], fragment: str
) -> None:
    # Checked before the checkpoint is read: the source need not exist.
    one_line_error(capsys, cli.main(["evaluate", str(tmp_path / "none.ckpt"), *flags]), fragment)


def test_procedures_take_their_flags_as_data_without_a_parser() -> None:
    """A procedure reads the flags given, by name (the command layer parses them from the procedures' ``flags``): its
    own alone, its settings from their values, ``--tune`` with its default number of trials."""
    from evaluation.dynamic import DEFAULT_TUNE_TRIALS, DynamicEvaluation
    from evaluation.mc_dropout import MCDropout

    assert MCDropout.from_flags({"--mc-samples": 5, "--mc-batch": 64}) == MCDropout(5, 1.0, 64)
    assert MCDropout.from_flags({"--dynamic": True}) is None
    assert DynamicEvaluation.from_flags({"--dynamic": True, "--dyn-lr": 1e-4}) == DynamicEvaluation(learning_rate=1e-4)
    assert DynamicEvaluation.from_flags({"--dynamic": True, "--tune": True}).tune_trials == DEFAULT_TUNE_TRIALS
    assert DynamicEvaluation.from_flags({"--dynamic": True, "--tune": True, "--tune-trials": 3}).tune_trials == 3
    for procedure in (MCDropout, DynamicEvaluation):
        assert procedure.flags[0].name == procedure.flag
        assert all(flag.setting in (None, *procedure.__dataclass_fields__) for flag in procedure.flags)


def test_cli_dropout_scale_too_large_for_the_model(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LM_ZOO_CACHE", str(checkpoint.parent / "cache"))
        code = cli.main(["evaluate", str(checkpoint), "--mc-samples", "2", "--dropout-scale", "5"])
    one_line_error(capsys, code, "dropout scale 5.0", "use a smaller --dropout-scale")


# ------------------------------------------------------------------------------------- what a procedure records
class _Hotter(ScoringProcedure):
    """A procedure of the tests' own, to hold what a new one needs: its module and a line in SCORING_PROCEDURES. It is
    the deterministic pass at ``factor`` times the temperature, and records the factor under a key of its own."""

    method = "hotter"
    records = ("hotter_factor",)

    def __init__(self, factor: float = 2.0) -> None:
        self.factor = factor

    @classmethod
    def summary(cls, record: Mapping[str, Any]) -> list[str]:
        return [f"{record['hotter_factor']}x hotter"]

    def prepare(self, setup: EvaluationSetup) -> Scorer:
        plain = Deterministic().prepare(setup)
        return Scorer(
            lambda windows, t: plain.score(windows, t * self.factor), plain.steps, record={"hotter_factor": self.factor}
        )


# The keys of every stored text result, in the order the shipped config.json files spell them.
STORED_LAYOUT = ["split", "corpus", "tokenizer", "tokens", "loss", "ppl", "eval_batch_size", "bptt", "method"]
STORED_LAYOUT += ["long_context", "temperature", "temperature_search", "mc_samples", "dropout_scale", "dynamic"]


def test_the_table_names_each_procedure_by_its_method() -> None:
    for method in SCORING_PROCEDURES:
        assert procedure_class(method).method == method
    assert [kind.flag for kind in chosen_by_flag()] == ["--mc-samples", "--dynamic"]
    with pytest.raises(CheckpointError, match="'hotter', which this lm-zoo does not know"):
        procedure_class("hotter")


def test_results_store_the_layout_every_shipped_result_spells(dm: TextDataModule) -> None:
    model = _model(dm.vocab_size, **DROPOUTS)
    plain = evaluate(model, dm, "test")
    assert list(plain.to_json(stored=True)) == STORED_LAYOUT
    for config in sorted(PRETRAINED.glob("*/config.json")):  # text results only (music ones have no procedure)
        for shipped in json.loads(config.read_text())["results"]:
            assert "method" not in shipped or [key for key in shipped if key != "bpc"] == STORED_LAYOUT, config
    assert plain.procedure.recorded == {} and plain.procedure.summary() == "deterministic"
    # MC dropout's keys take their place in it; its batching is printed, never stored.
    mc = evaluate(model, dm, "test", procedure=MCDropout(samples=2, rows_per_call=3), seed=4)
    stored = mc.to_json(stored=True)
    assert list(stored) == STORED_LAYOUT and (stored["mc_samples"], stored["dropout_scale"]) == (2, 1.0)
    assert (tuple(mc.procedure.recorded), tuple(mc.procedure.run_record)) == (MCDropout.records, MCDropout.run_records)
    printed = mc.to_json()
    assert [key for key in printed if key not in stored][:2] == ["mc_rows_per_call", "seed"]
    assert (printed["mc_rows_per_call"], printed["seed"]) == (3, 4)
    for result in (plain, mc):
        assert result_from_json(result.to_json()) == result
        again = result_from_json(result.to_json(stored=True))
        assert again.procedure.recorded == result.procedure.recorded and again.procedure.run_record == {}
    assert mc.procedure.summary() == "mc-dropout, 2 samples, dropout scale 1.0"
    assert "MC dropout 2 samples, dropout scale 1, seed 4" in mc.procedure.details()


def test_a_new_procedure_records_and_words_its_own_settings(
    dm: TextDataModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(SCORING_PROCEDURES, "hotter", f"{__name__}:_Hotter")
    model = _model(dm.vocab_size)
    hotter = evaluate(model, dm, "test", procedure=_Hotter())
    assert hotter.loss == evaluate(model, dm, "test", temperature=2.0).loss
    stored = hotter.to_json(stored=True)
    assert list(stored) == [*STORED_LAYOUT, "hotter_factor"] and stored["hotter_factor"] == 2.0
    assert "hotter_factor" not in evaluate(model, dm, "test").to_json()
    assert result_from_json(stored).procedure.recorded == {"hotter_factor": 2.0}
    assert hotter.procedure.summary() == "hotter, 2.0x hotter"
    monkeypatch.delitem(SCORING_PROCEDURES, "hotter")  # a result of a procedure this lm-zoo does not have
    with pytest.raises(CheckpointError, match="scored by 'hotter'"):
        result_from_json(stored)
