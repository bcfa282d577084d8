"""lm-zoo as a user installs it without a clone: the wheel built from this checkout, installed into a fresh virtual
environment and run from an empty directory, with nothing of the checkout importable.

The fresh environment gets lm-zoo from the wheel alone. Its dependencies are the test environment's own, made visible
through a ``.pth`` line to a folder of links (every installed distribution but lm-zoo's editable install), so that the
test needs no network and no second copy of torch; pip still resolves the wheel's requirements against them
(``--no-index``: a requirement they do not meet fails the install).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT, write_word_corpus

pytestmark = pytest.mark.slow


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    """The command's standard output and error (lm-zoo's own lines go to the error stream)."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _checkout_copy(destination: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new files not ignored), without build leftovers."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file() and not name.startswith(("pretrained/", "tests/", "benchmarks/", "docs/")):
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return destination


def _dependencies_folder(folder: Path) -> Path:
    """Links to everything installed beside this test's interpreter except lm-zoo itself and pip."""
    site = Path(sysconfig.get_paths()["purelib"])
    folder.mkdir()
    for entry in site.iterdir():
        name = entry.name
        if name.startswith(("__editable__", "lm_zoo", "pip", "__pycache__")):
            continue
        if name.endswith(".pth"):
            continue
        (folder / name).symlink_to(entry)
    return folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], Path]:
    """(the fresh environment's bin folder, its environment variables, an empty working directory)."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("the suite runs outside a virtual environment: its site-packages cannot be linked")
    tmp = tmp_path_factory.mktemp("wheel")
    source = _checkout_copy(tmp / "source")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), "."],
         cwd=source, env=dict(os.environ))  # fmt: skip
    wheel = next((tmp / "dist").glob("lm_zoo-*.whl"))

    venv = tmp / "venv"
    # No pip of its own: this interpreter's pip installs into it (--python), so the fresh environment holds no tools
    # whose versions could disagree with the dependencies'.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=dict(os.environ))
    purelib = _run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=tmp,
        env=dict(os.environ),
    ).splitlines()[0]
    (Path(purelib) / "lm_zoo_test_dependencies.pth").write_text(f"{_dependencies_folder(tmp / 'dependencies')}\n")

    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["LM_ZOO_CACHE"] = str(tmp / "cache")
    env["OMP_NUM_THREADS"] = "1"
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    _run([*pip, "install", "--no-index", str(wheel)], cwd=tmp, env=env)
    empty = tmp / "work"
    empty.mkdir()
    return venv / "bin", env, empty


def test_the_wheel_imports_nothing_from_the_checkout(installed: tuple[Path, dict[str, str], Path]) -> None:
    bin_folder, env, work = installed
    where = _run(
        [str(bin_folder / "python"), "-c", "import cli, commands, zoo; print(cli.__file__, zoo.__file__)"], work, env
    )
    assert str(ROOT) not in where and "site-packages" in where, where


def test_the_wheel_carries_every_recipe(installed: tuple[Path, dict[str, str], Path]) -> None:
    bin_folder, env, work = installed
    assert "lm-zoo COMMAND" in _run([str(bin_folder / "lm-zoo"), "--help"], work, env)
    listed = _run([str(bin_folder / "lm-zoo"), "recipes"], work, env)
    names = {line.split()[0] for line in listed.splitlines() if "/" in line.split(" ")[0]}
    shipped = {p.relative_to(ROOT / "configs").with_suffix("").as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    assert names == shipped


def test_a_named_recipe_trains_and_its_export_evaluates(
    installed: tuple[Path, dict[str, str], Path], tmp_path: Path
) -> None:
    bin_folder, env, work = installed
    corpus = write_word_corpus(tmp_path / "corpus", "wheel")
    lm_zoo = str(bin_folder / "lm-zoo")
    small = ["--model.init_args.embedding_size", "8", "--model.init_args.hidden_size", "8"]
    fitted = _run(
        [lm_zoo, "fit", "--config", "ptb/lstm-small", "--data.init_args.corpus", str(corpus), *small,
         "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
         "--trainer.accelerator", "cpu", "--trainer.default_root_dir", "run"],
        work,
        env,
    )  # fmt: skip
    # The run's last line names the run's own saved config (every setting it had), not a path inside site-packages.
    saved = next((work / "run").rglob("config.yaml")).relative_to(work)
    assert f"train further: lm-zoo fit --config {saved} --ckpt_path" in fitted, fitted
    best = next((work / "run").rglob("best.ckpt"))
    _run([lm_zoo, "export", str(best), "--out", "exported", "--splits", "valid", "--device", "cpu"], work, env)
    result = _run([lm_zoo, "evaluate", "exported", "--split", "test", "--json", "--device", "cpu"], work, env)
    assert '"ppl"' in result and '"split": "test"' in result, result
