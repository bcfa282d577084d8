"""Publishing to and downloading from a Hub: a real HTTP server on loopback (tests/hub_server.py), the real client.

Each test gets a fresh ``HF_HOME``, so nothing is found in a cache a previous test filled.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import save_model

import checkpoints
import cli
from checkpoints.export_read import CONFIG_NAME, VOCAB_NAME, WEIGHTS_NAME
from checkpoints.hub import hub_settings
from tests.conftest import fit_exported_run, one_line_error
from tests.hub_server import FakeHub

TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with FakeHub() as server:
        yield server


@pytest.fixture(scope="module")
def run(hub: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny run; its PublishBest callback exports the best checkpoint and publishes it as alice/tiny, tag v1."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_TOKEN", TOKEN)
        env.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home-fit")))
        return fit_exported_run(tmp_path_factory.mktemp("hub"), repo_id="alice/tiny", tag="v1", endpoint=hub.url)


@pytest.fixture(autouse=True)
def environment(run: Path, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HF_HOME and the test Hub as HF_ENDPOINT (read when lm-zoo calls the Hub, not at import)."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(run.parent / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "hf-home"


@pytest.fixture
def export(run: Path, tmp_path: Path) -> Path:
    """A copy of the run's export (publishing re-renders its card for the repo id)."""
    return Path(shutil.copytree(run / "export", tmp_path / "export"))


def _json_out(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert cli.main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------ publish, download
def test_callback_published_the_export(run: Path, hub: FakeHub) -> None:
    repo = hub.repos["alice/tiny"]
    files = repo.commits[repo.tags["v1"]]
    assert {CONFIG_NAME, WEIGHTS_NAME, VOCAB_NAME, "README.md"} <= set(files)
    assert files[WEIGHTS_NAME] == (run / "export" / WEIGHTS_NAME).read_bytes()
    creates = [auth for method, path, auth in hub.requests if path == "/api/repos/create"]
    assert creates and all(auth == f"Bearer {TOKEN}" for auth in creates)  # HF_TOKEN was sent
    card = files["README.md"].decode()
    assert "lm-zoo evaluate alice/tiny" in card  # the card was re-rendered for the repo


def test_evaluate_ckpt_directory_and_repo_id_alike(
    run: Path, environment: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _json_out(capsys, "evaluate", str(run / "checkpoints" / "best.ckpt"), "--json")
    directory = _json_out(capsys, "evaluate", str(run / "export"), "--json")
    repo = _json_out(capsys, "evaluate", "alice/tiny", "--json")
    pinned = _json_out(capsys, "evaluate", "alice/tiny", "--revision", "v1", "--json")
    assert ckpt["ppl"] == directory["ppl"] == repo["ppl"] == pinned["ppl"]
    assert repo["source"] == "alice/tiny" and pinned["source"] == "alice/tiny@v1"
    # downloaded into the fresh HF_HOME, and only the export's files
    snapshots = list((environment / "hub" / "models--alice--tiny" / "snapshots").iterdir())
    assert len(snapshots) == 1 and {p.name for p in snapshots[0].iterdir()} == {
        CONFIG_NAME,
        WEIGHTS_NAME,
        VOCAB_NAME,
        "README.md",
    }


def test_publish_download_and_load(
    export: Path, hub: FakeHub, environment: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    published = _json_out(capsys, "publish", str(export), "--repo-id", "bob/tiny", "--private", "--tag", "v2", "--json")
    assert published["url"] == f"{hub.url}/bob/tiny" and published["tag"] == "v2"
    assert hub.repos["bob/tiny"].private and hub.repos["bob/tiny"].tags["v2"] == published["commit"]
    assert published["registry_entry"]["repo_id"] == "bob/tiny" and published["registry_entry"]["revision"] == "v2"
    downloaded = _json_out(capsys, "download", "bob/tiny", "--revision", "v2", "--json")
    path = Path(downloaded["path"])
    assert path.is_relative_to(environment) and (path / CONFIG_NAME).is_file()
    assert cli.main(["download", "bob/tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(path)  # main is that commit: the same snapshot
    card = ModelCard.load(path / "README.md")
    config = json.loads((path / CONFIG_NAME).read_text())
    assert [r.metric_value for r in card.data.eval_results] == [round(r["ppl"], 4) for r in config["results"]]
    original, downloaded_model = checkpoints.load(export), checkpoints.load("bob/tiny", revision="v2")
    ids = torch.randint(0, 42, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(original.model(ids)[0], downloaded_model.model(ids)[0])


@pytest.mark.slow
def test_sharded_weights_publish_and_download(
    run: Path, hub: FakeHub, tmp_path: Path, environment: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An export in shards (--max-shard-size) goes to the Hub and comes back: the shards and the index are fetched,
    and the repo id scores what the one-file export scores."""
    sharded = tmp_path / "sharded"
    ckpt = str(run / "checkpoints" / "best.ckpt")
    assert cli.main(["export", ckpt, "--out", str(sharded), "--splits", "--max-shard-size", "2KB"]) == 0
    shards = sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    _json_out(capsys, "publish", str(sharded), "--repo-id", "carol/sharded", "--json")
    downloaded = Path(_json_out(capsys, "download", "carol/sharded", "--json")["path"])
    assert {*shards, "model.safetensors.index.json", CONFIG_NAME} <= {p.name for p in downloaded.iterdir()}
    by_repo = _json_out(capsys, "evaluate", "carol/sharded", "--json")
    assert by_repo["ppl"] == _json_out(capsys, "evaluate", str(run / "export"), "--json")["ppl"]


def test_publish_to_a_branch_and_replace_stale_files(export: Path, hub: FakeHub, tmp_path: Path) -> None:
    assert cli.main(["publish", str(export), "--repo-id", "carol/tiny"]) == 0
    assert cli.main(["publish", str(export), "--repo-id", "carol/tiny", "--revision", "dev"]) == 0
    repo = hub.repos["carol/tiny"]
    assert set(repo.branches) == {"main", "dev"}
    # the same model with a byte tokenizer: no vocab.txt, so the repo's vocab.txt goes in the same commit
    from checkpoints.export_read import LoadedModel
    from checkpoints.export_write import export_model
    from datamodules.tokenizers import ByteTokenizer
    from lightning_modules import LanguageModel

    model = LanguageModel(vocab_size=256, embedding_size=4, hidden_size=4, num_layers=1).model
    byte_export = export_model(LoadedModel(model, ByteTokenizer(), {"corpus": "enwik8"}), tmp_path / "bytes", [])
    assert cli.main(["publish", str(byte_export), "--repo-id", "carol/tiny", "--revision", "dev"]) == 0
    assert VOCAB_NAME not in repo.commits[repo.branches["dev"]]
    assert VOCAB_NAME in repo.commits[repo.branches["main"]]
    assert checkpoints.load("carol/tiny", revision="dev").tokenizer.kind == "byte"


@pytest.mark.slow
def test_download_a_registered_short_name(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.loads((run / "export" / CONFIG_NAME).read_text())
    result = {"ppl": round(config["results"][1]["ppl"], 4), "eval_batch_size": 2, "bptt": 5}
    entry = {"repo_id": "alice/tiny", "revision": "v1", "dataset": "corpus", "architecture": "lstm"}
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"format_version": 1, "models": {"tiny": {**entry, "results": {"test": result}}}}))
    monkeypatch.setenv("LM_ZOO_REGISTRY", str(registry))
    downloaded = _json_out(capsys, "download", "tiny", "--json")
    assert downloaded["repo_id"] == "alice/tiny" and downloaded["revision"] == "v1"
    measured = _json_out(capsys, "evaluate", "tiny", "--json")
    assert round(measured["ppl"], 4) == result["ppl"] and measured["source"] == "alice/tiny@v1"
    one_line_error(capsys, cli.main(["download", "nosuchmodel"]), "'nosuchmodel' is no registered model")


# ------------------------------------------------------------------------------------------------- offline
@pytest.mark.slow
def test_offline_from_the_cache(
    monkeypatch: pytest.MonkeyPatch, environment: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    online = _json_out(capsys, "evaluate", "alice/tiny", "--json")  # downloads into the fresh HF_HOME
    with FakeHub() as gone:  # a Hub that was there and is not any more (the module's Hub stays up)
        pass
    monkeypatch.setenv("HF_ENDPOINT", gone.url)
    # no Hub: a plain run says the cache has the model and how to use it ...
    code = cli.main(["evaluate", "alice/tiny"])
    one_line_error(capsys, code, f"cannot reach the Hub at {gone.url}", "in the local cache", "HF_HUB_OFFLINE=1")
    # ... and with HF_HUB_OFFLINE=1, set before huggingface_hub is imported, it evaluates from the cache alone
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    script = Path(sys.executable).with_name("lm-zoo")
    done = subprocess.run(
        [str(script), "evaluate", "alice/tiny", "--json"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ppl"] == online["ppl"]


def test_offline_without_the_model_cached(
    monkeypatch: pytest.MonkeyPatch, environment: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_settings().offline and hub_settings().cache_dir == str(environment / "hub")
    code = cli.main(["download", "alice/tiny"])
    one_line_error(capsys, code, "not in the Hugging Face cache", "HF_HUB_OFFLINE is set")
    code = cli.main(["publish", "anything", "--repo-id", "a/b"])
    one_line_error(capsys, code, "HF_HUB_OFFLINE is set: publishing needs the network")


# -------------------------------------------------------------------------------------------------- bad input
def test_repo_or_revision_that_does_not_exist(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["evaluate", "alice/no-such-model"])
    one_line_error(capsys, code, "there is no model repo alice/no-such-model", hub.url)
    code = cli.main(["generate", "alice/tiny", "--revision", "v9"])
    one_line_error(capsys, code, "alice/tiny has no revision 'v9'")
    one_line_error(capsys, cli.main(["download", "a/b/c"]), "'a/b/c' is not a valid Hub repo id")


def test_gated_repo(
    run: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {p.name: p.read_bytes() for p in (run / "export").iterdir()}
    hub.add_repo("org/gated", files, gated=True)
    one_line_error(capsys, cli.main(["evaluate", "org/gated"]), "org/gated is gated", "HF_TOKEN")
    hub.granted_tokens.add("hf_granted")
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert cli.main(["download", "org/gated"]) == 0


def test_repo_that_is_not_an_lm_zoo_model(run: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_repo("org/text-only", {"README.md": b"# notes\n"})
    one_line_error(capsys, cli.main(["evaluate", "org/text-only"]), "org/text-only is not an lm-zoo model")
    card = b"---\nlibrary_name: transformers\n---\n# a transformer\n"
    files = {CONFIG_NAME: b'{"model_type": "gpt2"}', WEIGHTS_NAME: b"x" * 100, "README.md": card}
    hub.add_repo("org/gpt", files)
    code = cli.main(["evaluate", "org/gpt"])
    one_line_error(capsys, code, "org/gpt is not an lm-zoo model (its library is transformers)")
    assert not [path for method, path, _ in hub.requests if "/org/gpt/resolve/" in path]  # nothing downloaded


def test_repo_with_pickled_weights_is_refused_unread(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    hub.add_repo("org/pickled", {CONFIG_NAME: b"{}", "pytorch_model.bin": b"\x80\x04pickle"})
    code = cli.main(["evaluate", "org/pickled"])
    one_line_error(capsys, code, "org/pickled holds pytorch_model.bin but no model.safetensors", "never loads pickled")
    assert not [path for method, path, _ in hub.requests if "pytorch_model.bin" in path]


def test_corrupt_weights_on_the_hub(run: Path, hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    files = {p.name: p.read_bytes() for p in (run / "export").iterdir()}
    hub.add_repo("org/truncated", {**files, WEIGHTS_NAME: files[WEIGHTS_NAME][:100]})
    code = cli.main(["evaluate", "org/truncated"])
    one_line_error(capsys, code, "org/truncated/model.safetensors does not match the sha256 its config.json records")


def test_publish_errors(export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeHub() as gone:
        pass
    code = cli.main(["publish", str(export), "--repo-id", "a/b", "--endpoint", gone.url])
    one_line_error(capsys, code, f"cannot reach the Hub at {gone.url}")
    one_line_error(capsys, cli.main(["publish", str(export), "--repo-id", "bad id!"]), "not a valid Hub repo id")
    model = torch.nn.Linear(2, 2)
    (tmp_path / "half").mkdir()
    save_model(model, str(tmp_path / "half" / WEIGHTS_NAME))  # weights but no config.json: never published
    code = cli.main(["publish", str(tmp_path / "half"), "--repo-id", "a/b"])
    one_line_error(capsys, code, "is not an lm-zoo export (no config.json)")
