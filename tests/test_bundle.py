"""Bundled pretrained models end to end on a tiny run: ``lm-zoo bundle build`` (export, measure the stored weights,
curve, samples, card, hashes, registry entry), loading a registered name from the bundle, a damaged bundle refused,
float16 storage, and ``lm-zoo bundle publish`` to the loopback Hub, downloaded into a fresh cache without the bundle."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

import checkpoints
import cli
from checkpoints import registry
from checkpoints.format import CARD_NAME, CONFIG_NAME, CURVE_NAME, WEIGHTS_NAME
from datamodules.corpora import _sha256_file
from tests.conftest import one_line_error
from tests.hub_server import FakeHub
from tests.test_export import train_run
from zoo import RecurrentLM

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_run(tmp_path_factory.mktemp("bundle"))


@pytest.fixture
def bundle_env(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty registry and bundle folder of the test's own; returns the bundle folder."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(run.parent / "cache"))
    (tmp_path / "registry.json").write_text(json.dumps({"format_version": 2, "models": {}}))
    monkeypatch.setenv("LM_ZOO_REGISTRY", str(tmp_path / "registry.json"))
    monkeypatch.setenv("LM_ZOO_PRETRAINED", str(tmp_path / "pretrained"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return tmp_path / "pretrained"


def _build(run: Path, capsys: pytest.CaptureFixture[str], name: str = "tiny", *extra: str) -> dict:
    capsys.readouterr()
    argv = ["bundle", "build", name, "--ckpt", str(run / "checkpoints" / "best.ckpt"), "--config", "run.yaml"]
    assert cli.main([*argv, "--logs", str(run / "lightning_logs" / "version_0"), "--commit", "abc123", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _evaluate(capsys: pytest.CaptureFixture[str], source: str, *extra: str) -> dict:
    capsys.readouterr()
    assert cli.main(["evaluate", source, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_build_records_what_a_user_needs_and_serves_the_name(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = _build(run, capsys)
    directory = bundle_env / "tiny"
    assert registry.load_registry()["tiny"].to_json() == entry
    assert entry["repo_id"] == "lm-zoo/tiny" and entry["revision"] == "v1"
    assert set(entry["files"]) == {CONFIG_NAME, WEIGHTS_NAME, "vocab.txt", CARD_NAME, CURVE_NAME}
    assert all(_sha256_file(directory / f) == h for f, h in entry["files"].items())
    assert entry["size_bytes"] == sum((directory / f).stat().st_size for f in entry["files"])
    # Every figure at eval batch 1 and at the run's eval batch (2), each re-measurable on the stored weights.
    config = json.loads((directory / CONFIG_NAME).read_text())
    assert sorted((r["split"], r["eval_batch_size"]) for r in config["results"]) == [
        ("test", 1),
        ("test", 2),
        ("valid", 1),
        ("valid", 2),
    ]
    test = entry["results"]["test"]
    assert test["eval_batch_size"] == 1 and test["bptt"] == 5
    again = _evaluate(capsys, "tiny", "--split", "test", "--batch-size", "1")
    assert again["ppl"] == pytest.approx(test["ppl"], rel=1e-4) and again["tokens"] == test["tokens"]
    # How it was made, on the card and in config.json.
    made = config["training"]["run"]
    assert (made["commit"], made["command"], made["seed"]) == ("abc123", "lm-zoo fit --config run.yaml", 1)
    assert (made["steps"], made["epochs"], made["tokens"]) == (8, 1, 8 * 4 * 6) and made["wall_time_s"] > 0
    assert len(made["samples"]["texts"]) == 3
    card = (directory / CARD_NAME).read_text()
    for fragment in ("## How it was made", "abc123", f"![learning curve]({CURVE_NAME})", "## Samples", "lm-zoo/tiny"):
        assert fragment in card
    with Image.open(directory / CURVE_NAME) as curve:
        assert curve.format == "PNG" and curve.size == (1000, 380)
    # The name loads from the bundle: CLI, the plain module, download's path.
    model, tokenizer = checkpoints.from_pretrained("tiny")
    assert isinstance(model, RecurrentLM) and tokenizer.vocab_size == config["tokenizer"]["vocab_size"]
    capsys.readouterr()
    assert cli.main(["download", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(directory)
    assert cli.main(["models", "--pretrained"]) == 0
    assert "tiny" in capsys.readouterr().out


def test_a_changed_byte_is_refused_naming_the_file(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _build(run, capsys)
    weights = bundle_env / "tiny" / WEIGHTS_NAME
    original = weights.read_bytes()
    data = bytearray(original)
    data[-1] ^= 1  # one bit of the last weight: still a valid safetensors file
    weights.write_bytes(bytes(data))
    for argv in (["evaluate", "tiny"], ["generate", "tiny"], ["download", "tiny"]):
        one_line_error(capsys, cli.main(argv), f"{WEIGHTS_NAME} does not match the sha256", "restore it")
    weights.write_bytes(original)
    (bundle_env / "tiny" / "vocab.txt").unlink()
    one_line_error(capsys, cli.main(["evaluate", "tiny"]), "has no vocab.txt, which the registry lists")


def test_float16_bundle_is_measured_on_its_stored_weights(
    run: Path, bundle_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = _build(run, capsys, "tiny16", "--dtype", "float16")
    with safe_open(bundle_env / "tiny16" / WEIGHTS_NAME, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    loaded = checkpoints.load("tiny16")
    assert loaded.model.embedding.weight.dtype == torch.float32  # computes in float32
    again = _evaluate(capsys, "tiny16", "--split", "test", "--batch-size", "1")
    assert again["ppl"] == pytest.approx(entry["results"]["test"]["ppl"], rel=1e-4)
    full = checkpoints.load(run / "checkpoints" / "best.ckpt").model.embedding.weight
    assert not torch.equal(full, loaded.model.embedding.weight)  # really rounded
    assert torch.equal(full.half().float(), loaded.model.embedding.weight)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        yield server


def test_publish_every_bundled_model_then_download_without_the_bundle(
    run: Path,
    bundle_env: Path,
    hub: FakeHub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entry = _build(run, capsys)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    capsys.readouterr()
    assert cli.main(["bundle", "publish"]) == 0
    assert capsys.readouterr().out.startswith("tiny: ")
    repo = hub.repos["lm-zoo/tiny"]
    assert set(repo.commits[repo.tags["v1"]]) - {".gitattributes"} == set(entry["files"])  # the Hub adds it
    # A user without the bundle (a pip install) and with an empty cache: the pinned revision from the Hub.
    shutil.move(bundle_env, tmp_path / "moved")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "fresh-hf-home"))
    again = _evaluate(capsys, "tiny", "--split", "test", "--batch-size", "1")
    assert again["ppl"] == pytest.approx(entry["results"]["test"]["ppl"], rel=1e-4)
    assert cli.main(["download", "tiny"]) == 0
    assert "fresh-hf-home" in capsys.readouterr().out
    # The registry's hashes hold for what the Hub serves too: a v1 whose card was edited is refused.
    tampered = hub.add_repo("lm-zoo/tiny", {**repo.commits[repo.tags["v1"]], CARD_NAME: b"edited\n"})
    hub.repos["lm-zoo/tiny"].tags["v1"] = tampered
    monkeypatch.setenv("HF_HOME", str(tmp_path / "another-hf-home"))
    one_line_error(capsys, cli.main(["evaluate", "tiny"]), f"lm-zoo/tiny@v1/{CARD_NAME} does not match the sha256")
    # A model the Hub does not have and no bundle: one line that says so.
    hub.repos.pop("lm-zoo/tiny")
    one_line_error(capsys, cli.main(["evaluate", "tiny"]), "tiny is not bundled with this installation")
