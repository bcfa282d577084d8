"""The LanguageModel: carried TBPTT state, the evaluation numbers, sampling, the NaN guard, schedules, tying."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from jsonargparse import ArgumentError

from datamodules import TextDataModule
from datamodules.windows import StreamWindows
from evaluation.perplexity import evaluate
from lightning_modules import LanguageModel, ZarembaDecay
from lightning_modules.divergence import WINDOW_LOSS
from lightning_modules.language_model import TRAINING_OPTIONS
from tests.conftest import quiet_trainer, write_word_corpus
from zoo import LMConfig, RecurrentLM
from zoo.errors import ConfigError, TrainingDivergedError


def _tiny_model(vocab: int = 23, architecture: str = "lstm", **kw) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(vocab, architecture, embedding_size=8, hidden_size=12, num_layers=2, **kw)


@pytest.mark.parametrize("architecture", ["lstm", "gru", "rnn_tanh"])
def test_windows_with_carried_state_equal_one_pass(architecture: str) -> None:
    model = _tiny_model(architecture=architecture).eval()
    ids = torch.randint(0, 23, (300,))
    stream = StreamWindows(ids, batch_size=4, bptt=9, start_id=0)
    # One pass over each whole column...
    whole, _ = model(stream.tokens[:, :-1])
    # ...equals the windows run with the state carried (detached) between them, as training_step does.
    model._state["train"] = None
    pieces = []
    for batch in stream:
        state = model._state["train"]
        logits, state = model(batch.inputs, None if state is None else tuple(s.detach() for s in state))
        model._state["train"] = tuple(s.detach() for s in state)
        pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-5, rtol=1e-5)


def test_training_step_detaches_and_carries_state() -> None:
    model = _tiny_model()
    stream = StreamWindows(torch.randint(0, 23, (200,)), batch_size=2, bptt=5, start_id=0)
    windows = iter(stream)
    model.training_step(next(windows), 0)
    first = model._state["train"]
    assert first is not None and not first[0].requires_grad
    loss = model.training_step(next(windows), 1)["loss"]
    loss.backward()  # would fail ("backward through the graph a second time") if the state were not detached
    assert model._state["train"][0] is not first[0]


@pytest.mark.slow
def test_evaluate_equals_independent_nll_sum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = write_word_corpus(tmp_path, "0")
    dm = TextDataModule(str(corpus), eval_batch_size=3, eval_bptt=7)
    model = _tiny_model(vocab=dm.vocab_size)
    result = evaluate(model, dm, "test")
    # Independently: the test text, <eos> before it, log-softmax of one forward pass per column, summed by hand.
    ids = torch.as_tensor(dm.tokenizer.encode_text((corpus / "test.txt").read_text()), dtype=torch.long)
    stream = torch.cat([torch.tensor([dm.tokenizer.eos_id]), ids])
    n = ids.numel()
    bounds = [0]
    for column in range(3):
        bounds.append(bounds[-1] + n // 3 + (column < n % 3))
    total = 0.0
    with torch.no_grad():
        for start, end in zip(bounds, bounds[1:]):
            logits, _ = model(stream[start:end].unsqueeze(0))
            logp = torch.log_softmax(logits[0].double(), dim=-1)
            total -= float(logp[torch.arange(end - start), stream[start + 1 : end + 1]].sum())
    assert result.tokens == n == dm.units("test").tokens
    assert result.ppl == pytest.approx(math.exp(total / n), rel=1e-6)
    assert result.loss == pytest.approx(total / n, rel=1e-6)
    assert (result.eval_batch_size, result.bptt, result.split) == (3, 7, "test")


def test_evaluate_reports_bpc_on_characters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("abcabc de\nxyz\n" * 20)
    dm = TextDataModule(str(tmp_path), tokenizer="char", eval_batch_size=2)
    result = evaluate(_tiny_model(vocab=dm.vocab_size), dm, "valid")
    assert dm.level == "char"
    assert result.bpc == pytest.approx(result.loss / math.log(2))  # one token per character


def test_generate_is_reproducible_stops_at_eos_and_top_k_1_is_greedy() -> None:
    model = _tiny_model().eval()
    prompt = torch.tensor([[0, 5]] * 3)
    a = model.generate(prompt, 30, temperature=0.9, stop_id=0, generator=torch.Generator().manual_seed(4))
    b = model.generate(prompt, 30, temperature=0.9, stop_id=0, generator=torch.Generator().manual_seed(4))
    assert a == b
    for sample in a:
        assert len(sample) <= 30 and (0 not in sample[:-1])  # nothing after the stop token
    greedy = model.generate(prompt[:1], 6, top_k=1)[0]
    ids, state = [0, 5], None
    logits, state = model(torch.tensor([ids]))
    expected = []
    for _ in range(6):
        token = int(logits[0, -1].argmax())
        expected.append(token)
        logits, state = model(torch.tensor([[token]]), state)
    assert greedy == expected
    with pytest.raises(ConfigError, match="temperature"):
        model.generate(prompt, 3, temperature=0.0)


def test_nan_loss_stops_training_with_the_step() -> None:
    model = _tiny_model()
    with torch.no_grad():
        model.model.decoder.bias.fill_(float("nan"))
    batch = next(iter(StreamWindows(torch.randint(0, 23, (50,)), batch_size=2, bptt=5, start_id=0)))
    (guard,) = model.configure_callbacks()  # the run's divergence guard
    output = model.training_step(batch, 0)
    guard.check(output[WINDOW_LOSS], None, step=0)  # on its way to the host
    with pytest.raises(TrainingDivergedError, match="loss became nan at step 0"):
        guard.on_validation_epoch_start(None, model)  # as every save, validation and the next step's check: decided


def test_zaremba_schedule() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = ZarembaDecay(opt, constant_epochs=4, decay=0.5)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert lrs == [1.0, 1.0, 1.0, 1.0, 0.5, 0.25, 0.125]


def test_tied_weights_share_storage_with_projection_when_sizes_differ() -> None:
    model = LanguageModel(50, "lstm", embedding_size=8, hidden_size=12, num_layers=1, tie_weights=True)
    assert model.model.decoder.weight is model.model.embedding.weight
    assert model.model.projection is not None and model.model.projection.weight.shape == (8, 12)
    logits, _ = model(torch.randint(0, 50, (2, 3)))
    assert logits.shape == (2, 3, 50)
    same = LanguageModel(50, "lstm", embedding_size=8, hidden_size=8, num_layers=1, tie_weights=True)
    assert same.model.projection is None


def test_awd_lstms_last_layer_has_the_embeddings_width_and_the_tied_softmax_reads_it_directly() -> None:
    """AWD-LSTM's stack (salesforce/awd-lstm-lm ``model.py``: ``nhid if l != nlayers - 1 else ninp``): the last layer
    has the embedding's units and no projection stands between it and the tied softmax. Against the same network
    written with three ``nn.LSTM``s over two windows, the state carried between them; the stack's carried state keeps
    its (L, B, H) layout with the narrower last layer's rows zero past its width."""
    torch.manual_seed(0)
    vocab, embed, hidden = 30, 6, 10
    model = RecurrentLM(
        vocab, "lstm", embed, hidden, 3, tie_weights=True, cell_options={"last_layer_size": embed}
    ).eval()
    assert model.projection is None
    lstms = [torch.nn.LSTM(i, h, batch_first=True) for i, h in [(embed, hidden), (hidden, hidden), (hidden, embed)]]
    for index, lstm in enumerate(lstms):
        lstm.load_state_dict({n: p for n, p in model.rnn.layers[index].rnn.state_dict().items()})
    assert sum(p.numel() for p in model.parameters()) == (
        vocab * embed + vocab + sum(p.numel() for lstm in lstms for p in lstm.parameters())
    )
    tokens = torch.randint(0, vocab, (2, 9))
    state, carried = None, [None, None, None]
    for window in (tokens[:, :4], tokens[:, 4:]):
        logits, state = model(window) if state is None else model(window, state)
        x = model.embedding.weight[window]  # (B, T, E)
        for index, lstm in enumerate(lstms):
            x, carried[index] = lstm(x, carried[index])
        expected = x @ model.embedding.weight.T + model.decoder.bias  # (B, T, V): the tied softmax on the 6 units
        torch.testing.assert_close(logits, expected)
        h, c = state  # each (L, B, H)
        assert h.shape == c.shape == (3, 2, hidden)
        torch.testing.assert_close(h[2, :, :embed], carried[2][0][0])
        assert not h[2, :, embed:].any() and not c[2, :, embed:].any()


def test_last_layer_size_is_refused_where_a_layers_state_is_not_its_width() -> None:
    with pytest.raises(ConfigError, match="last_layer_size needs layers whose state tensors are"):
        RecurrentLM(30, "skip_lstm", 6, 10, 2, cell_options={"last_layer_size": 6})
    with pytest.raises(ConfigError, match="sum_layer_outputs adds the layers. outputs"):
        RecurrentLM(30, "lstm", 6, 10, 2, cell_options={"last_layer_size": 6, "sum_layer_outputs": True})


@pytest.mark.slow
def test_fit_logs_metrics_and_resets_state_each_epoch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = write_word_corpus(tmp_path, "1")
    dm = TextDataModule(str(corpus), batch_size=4, bptt=8, eval_batch_size=2)
    model = _tiny_model(vocab=dm.vocab_size)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1.0)  # LightningCLI's job in lm-zoo
    starts = []
    model.on_train_epoch_start = lambda: (
        starts.append(model._state["train"]),
        LanguageModel.on_train_epoch_start(model),
    )
    trainer = quiet_trainer(max_epochs=2)
    trainer.fit(model, dm)
    assert len(starts) == 2 and starts[1] is not None  # state was carried through epoch 0, then reset
    assert model._state["train"] is not None
    metrics = trainer.callback_metrics
    assert {"val_loss", "val_ppl", "train_loss"} <= set(metrics)
    assert float(metrics["val_ppl"]) == pytest.approx(math.exp(float(metrics["val_loss"])), rel=1e-5)


def test_training_logs_the_figures_evaluate_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule (datamodules.kinds.text_figures): a SentencePiece model's validation logs bits per character, as
    `lm-zoo evaluate` reports them, over the same windows; a word model's logs none, as evaluate reports none."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = write_word_corpus(tmp_path, "2")
    for tokenizer, options in (("sentencepiece", {"vocab_size": 300}), ("word", None)):
        dm = TextDataModule(
            str(corpus), batch_size=4, bptt=8, eval_batch_size=2, tokenizer=tokenizer, tokenizer_options=options
        )
        model = _tiny_model(vocab=dm.vocab_size)
        trainer = quiet_trainer()
        trainer.validate(model, dm, verbose=False)
        result = evaluate(model.model, dm, "valid")
        assert ("val_bpc" in trainer.callback_metrics) == (result.bpc is not None) == (tokenizer == "sentencepiece")
        if result.bpc is not None:
            assert float(trainer.callback_metrics["val_bpc"]) == pytest.approx(result.bpc, rel=1e-5)


def test_lightningcli_reads_the_network_settings_from_lmconfig_and_a_ckpt_records_them_all() -> None:
    """LanguageModel passes **network on to LMConfig; jsonargparse follows that call, so `model.init_args.<field>`
    has the field's type and default without the settings being spelt a second time."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    keys = parser.add_class_arguments(LanguageModel, "model")
    network = [field.name for field in dataclasses.fields(LMConfig)]
    assert keys == [f"model.{name}" for name in [*TRAINING_OPTIONS, *network]]
    defaults = parser.get_defaults()
    assert all(defaults[f"model.{field.name}"] == field.default for field in dataclasses.fields(LMConfig))
    parsed = parser.parse_args(["--model.hidden_size", "12", "--model.adaptive_cutoffs", "[2, 5]"])
    assert parsed["model.hidden_size"] == 12 and parsed["model.adaptive_cutoffs"] == [2, 5]
    with pytest.raises(ArgumentError, match="hidden_size"):
        parser.parse_args(["--model.hidden_size", "wide"])
    # Given by position or left at its default, every setting is in the hyperparameters a .ckpt keeps.
    module = LanguageModel(50, "gru", hidden_size=12, num_layers=1, ar=1.0)
    assert module.model.config == LMConfig(50, "gru", hidden_size=12, num_layers=1)
    training = {"ar": 1.0, "tar": 0.0, "divergence_threshold": None, "drop_state_probability": 0.0}
    assert dict(module.hparams) == {**dataclasses.asdict(module.model.config), **training}


@pytest.mark.parametrize("architecture", ["lstm", "gru", "mogrifier"])
def test_generate_samples_what_a_plain_forward_loop_samples(architecture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """generate's step (embedding, the stack as one kernel call, the head, for fused stacks) samples the ids a loop of
    forward, softmax and multinomial draws with the same generator; with and without a stop id, batched."""
    from zoo.stack import RecurrentStack

    torch.manual_seed(0)
    model = RecurrentLM(20, architecture, 8, 8, num_layers=2).eval()
    prompt = torch.tensor([[0, 5], [0, 7], [0, 3]])
    reference_ids, state, generator = [], None, torch.Generator().manual_seed(2)
    with torch.no_grad():
        logits, state = model(prompt)
        for _ in range(25):
            probs = torch.softmax(logits[:, -1] / 0.8, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            reference_ids.append(token)
            logits, state = model(token, state)
    reference = torch.cat(reference_ids, 1).tolist()
    assert model.generate(prompt, 25, temperature=0.8, generator=torch.Generator().manual_seed(2)) == reference
    stopped = model.generate(prompt, 25, temperature=0.8, stop_id=4, generator=torch.Generator().manual_seed(2))
    assert stopped == [row[: row.index(4) + 1] if 4 in row else row for row in reference]
    assert any(len(row) < 25 for row in stopped)  # some row really stopped
    monkeypatch.setattr(RecurrentStack, "_merged_kernel", lambda self: None)  # the stack layer by layer
    assert model.generate(prompt, 25, temperature=0.8, generator=torch.Generator().manual_seed(2)) == reference


@pytest.mark.slow
@pytest.mark.parametrize(("every", "expected"), [(3, [0, 2, 5, 8]), (0, list(range(11)))])
def test_training_figures_are_logged_at_the_steps_lightning_writes_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int, expected: list[int]
) -> None:
    """self.log costs Lightning's bookkeeping every call: the first step and every log_every_n_steps (the steps a
    logger writes) log train_loss; log_every_n_steps 0 logs every step."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    dm = TextDataModule(str(write_word_corpus(tmp_path, "0")), batch_size=2, bptt=5)
    model = _tiny_model(vocab=dm.vocab_size)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1.0)  # LightningCLI's job in lm-zoo
    logged: list[int] = []
    original = LanguageModel.log
    monkeypatch.setattr(
        LanguageModel,
        "log",
        lambda self, name, *a, **k: (
            (logged.append(self.global_step) if name == "train_loss" else None) or original(self, name, *a, **k)
        ),
    )
    trainer = quiet_trainer(max_steps=11, limit_val_batches=0, log_every_n_steps=every)
    trainer.fit(model, dm)
    assert logged == expected
    assert "train_loss" in trainer.callback_metrics
