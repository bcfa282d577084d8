"""The LanguageModel's regularisers and heads: embedding / locked dropout, AR and TAR by hand, dropout off in eval,
the dropout options' mapping, the input embedding ratio, and a MoS model scored and trained by the softmax's code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from datamodules.windows import IGNORE_INDEX, LMBatch, StreamWindows
from lightning_modules import LanguageModel
from tests.conftest import write_word_corpus
from zoo.errors import ConfigError
from zoo.language_model import embedding_dropout

V = 13


def _model(**kw) -> LanguageModel:
    torch.manual_seed(0)
    options = {"embedding_size": 6, "hidden_size": 8, "num_layers": 2, **kw}
    return LanguageModel(V, "lstm", **options)


def _batch(batch_size: int = 3, bptt: int = 6, seed: int = 1) -> LMBatch:
    ids = torch.randint(0, V, (200,), generator=torch.Generator().manual_seed(seed))
    return next(iter(StreamWindows(ids, batch_size=batch_size, bptt=bptt, start_id=0)))


def _capture(module: torch.nn.Module, output: bool = False) -> list[Tensor]:
    """The first input (or the output's first element) of each call of ``module``."""
    seen: list[Tensor] = []
    if output:
        module.register_forward_hook(lambda m, args, out: seen.append(out[0] if isinstance(out, tuple) else out))
    else:
        module.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    return seen


def test_embedding_dropout_zeroes_whole_words_and_scales_the_rest() -> None:
    torch.manual_seed(3)
    ids = torch.randint(0, 5, (4, 30))  # every id occurs many times
    embedded = torch.randn(5, 7)[ids]  # (B, T, E), the same vector at every occurrence of an id
    dropped = embedding_dropout(ids, embedded, 0.4, 5)
    kept = dropped != 0
    for word in range(5):
        rows = kept[ids == word]  # (occurrences, E)
        assert rows.all() or not rows.any()  # a word is dropped everywhere in the batch or nowhere
    assert kept.any() and (~kept).any()
    torch.testing.assert_close(dropped[kept], embedded[kept] / 0.6)


def test_model_embedding_dropout_and_locked_dropout_masks() -> None:
    model = _model(embedding_dropout=0.5, input_dropout=0.5, output_dropout=0.5, locked_dropout=True).train()
    stack_inputs, head_inputs = _capture(model.model.rnn), _capture(model.model.decoder)
    batch = _batch(bptt=20)
    model(batch.inputs)
    x, y = stack_inputs[-1], head_inputs[-1]
    # Input: a unit is zero where its word was dropped (the whole vector) or where the sequence's locked mask
    # dropped it (the same units at every step), nowhere else.
    dropped_words = (x == 0).all(-1)  # (B, T)
    locked = (x == 0).all(1)  # (B, E): units zero at every step
    assert dropped_words.any() and locked.any()
    assert ((x == 0) == (locked.unsqueeze(1) | dropped_words.unsqueeze(-1))).all()
    # Output: the same units are zero at every step.
    assert (y == 0).any() and ((y == 0) == (y == 0)[:, :1]).all()
    # The whole-word mask: every occurrence of an id is dropped, or none.
    for word in batch.inputs.unique():
        where = dropped_words[batch.inputs == word]
        assert where.all() or not where.any()
    # The stack's inter-layer dropout is locked too.
    assert model.model.rnn.locked_dropout


def test_ar_and_tar_equal_their_formulas() -> None:
    model = _model(dropout=0.3, ar=2.0, tar=1.0, cell_options={"weight_drop": 0.5}).train()
    raws, dropped, logits = (
        _capture(model.model.rnn, output=True),
        _capture(model.model.decoder),
        _capture(model.model.decoder, True),
    )
    batch = _batch()
    loss = model.training_step(batch, 0)["loss"]
    raw, out = raws[-1], dropped[-1]  # the last layer's output before / after output dropout
    assert not torch.equal(raw, out)
    nll = torch.nn.functional.cross_entropy(logits[-1].flatten(0, 1), batch.targets.flatten())
    ar = 2.0 * (out**2).sum() / out.numel()
    tar = 1.0 * ((raw[:, 1:] - raw[:, :-1]) ** 2).sum() / raw[:, 1:].numel()
    torch.testing.assert_close(loss, nll + ar + tar)


def test_tar_leaves_out_pairs_across_a_reset() -> None:
    model = _model(tar=0.5)
    raw = torch.randn(2, 5, 4)
    reset = torch.zeros(2, 5, dtype=torch.bool)
    reset[0, 2] = True  # stream 0: the pair (step 1, step 2) straddles two sequences
    total, pairs = 0.0, 0
    for b in range(2):
        for t in range(1, 5):
            if not reset[b, t]:
                total += float(((raw[b, t] - raw[b, t - 1]) ** 2).sum())
                pairs += 4
    torch.testing.assert_close(model.temporal_activation_regularization(raw, reset), torch.tensor(0.5 * total / pairs))
    # Without resets it is AWD-LSTM's formula.
    torch.testing.assert_close(
        model.temporal_activation_regularization(raw), 0.5 * (raw[:, 1:] - raw[:, :-1]).pow(2).mean()
    )


@pytest.mark.parametrize("head", ["softmax", "mos"])
def test_every_dropout_is_off_in_eval(head: str) -> None:
    options = {
        "dropout": 0.3,
        "input_dropout": 0.4,
        "output_dropout": 0.4,
        "embedding_dropout": 0.2,
        "locked_dropout": True,
        "mos_dropout": 0.3,
        "ar": 2.0,
        "tar": 1.0,
        "cell_options": {"state_dropout": 0.3, "weight_drop": 0.5},
    }
    regularised, plain = _model(head=head, **options), _model(head=head)
    plain.load_state_dict(regularised.state_dict())
    inputs = _batch().inputs
    with torch.no_grad():
        torch.testing.assert_close(regularised.eval()(inputs)[0], plain.eval()(inputs)[0], atol=0, rtol=0)
        assert not torch.allclose(regularised.train()(inputs)[0], plain.train()(inputs)[0])


def test_dropout_keeps_zarembas_meaning_and_the_specific_rates_override_it() -> None:
    model = _model(dropout=0.3)
    assert (model.model.input_dropout, model.model.rnn.dropout, model.model.output_dropout) == (0.3, 0.3, 0.3)
    assert not model.model.rnn.locked_dropout
    model = _model(dropout=0.3, input_dropout=0.1, inter_layer_dropout=0.0, output_dropout=0.2)
    assert (model.model.input_dropout, model.model.rnn.dropout, model.model.output_dropout) == (0.1, 0.0, 0.2)
    model = _model(dropout=0.3, locked_dropout=True, cell_options={"dropout": 0.25, "locked_dropout": False})
    assert (model.model.rnn.dropout, model.model.rnn.locked_dropout) == (0.25, False)  # the stack's own settings win
    with pytest.raises(ConfigError, match="inter-layer dropout once"):
        _model(inter_layer_dropout=0.1, cell_options={"dropout": 0.2})
    with pytest.raises(ConfigError, match="unknown head"):
        _model(head="hierarchical")
    with pytest.raises(ConfigError, match="output_dropout"):
        _model(output_dropout=1.0)


def test_input_embedding_ratio() -> None:
    model = _model(hidden_size=20, input_embedding_ratio=0.5, tie_weights=True)
    assert model.model.embedding.weight.shape == (V, 10)
    assert model.model.projection is not None and model.model.projection.weight.shape == (10, 20)
    assert model.model.decoder.weight is model.model.embedding.weight
    model = _model(hidden_size=20, input_embedding_ratio=1.5, tie_weights=True)  # >= 1: sizes equal, no projection
    assert model.model.embedding.weight.shape == (V, 20) and model.model.projection is None
    assert model(torch.zeros(1, 3, dtype=torch.long))[0].shape == (1, 3, V)


def test_softmax_network_keys_are_unchanged() -> None:
    # The network's names (what exports store) are those of checkpoints written before heads existed.
    keys = set(_model(tie_weights=True).model.state_dict())
    assert {"embedding.weight", "decoder.weight", "decoder.bias"} <= keys
    assert not any(k.startswith("decoder.") and k.count(".") > 1 for k in keys)


def test_mos_model_is_tied_and_scored_by_the_softmax_code_path() -> None:
    model = _model(head="mos", mos_components=3, tie_weights=True, hidden_size=10).eval()
    assert model.model.decoder.decoder.weight is model.model.embedding.weight
    assert model.model.projection is None  # the latent layer maps the hidden size to K x embedding size
    batch = _batch()
    targets = batch.targets.clone()
    targets[0, 2] = IGNORE_INDEX
    batch = LMBatch(batch.inputs, targets, None)
    with torch.no_grad():
        head_inputs = _capture(model.model.decoder)
        total, count, _, _ = model._window(batch, "val")  # what validation, test and `evaluate` sum
        log_p = model.model.decoder(head_inputs[-1])  # the head's log-probabilities
    picked = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected = -picked[targets != IGNORE_INDEX].sum()
    assert int(count) == targets.numel() - 1
    torch.testing.assert_close(total, expected)


@pytest.fixture
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a loaded machine the thread hand-offs dominate (10x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_mos_model_trains(one_thread: None) -> None:
    model = _model(head="mos", mos_components=3, tie_weights=True, dropout=0.1, mos_dropout=0.1, ar=1.0, tar=1.0)
    ids = torch.arange(120) % 5  # a periodic corpus: easy to learn
    windows = list(StreamWindows(ids, batch_size=4, bptt=6, start_id=0))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model.train()
    losses = []
    for _ in range(6):
        model._state["train"] = None
        for step, batch in enumerate(windows):
            optimizer.zero_grad()
            loss = model.training_step(batch, step)["loss"]
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_embedding_init_range_leaves_the_recurrent_weights_at_pytorch_defaults() -> None:
    model = _model(hidden_size=100, embedding_init_range=0.01, tie_weights=True, cell_options={"forget_bias": None})
    assert float(model.model.embedding.weight.abs().max()) <= 0.01
    assert float(model.model.decoder.bias.abs().max()) == 0
    recurrent = model.model.rnn.layers[0].rnn.weight_hh_l0
    assert 0.05 < float(recurrent.abs().max()) <= 0.1  # nn.LSTM's U(-1/sqrt(H), 1/sqrt(H))


def test_weight_decay_comes_from_the_yaml_optimizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from commands.fit import LMZooCLI
    from datamodules import TextDataModule

    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = write_word_corpus(tmp_path / "corpus", "2")
    config = tmp_path / "config.yaml"
    config.write_text(
        "model:\n  class_path: lightning_modules.LanguageModel\n"
        "  init_args: {embedding_size: 8, hidden_size: 8, num_layers: 1, head: mos, mos_components: 2, ar: 2.0}\n"
        f"data:\n  class_path: datamodules.TextDataModule\n  init_args: {{corpus: '{corpus}'}}\n"
        "optimizer:\n  class_path: torch.optim.SGD\n  init_args: {lr: 30.0, weight_decay: 1.2e-6}\n"
    )
    cli = LMZooCLI(
        LanguageModel,
        TextDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(config), "--trainer.logger", "false"],
    )
    optimizer = cli.model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    assert optimizer.param_groups[0]["weight_decay"] == 1.2e-6
    assert (cli.model.hparams.head, cli.model.ar) == ("mos", 2.0)


def test_mos_model_generates() -> None:
    model = _model(head="mos", mos_components=3, tie_weights=True).eval()
    prompt = torch.tensor([[0, 5]] * 2)
    a = model.generate(prompt, 8, temperature=0.8, generator=torch.Generator().manual_seed(1))
    assert a == model.generate(prompt, 8, temperature=0.8, generator=torch.Generator().manual_seed(1))
    greedy = model.generate(prompt[:1], 1, top_k=1)[0]
    assert greedy == [int(model(prompt[:1])[0][0, -1].argmax())]


# ------------------------------------------------------------------ drop_state_probability (lamb, Melis et al.)
def _carried_state_seen(module: LanguageModel, stage: str, windows: int, streams: int = 16) -> list[tuple]:
    """Run ``windows`` windows of ``stage`` from an all-ones carried state; what the network received each time."""
    seen: list[tuple] = []
    run = module.model.run

    def recording_run(inputs, state, reset):
        seen.append(tuple(s.clone() for s in state))
        return run(inputs, state, reset)

    module.model.run = recording_run
    tokens = torch.randint(0, 20, (streams, 5))
    for _ in range(windows):
        module._state[stage] = tuple(torch.ones(2, streams, 8) for _ in range(2))  # (L, B, H): h and c of 2 layers
        module._window(LMBatch(tokens, tokens), stage)
    return seen


def test_drop_state_zeroes_whole_streams_at_the_rate_asked_in_training_only():
    torch.manual_seed(0)
    p = 0.3
    module = LanguageModel(vocab_size=20, embedding_size=8, hidden_size=8, num_layers=2, drop_state_probability=p)
    dropped = 0
    seen = _carried_state_seen(module.train(), "train", windows=100)
    for h, c in seen:
        zeroed = h[0, :, 0] == 0  # (B,)
        # lamb draws one mask per stream for the whole nested state: every layer's h and c together, and the
        # streams it keeps arrive as they were (no rescaling, unlike dropout).
        for tensor in (h, c):
            assert torch.equal(tensor, (~zeroed).float().view(1, -1, 1).expand_as(tensor))
        dropped += int(zeroed.sum())
    n = 100 * 16
    assert abs(dropped / n - p) < 4 * (p * (1 - p) / n) ** 0.5  # binomial: 4 standard deviations
    for stage in ("val", "test"):
        assert all(torch.equal(h, torch.ones_like(h)) for h, _ in _carried_state_seen(module.eval(), stage, 20))


def test_drop_state_off_leaves_the_carried_state_alone():
    module = LanguageModel(vocab_size=20, embedding_size=8, hidden_size=8, num_layers=2).train()
    assert all(torch.equal(h, torch.ones_like(h)) for h, _ in _carried_state_seen(module, "train", 20))
    with pytest.raises(ConfigError, match="drop_state_probability must be in"):
        LanguageModel(vocab_size=20, drop_state_probability=1.0)
