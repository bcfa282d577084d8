"""The export format: round trips from a trained run, the model card, tokenizers, bad input, pickles, the registry."""

from __future__ import annotations

import errno
import json
import pickle
import random
import shutil
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from lightning import LightningModule
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import checkpoints
import cli
import zoo
from checkpoints import registry
from checkpoints.export_read import CONFIG_NAME, HASHES_KEY, VOCAB_NAME, WEIGHTS_NAME, LoadedModel, load_export
from checkpoints.export_write import export_model
from datamodules.tokenizers import build_tokenizer
from lightning_modules import LanguageModel
from tests.conftest import one_line_error
from zoo import LMConfig, RecurrentLM


@pytest.fixture(scope="module")
def run(exported_run: Path) -> Path:
    return exported_run


@pytest.fixture(autouse=True)
def cache(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(run.parent / "cache"))


@pytest.fixture
def exported(run: Path, tmp_path: Path) -> Path:
    """A copy of the run's export that a test may damage."""
    return Path(shutil.copytree(run / "export", tmp_path / "export"))


def _evaluate(capsys: pytest.CaptureFixture[str], source: str, *extra: str) -> dict:
    capsys.readouterr()
    assert cli.main(["evaluate", source, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _logits(model: RecurrentLM | LanguageModel, ids: torch.Tensor) -> torch.Tensor:
    first, state = model(ids[:, :5])
    second, _ = model(ids[:, 5:], state)  # the carried state too
    return torch.cat([first, second], dim=1)


def test_checkpoint_and_export_from_before_the_network_split_still_load(run: Path, tmp_path: Path) -> None:
    """Checkpoints written when the LanguageModel held the network itself have no ``model.`` prefix, and format-1
    exports hold the LanguageModel's settings (``ar`` / ``tar`` among them): both load, and both resume training."""
    ckpt = torch.load(run / "checkpoints" / "best.ckpt", weights_only=True)
    for key in ("state_dict", "current_model_state"):
        ckpt[key] = {name.removeprefix("model."): tensor for name, tensor in ckpt[key].items()}
    old_ckpt = tmp_path / "old.ckpt"
    torch.save(ckpt, old_ckpt)
    new, old = checkpoints.load(run / "checkpoints" / "best.ckpt"), checkpoints.load(old_ckpt)
    ids = torch.randint(0, new.tokenizer.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(_logits(new.model, ids), _logits(old.model, ids))
    module = LanguageModel(**{**asdict(old.model.config), "ar": 0.5})
    module.on_load_checkpoint(ckpt)  # what Lightning calls before loading the weights of a resumed run
    module.load_state_dict(ckpt["state_dict"])
    with torch.no_grad():
        assert torch.equal(_logits(new.model, ids), _logits(module.eval(), ids))

    old_export = Path(shutil.copytree(run / "export", tmp_path / "format1"))
    _edit_config(old_export, lambda c: c.update(format_version=1, model={**c["model"], "ar": 0.0, "tar": 0.0}))
    with torch.no_grad():
        assert torch.equal(_logits(new.model, ids), _logits(checkpoints.load(old_export).model, ids))


def test_the_network_imports_without_lightning() -> None:
    code = "import sys, zoo; zoo.RecurrentLM(30, 'lstm', 4, 4, 1); print(any('lightning' in m for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("command", ["export", "publish", "download"])
def test_subcommand_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0 and "usage: lm-zoo " + command in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------- round trip
def test_export_loads_back_identical(run: Path) -> None:
    ckpt = checkpoints.load(run / "checkpoints" / "best.ckpt")
    export = checkpoints.load(run / "export")
    ids = torch.randint(0, ckpt.tokenizer.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(_logits(ckpt.model, ids), _logits(export.model, ids))
    text = "w1 w2 zebra w39\nw7"
    assert export.tokenizer.encode_text(text).tolist() == ckpt.tokenizer.encode_text(text).tolist()
    assert export.tokenizer.state_dict() == ckpt.tokenizer.state_dict()  # symbols and counts, in order
    assert export.data == {k: v for k, v in ckpt.data.items() if k != "data_root"}
    # tied weights: stored once, tied again after loading
    with safe_open(run / "export" / WEIGHTS_NAME, "pt") as f:
        assert len({"embedding.weight", "decoder.weight"} & set(f.keys())) == 1
    assert export.model.decoder.weight is export.model.embedding.weight


def test_weight_averaged_run_exports_the_averaged_weights(run: Path) -> None:
    ckpt = torch.load(run / "checkpoints" / "best.ckpt", weights_only=True)
    assert "current_model_state" in ckpt  # EMAWeightAveraging ran
    stored = load_file(run / "export" / WEIGHTS_NAME)
    for name, tensor in stored.items():  # the export is the network: the LanguageModel's "model." tensors
        assert torch.equal(tensor, ckpt["state_dict"]["model." + name]), name
    live = ckpt["current_model_state"]
    assert any(not torch.equal(tensor, live["model." + name]) for name, tensor in stored.items())
    config = json.loads((run / "export" / CONFIG_NAME).read_text())
    assert config["training"]["weight_averaged"] is True
    assert config["training"]["optimizers"][0]["class"] == "torch.optim.sgd.SGD"  # from PublishBest
    assert config["training"]["optimizers"][0]["param_groups"][0]["lr"] == 1.0


def test_config_records_model_tokenizer_recipe_and_version(run: Path) -> None:
    config = json.loads((run / "export" / CONFIG_NAME).read_text())
    assert config["format"] == "lm-zoo" and config["format_version"] == 2 and config["lm_zoo_version"]
    assert config["architecture"] == "lstm" and config["head"] == "softmax"
    loaded = checkpoints.load(run / "checkpoints" / "best.ckpt")
    assert config["model"] == asdict(loaded.model.config)
    assert list(config["model"]) == [field.name for field in fields(LMConfig)]  # the network's, no ar / tar
    assert config["num_parameters"] == sum(p.numel() for p in loaded.model.parameters())  # tied counted once
    assert config["tokenizer"] == {"kind": "word", "vocab_size": 42, "file": VOCAB_NAME, "options": {}}
    assert config["training"]["data"]["bptt"] == 6 and "data_root" not in config["training"]["data"]
    lines = (run / "export" / VOCAB_NAME).read_text().splitlines()
    assert len(lines) == 42 and lines[0] == "<eos>\t300"


def test_cli_export_then_evaluate_ckpt_and_directory_alike(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(run / "checkpoints" / "best.ckpt")
    assert cli.main(["export", ckpt, "--out", str(tmp_path / "out"), "--splits", "test", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["files"]) == {CONFIG_NAME, WEIGHTS_NAME, VOCAB_NAME, "README.md"}
    from_ckpt, from_dir = _evaluate(capsys, ckpt), _evaluate(capsys, str(tmp_path / "out"))
    assert from_ckpt["ppl"] == from_dir["ppl"] == report["results"][0]["ppl"]
    assert from_dir["source"] == str(tmp_path / "out")
    assert _evaluate(capsys, str(run / "export"))["ppl"] == from_ckpt["ppl"]  # PublishBest's export too
    # results measured before can be passed instead of evaluating again
    (tmp_path / "valid.json").write_text(json.dumps(_evaluate(capsys, ckpt, "--split", "valid")))
    assert cli.main(["export", ckpt, "--out", str(tmp_path / "out"), "--results", str(tmp_path / "valid.json")]) == 0
    assert [r["split"] for r in load_export(tmp_path / "out").results] == ["valid"]
    assert cli.main(["generate", str(tmp_path / "out"), "--num-samples", "2", "--seed", "1"]) == 0
    # a tempered result keeps its procedure: the card never shows it as a deterministic number
    (tmp_path / "tempered.json").write_text(json.dumps(_evaluate(capsys, ckpt, "--temperature", "0.8")))
    assert cli.main(["export", ckpt, "--out", str(tmp_path / "t"), "--results", str(tmp_path / "tempered.json")]) == 0
    (kept,) = load_export(tmp_path / "t").results
    assert kept["temperature"] == 0.8 and kept["method"] == "deterministic"
    (entry,) = ModelCard.load(tmp_path / "t" / "README.md").data.eval_results
    assert "temperature 0.8" in entry.metric_name and "temperature 0.8" in entry.metric_config


def test_a_float16_export_is_measured_on_its_stored_weights(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--dtype float16`` halves the weights (a model brought back from a lent GPU in files of limited size); the
    figure on its card is the one a user measures on what was stored, not the float32 checkpoint's."""
    ckpt = str(run / "checkpoints" / "best.ckpt")
    out = tmp_path / "half"
    assert cli.main(["export", ckpt, "--out", str(out), "--dtype", "float16", "--splits", "test", "--json"]) == 0
    (recorded,) = json.loads(capsys.readouterr().out)["results"]
    with safe_open(out / WEIGHTS_NAME, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    stored, full = _evaluate(capsys, str(out)), _evaluate(capsys, ckpt)
    assert stored["loss"] == pytest.approx(recorded["loss"], rel=1e-6)
    assert stored["loss"] != full["loss"]  # the rounding moved the figure: the card has the stored weights' one
    one_line_error(capsys, cli.main(["export", ckpt, "--out", str(tmp_path / "x"), "--dtype", "int8"]), "int8")


def test_model_card_holds_the_measured_results(run: Path) -> None:
    card = ModelCard.load(run / "export" / "README.md")
    config = json.loads((run / "export" / CONFIG_NAME).read_text())
    assert card.data.library_name == "lm-zoo" and "lm-zoo" in card.data.tags and card.data.license
    by_split = {r.dataset_split: r for r in card.data.eval_results}
    assert set(by_split) == {"validation", "test"}
    for result in config["results"]:
        entry = by_split["validation" if result["split"] == "valid" else "test"]
        assert entry.metric_type == "perplexity"
        assert entry.metric_value == pytest.approx(result["ppl"], abs=1e-4)
        assert entry.metric_args["eval_batch_size"] == result["eval_batch_size"] == 2
        assert entry.metric_args["bptt"] == result["bptt"] == 5
    assert "lm-zoo evaluate" in card.text and "from_pretrained(" in card.text


@pytest.mark.parametrize(
    ("kind", "text", "options"),
    [
        ("char", "ab\tc\r d\u2028e\nba  \tc\n", {}),  # tabs, "\r" and a Unicode line separator are symbols
        ("char", "a b _ c\nb _ a\n", {"spaced_symbols": True}),
        ("byte", "", {}),
        ("sentence", "The cat sat .\nA \u00a0 dog\u00a0x , sat .\n\nThe end\n", {}),  # GBW: <S> ... </S>, counts
        ("sentencepiece", "the cat sat on the mat\nthe dog ate the cat food\n" * 20, {"options": {"vocab_size": 300}}),
    ],
)
def test_every_tokenizer_round_trips(kind: str, text: str, options: dict, tmp_path: Path) -> None:
    tokenizer = build_tokenizer(kind, text, **options)
    model = RecurrentLM(vocab_size=tokenizer.vocab_size, embedding_size=4, hidden_size=4, num_layers=1).eval()
    export_model(LoadedModel(model, tokenizer, {"corpus": "somewhere"}), tmp_path / "out", results=[])
    loaded = load_export(tmp_path / "out")
    sample = text or "any text, even caf\u00e9\n"
    assert loaded.tokenizer.encode_text(sample).tolist() == tokenizer.encode_text(sample).tolist()
    assert loaded.tokenizer.state_dict() == tokenizer.state_dict()
    expected = model.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in loaded.model.state_dict().items())


CASES = [(name, "softmax", False) for name in zoo.names()] + [
    ("lstm", "mos", True),
    ("gru", "softmax", True),
    ("lstm", "nce", False),  # the noise distribution is not exported: a loaded model scores with the full softmax
    ("lstm", "sampled_softmax", True),
    ("lstm", "adaptive", False),
]


@pytest.mark.parametrize(("architecture", "head", "tie"), CASES, ids=[f"{a}-{h}{'-tied' * t}" for a, h, t in CASES])
def test_every_architecture_and_head_round_trips(architecture: str, head: str, tie: bool, tmp_path: Path) -> None:
    """Exported from the LightningModule; loaded back as the plain network (``checkpoints.from_pretrained``) and as
    the LightningModule around it (``LanguageModel.from_network``): the same logits, the carried state included."""
    tokenizer = build_tokenizer("word", "a b c d\ne f a\n")
    options = dict(zoo.preset(architecture, "tiny"))
    size, hidden = options.pop("input_size"), options.pop("hidden_size")
    options.pop("num_layers")
    model = LanguageModel(
        vocab_size=tokenizer.vocab_size,
        architecture=architecture,
        embedding_size=size,
        hidden_size=hidden,
        num_layers=2,
        cell_options=options,
        head=head,
        mos_components=2,
        tie_weights=tie,
    ).eval()
    export_model(LoadedModel(model.model, tokenizer, {"corpus": "somewhere"}), tmp_path / "out", results=[])
    network, loaded_tokenizer = checkpoints.from_pretrained(tmp_path / "out")
    module = LanguageModel.from_network(network).eval()
    assert type(network) is RecurrentLM and not isinstance(network, LightningModule) and not network.training
    assert loaded_tokenizer.state_dict() == tokenizer.state_dict()
    assert json.loads((tmp_path / "out" / CONFIG_NAME).read_text())["head"] == head
    ids = torch.randint(0, tokenizer.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = _logits(model, ids)
        assert torch.equal(expected, _logits(network, ids))
        assert torch.equal(expected, _logits(module, ids))


# -------------------------------------------------------------------------------------------------- bad input
def _edit_config(directory: Path, edit) -> None:
    config = json.loads((directory / CONFIG_NAME).read_text())
    edit(config)
    (directory / CONFIG_NAME).write_text(json.dumps(config))


def test_a_changed_or_missing_file_is_named_by_the_sha256_its_config_records(
    run: Path, exported: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recorded = json.loads((exported / CONFIG_NAME).read_text())[HASHES_KEY]
    assert set(recorded) == {WEIGHTS_NAME, VOCAB_NAME}
    state = load_file(exported / WEIGHTS_NAME)
    state["decoder.bias"][0] += 1  # a file that still loads and fits: only its sha256 tells
    save_file(state, exported / WEIGHTS_NAME)
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), f"{WEIGHTS_NAME} does not match the sha256")
    shutil.copy(run / "export" / WEIGHTS_NAME, exported / WEIGHTS_NAME)
    vocab = exported / VOCAB_NAME
    lines = vocab.read_text().splitlines(keepends=True)
    vocab.write_text("".join([lines[1], lines[0], *lines[2:]]))  # two words swapped: the same size, other ids
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), f"{VOCAB_NAME} does not match the sha256")
    vocab.unlink()
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), f"has no {VOCAB_NAME}, whose sha256")


def test_an_export_from_before_the_hashes_loads_with_a_note(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_config(exported, lambda c: c.pop(HASHES_KEY))
    capsys.readouterr()
    assert cli.main(["evaluate", str(exported), "--json"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "sha256" in line]
    assert notes == [f"lm-zoo: note: {exported} was exported before lm-zoo recorded its files' sha256, so its "
                     "weights and tokenizer cannot be verified (lm-zoo export it again to record them)"]  # fmt: skip


def _without_hashes(directory: Path) -> None:
    """Make ``directory`` an export from before configs recorded sha256, so the loaders' own checks are what speak."""
    _edit_config(directory, lambda c: c.pop(HASHES_KEY))


def test_corrupt_or_missing_weights(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _without_hashes(exported)
    weights = exported / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), WEIGHTS_NAME, "not a readable safetensors")
    for seed in range(10):  # random bytes, a fixed spread of them
        weights.write_bytes(random.Random(seed).randbytes(300))
        one_line_error(capsys, cli.main(["evaluate", str(exported)]), WEIGHTS_NAME, "not a readable safetensors")
    weights.unlink()
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), f"has no {WEIGHTS_NAME}")


def test_missing_or_extra_tensor_is_named(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _without_hashes(exported)
    state = load_file(exported / WEIGHTS_NAME)
    save_file({k: v for k, v in state.items() if k != "decoder.bias"}, exported / WEIGHTS_NAME)
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), "missing tensors ['decoder.bias']")
    save_file({**state, "head.extra": torch.zeros(2)}, exported / WEIGHTS_NAME)
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), "unexpected tensors ['head.extra']")


def test_unknown_architecture(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_config(exported, lambda c: c["model"].update(architecture="transformerx"))
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), "architecture 'transformerx'", "upgrade lm-zoo")


def test_vocabulary_that_does_not_fit_the_weights(exported: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _without_hashes(exported)
    vocab = exported / VOCAB_NAME
    vocab.write_text("".join(vocab.read_text().splitlines(keepends=True)[:-1]))
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), "vocab.txt has 41 entries", "42")
    # config.json edited to agree with vocab.txt: then the weights disagree
    _edit_config(exported, lambda c: (c["tokenizer"].update(vocab_size=41), c["model"].update(vocab_size=41)))
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), "size mismatch", "[42, 8]")


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda c: c.pop("format"), "is not an lm-zoo model"),
        (lambda c: c.update(format="transformers", model_type="gpt2"), "looks like a gpt2 model"),
        (lambda c: c.update(format_version=99), "format 99, newer than this lm-zoo reads"),
        (lambda c: c["model"].update(unknown_option=3), "settings this lm-zoo does not know"),
    ],
)
def test_config_that_is_not_ours(exported: Path, edit, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_config(exported, edit)
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), fragment)


def test_sources_that_are_no_model(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    one_line_error(capsys, cli.main(["evaluate", str(tmp_path)]), "is not an lm-zoo export (no config.json)")
    (tmp_path / CONFIG_NAME).write_text("{not json")
    one_line_error(capsys, cli.main(["evaluate", str(tmp_path)]), "not valid JSON")
    one_line_error(capsys, cli.main(["evaluate", "nonsense"]), "cannot load 'nonsense'", "models --pretrained")
    code = cli.main(["evaluate", str(tmp_path / "missing" / "export")])  # checked before any network call
    one_line_error(capsys, code, "is not a valid Hub repo id", "nor a local file or directory")
    code = cli.main(["evaluate", str(run / "export"), "--revision", "v1"])
    one_line_error(capsys, code, "--revision applies to a Hub repo id")
    code = cli.main(["export", str(run / "export"), "--out", str(tmp_path), "--splits"])
    one_line_error(capsys, code, "is not an lm-zoo export: choose an empty or new --out")
    # An --out that cannot be created is said before the source is even loaded (a missing source would say so).
    code = cli.main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "notes.txt" / "export")])
    one_line_error(capsys, code, "cannot be created", "notes.txt is not a directory")


# --------------------------------------------------------------------------------------------------- security
class _Payload:
    """Unpickling this creates a file: the proof that something was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "last.ckpt"])
def test_pickled_weights_are_refused_never_loaded(
    name: str, exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "unpickled"
    (exported / WEIGHTS_NAME).unlink()
    (exported / name).write_bytes(pickle.dumps(_Payload(marker)))
    code = cli.main(["evaluate", str(exported)])
    one_line_error(capsys, code, name, f"no {WEIGHTS_NAME}", "never loads pickled weights")
    assert not marker.exists()
    shutil.rmtree(exported)  # a bare directory of pickles, no config.json: refused the same way
    exported.mkdir()
    (exported / name).write_bytes(pickle.dumps(_Payload(marker)))
    one_line_error(capsys, cli.main(["evaluate", str(exported)]), "never loads pickled weights")
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------- registry
ENTRY = {
    "repo_id": "alice/ptb-tiny",
    "revision": "v1",
    "dataset": "ptb",
    "architecture": "lstm",
    "results": {"test": {"ppl": 112.38, "eval_batch_size": 1, "bptt": 35}},
}


@pytest.fixture
def registry_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"format_version": 1, "models": {"ptb-tiny": ENTRY}}))
    monkeypatch.setenv("LM_ZOO_REGISTRY", str(path))
    return path


def test_shipped_registry_is_valid() -> None:
    entries = registry.load_registry(registry.DEFAULT_PATH)
    assert all(registry.REPO_ID_PATTERN.match(e.repo_id) for e in entries.values())


def test_models_pretrained_prints_the_registry(registry_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models", "--pretrained", "--json"]) == 0
    unset = {"check_results": {}, "int8_results": {}, "num_parameters": None, "size_bytes": None}  # format 1
    unset |= {"files": {}, "training": {}}
    assert json.loads(capsys.readouterr().out) == [{"name": "ptb-tiny", "description": "", **ENTRY, **unset}]
    assert cli.main(["models", "--pretrained"]) == 0
    out = capsys.readouterr().out
    assert "ptb-tiny" in out and "alice/ptb-tiny@v1" in out and "test ppl 112.38 (eval batch 1, bptt 35)" in out
    registry_file.write_text(json.dumps({"format_version": 1, "models": {}}))
    assert cli.main(["models", "--pretrained"]) == 0
    assert "no pretrained models are registered yet" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"repo_id": "not-a-repo"}, "is not owner/name"),
        ({"revision": ""}, "revision must be a non-empty string"),
        ({"results": {"test": {"ppl": 80.0, "bptt": 35}}}, "needs eval_batch_size"),
        ({"results": {"test": {"eval_batch_size": 1, "bptt": 35}}}, "needs a positive ppl or bpc"),
        ({"results": {"dev": {"ppl": 80.0, "eval_batch_size": 1, "bptt": 35}}}, "train/valid/test"),
        ({"paper": "x"}, "unknown ['paper']"),
        ({"files": {"config.json": "abc"}}, "files must map each file name to its sha256"),
        ({"check_results": {"test": {"ppl": 80.0, "bptt": 35}}}, "check_results: results['test'] needs eval"),
    ],
)
def test_registry_validation(
    change: dict, fragment: str, registry_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    registry_file.write_text(json.dumps({"format_version": 1, "models": {"ptb-tiny": {**ENTRY, **change}}}))
    one_line_error(capsys, cli.main(["models", "--pretrained"]), str(registry_file), "'ptb-tiny'", fragment)


def test_registry_entry_from_an_export(run: Path) -> None:
    config = json.loads((run / "export" / CONFIG_NAME).read_text())
    entry = registry.entry_for(config, "tiny", "alice/tiny", "v1")
    data = {"format_version": 1, "models": {"tiny": {k: v for k, v in entry.to_json().items() if k != "name"}}}
    parsed = registry.parse_registry(data, "generated")["tiny"]
    assert parsed.results["test"]["eval_batch_size"] == 2 and parsed.results["test"]["ppl"] > 1
    assert parsed.check_results["test"] == parsed.results["test"]  # measured at the run's batch size (2) only
    assert parsed.description == "1 x 8 lstm on corpus" and parsed.revision == "v1"


@pytest.mark.parametrize("name", ["synthetic-xml-lstm", "nottingham-gru"])
def test_a_bundle_exported_again_keeps_the_files_its_card_shows(name: str, tmp_path: Path) -> None:
    """`lm-zoo export` of an export (a bundled or downloaded model) ships its learning curve and, for a music model,
    its sampled piece: the card it writes links them."""
    from checkpoints.export_read import ASSET_NAMES
    from checkpoints.export_write import export

    bundle = Path(__file__).resolve().parents[1] / "pretrained" / name
    out = export(bundle, tmp_path / "again", splits=())
    shipped = [n for n in ASSET_NAMES if (bundle / n).is_file()]
    assert "learning_curve.png" in shipped
    for asset in shipped:
        assert (out / asset).read_bytes() == (bundle / asset).read_bytes()
        assert f"]({asset})" in (out / "README.md").read_text()


def test_an_export_refused_by_a_full_disk_leaves_the_previous_export_whole(
    exported: Path, run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights' write fails half-way as a full disk does: one line, the export that was there still loads (byte
    for byte what it was), and no half-written folder is left beside it; a new --out is left empty, loading as
    nothing."""
    import checkpoints.export_write as writer

    before = {p.name: p.read_bytes() for p in exported.iterdir()}

    def full_disk(model: torch.nn.Module, path: str, **_: object) -> None:
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "save_model", full_disk)
    ckpt = str(run / "checkpoints" / "best.ckpt")
    line = one_line_error(
        capsys, cli.main(["export", ckpt, "--out", str(exported), "--splits"]), "no space left on device"
    )
    assert "the export that was there is unchanged" in line
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before
    assert checkpoints.load(exported).model is not None
    assert sorted(p.name for p in exported.parent.iterdir()) == ["export"]  # no .export.partial-* left
    fresh = exported.parent / "fresh"
    one_line_error(capsys, cli.main(["export", ckpt, "--out", str(fresh), "--splits"]), "nothing was left there")
    assert not fresh.exists() or not any(fresh.iterdir())
    monkeypatch.undo()
    assert cli.main(["export", ckpt, "--out", str(exported), "--splits"]) == 0  # and a write that succeeds replaces it
    assert checkpoints.load(exported).model is not None


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_sharded_weights_load_back_identical_and_are_checked_like_one_file(
    tmp_path: Path, tie: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-shard-size: Hugging Face's model-0000k-of-0000n.safetensors and index; the loaded network computes what
    the one-file export does, each shard's sha256 is recorded and checked, and exporting again in one file removes
    the old shards."""
    from checkpoints.export_read import INDEX_NAME, read_weights

    tokenizer = build_tokenizer("word", "the cat sat on the mat the dog sat")
    torch.manual_seed(0)
    model = RecurrentLM(tokenizer.vocab_size, "lstm", embedding_size=16, hidden_size=16, num_layers=2, tie_weights=tie)
    loaded = LoadedModel(model.eval(), tokenizer, {"corpus": "somewhere"})
    one_file = export_model(loaded, tmp_path / "one", results=[])
    sharded = export_model(loaded, tmp_path / "sharded", results=[], max_shard_size=3000)
    index = json.loads((sharded / INDEX_NAME).read_text())
    shards = sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (sharded / WEIGHTS_NAME).exists()
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    state = read_weights(one_file, "one")
    for shard in shards:  # at most the limit, unless one tensor alone is larger (a shard of its own)
        names = [name for name, file in index["weight_map"].items() if file == shard]
        size = sum(state[name].numel() * state[name].element_size() for name in names)
        assert size <= 3000 or len(names) == 1, (shard, size)
    assert read_weights(sharded, "sharded").keys() == state.keys()  # a tied tensor stored once, under one name
    ids = torch.randint(0, tokenizer.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for source in (sharded, str(sharded)):
            network, _ = checkpoints.from_pretrained(source)
            assert torch.equal(_logits(network, ids), _logits(checkpoints.load(one_file).model, ids))
            assert (network.decoder.weight is network.embedding.weight) == tie
    recorded = json.loads((sharded / CONFIG_NAME).read_text())[HASHES_KEY]
    assert {*shards, INDEX_NAME, VOCAB_NAME} <= set(recorded)
    damaged = sharded / shards[1]
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")
    code = cli.main(["evaluate", str(sharded), "--split", "test"])
    one_line_error(capsys, code, f"{shards[1]} does not match the sha256")
    export_model(loaded, sharded, results=[])  # again, in one file: the shards and the index go
    assert sorted(p.name for p in sharded.glob("model*")) == [WEIGHTS_NAME]
    assert checkpoints.load(sharded).model is not None


def test_export_takes_a_shard_size_with_units(tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from commands.sharing import shard_size

    assert shard_size("16MB") == 16_000_000 and shard_size("16MiB") == 16 * 2**20 and shard_size("2048") == 2048
    assert shard_size("1.5kb") == 1500
    ckpt = str(run / "checkpoints" / "best.ckpt")
    code = cli.main(["export", ckpt, "--out", str(tmp_path / "x"), "--splits", "--max-shard-size", "16 parsecs"])
    one_line_error(capsys, code, "--max-shard-size '16 parsecs'", "16MiB")
    assert cli.main(["export", ckpt, "--out", str(tmp_path / "x"), "--splits", "--max-shard-size", "2KB"]) == 0
    assert len(list((tmp_path / "x").glob("model-*-of-*.safetensors"))) > 1
