"""Shared test helpers, the one tiny fit every module trains, and the one rule for finding the real corpora.

The tiny fit (:data:`TINY_FIT`, written by :func:`write_tiny_recipe` with a module's own changes merged in) is a 1 x 8
LSTM on :func:`write_word_corpus`'s 40 words for 8 SGD steps; :func:`tiny_run` trains it once per session, and a test
that changes the run gets its own copy (:func:`trained`). ``workdir`` is a test's folder, its working directory and
its own corpus cache. Tests import helpers from here and from helper modules (``tests/hub_server.py``), never from
another test module.

Real-data tests read the corpora root :data:`DATA_ROOT`: ``$LM_ZOO_DATA`` if set, else ``../shared/data`` beside the
checkout; a test that needs a corpus carries ``@needs_data("<corpus>", ...)`` and is skipped, with the path it
looked for, when that is missing. The session also points ``$LM_ZOO_DATA`` at ``../shared/data`` when it is unset
and that folder exists, so that the code under test (whose own default is ``~/.cache/lm-zoo/data``) and the commands
it starts find the same corpora: ``make test`` needs no ``LM_ZOO_DATA`` in a checkout beside ``shared/``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import random
import re
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

import zoo
from zoo import settings

ROOT = Path(__file__).resolve().parents[1]  # the checkout
SHARED_DATA = ROOT.parent / "shared" / "data"
# Fixed when the session starts: tests that point $LM_ZOO_DATA elsewhere for a while do not move it.
DATA_ROOT = Path(os.environ["LM_ZOO_DATA"]).expanduser() if os.environ.get("LM_ZOO_DATA") else SHARED_DATA


#: The test modules that start several processes which watch each other or race a clock: DDP ranks and torchrun's
#: agent, search workers and their heartbeats, a run killed and resumed, tuning trials in two processes. Under
#: pytest-xdist (``make test`` runs two workers) they share one worker, so that two of them never run at once on the
#: two cores.
PROCESS_MODULES = frozenset(
    {
        "test_ddp",
        "test_ddp_heads",
        "test_devices",
        "test_faults",
        "test_gbw_ddp",
        "test_multinode",
        "test_resume",
        "test_search",
        "test_search_network",
        "test_tuning",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))


def pytest_configure(config: pytest.Config) -> None:
    """``$LM_ZOO_DATA`` for the code under test (and its subprocesses): the tests' root when it is unset. Under
    pytest-xdist (``make test`` runs two workers), one torch thread per worker: two workers on two cores with two
    threads each would preempt each other's threads, which a multi-threaded op then waits for."""
    if not os.environ.get("LM_ZOO_DATA") and SHARED_DATA.is_dir():
        os.environ["LM_ZOO_DATA"] = str(SHARED_DATA)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside ``pytest -m gpu`` tests, Lightning's ``accelerator="auto"`` sees no GPU: on a machine with one, the CPU
    suite would otherwise train on it in silence (and with several, re-launch pytest per rank for DDP). The GPU tests
    name their accelerator. Commands started as subprocesses pass ``--trainer.accelerator cpu`` themselves."""
    if request.node.get_closest_marker("gpu") is None:
        from lightning.fabric import accelerators as fabric
        from lightning.pytorch import accelerators as trainer

        for kind in (fabric.CUDAAccelerator, fabric.MPSAccelerator, trainer.CUDAAccelerator, trainer.MPSAccelerator):
            monkeypatch.setattr(kind, "is_available", staticmethod(lambda: False))


@pytest.fixture(autouse=True)
def process_state_restored() -> Iterator[None]:
    """Every test starts from the same process state, whatever ran before it, and leaves it as it found it.

    What the suite's own in-process runs leave behind made later tests depend on the order and speed of earlier ones:
    ``lm-zoo search`` and ``lm-zoo tune --jobs N`` set torch's thread count for the process (``test_reverse_copy``
    set 1) and a later figure summed in another order; a search with a time budget draws from the global generators
    as many times as it had time for, so a later test's unseeded draws depended on the machine's speed; an in-process
    DDP fit left its rendezvous (``MASTER_PORT``, ``WORLD_SIZE``) in ``os.environ``; fits and evaluations set the
    float32 matmul precision; an in-process fit left Lightning's SIGTERM handler, which only takes note, so a worker
    pool forked later (the GBW data module's) could not be stopped and the test hung. So the global generators are
    seeded, and the environment, working directory, thread count, matmul flags and signal handlers put back."""
    environment, cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    matmul, tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    yield
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = tf32
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def needs_data(*parts: str) -> pytest.MarkDecorator:
    """Skip the test, saying what is missing, unless ``DATA_ROOT/<parts>`` exists (a corpus folder or file)."""
    path = DATA_ROOT.joinpath(*parts)
    return pytest.mark.skipif(
        not path.exists(),
        reason=f"no {path}: set LM_ZOO_DATA to the corpora's root (default: ../shared/data beside the checkout)",
    )


def write_word_corpus(directory: Path, seed: str, words: int = 40) -> Path:
    """A small word corpus of random lines over ``words`` word types, as train/valid/test.txt in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", 300), ("valid", 60), ("test", 50)):
        rng = random.Random(f"{seed}-{split}")
        text = "".join(
            " " + " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randrange(1, 12))) + " \n"
            for _ in range(lines)
        )
        (directory / f"{split}.txt").write_text(text)
    return directory


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous or a process group)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def subprocess_environment(tmp_path: Path) -> dict[str, str]:
    """The environment of an ``lm-zoo`` run a test starts: its own corpus cache, this checkout (and the tests'
    helper classes) importable in every rank, one thread so that every run sums in the same order."""
    env = dict(os.environ)
    env["LM_ZOO_CACHE"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def ddp_workspace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """A module's folder, the small word corpus its multi-process runs train on, and their environment."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    return tmp_path, write_word_corpus(tmp_path / "corpus", "ddp", words=60), subprocess_environment(tmp_path)


def one_line_error(capsys: pytest.CaptureFixture[str], code: int, *fragments: str, expected_code: int = 2) -> str:
    """Assert the CLI stopped with ``expected_code`` and one ``lm-zoo: error:`` line holding ``fragments``."""
    err = capsys.readouterr().err
    assert code == expected_code, err
    assert "Traceback" not in err
    assert "usage:" not in err, err  # the usage is for --help, not for a mistake
    last = err.strip().splitlines()[-1]
    assert last.startswith("lm-zoo: error: "), err
    for fragment in fragments:
        assert fragment in last, last
    return last


@contextlib.contextmanager
def fused_kernel_calls() -> Iterator[list[torch.nn.Module]]:
    """The ``nn.LSTM``/``nn.GRU``/``nn.RNN`` modules whose fused kernel a layer ran while the context is open, in
    order (:func:`zoo.layers.rnn_kernel`, which a fused layer calls instead of the module's forward: a hook on the
    module sees nothing)."""
    import zoo.layers

    calls: list[torch.nn.Module] = []
    run = zoo.layers.rnn_kernel

    def counted(rnn: torch.nn.Module, *args: Any) -> Any:
        calls.append(rnn)
        return run(rnn, *args)

    zoo.layers.rnn_kernel = counted
    try:
        yield calls
    finally:
        zoo.layers.rnn_kernel = run


def quiet_trainer(**options: Any) -> L.Trainer:
    """A Lightning ``Trainer`` that writes and prints nothing (no logger, checkpoints, progress bar or model summary)
    unless ``options`` turn it back on; ``options`` are any other ``Trainer`` arguments."""
    defaults = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(**{**defaults, "enable_model_summary": False, **options})


@pytest.fixture
def zoo_settings() -> Iterator[Callable[..., settings.Settings]]:
    """``zoo_settings(plain_kernels=True)``: :mod:`zoo.settings` overridden until the test ends (each call on top of
    the last)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(settings.overridden(**changes))


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation produces, in elements held (a sparse tensor holds its values)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else [out]:
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value._values().numel() if value.is_sparse else value.numel())
        return out


# ----------------------------------------------------------------------------------------------------- the tiny fit
#: The tiny fit: a 1 x 8 LSTM on a word corpus, 8 SGD steps, nothing printed. ``{root}`` and ``{corpus}`` are filled in
#: by :func:`write_tiny_recipe`.
TINY_FIT: dict[str, Any] = {
    "seed_everything": 1,
    "trainer": {
        "max_epochs": 1,
        "limit_train_batches": 8,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": "{root}",
    },
    "model": {
        "class_path": "lightning_modules.LanguageModel",
        "init_args": {"architecture": "lstm", "embedding_size": 8, "hidden_size": 8, "num_layers": 1},
    },
    "data": {
        "class_path": "datamodules.TextDataModule",
        "init_args": {"corpus": "{corpus}", "batch_size": 4, "bptt": 6, "eval_batch_size": 2, "eval_bptt": 5},
    },
    "checkpoint": {"dirpath": "{root}/checkpoints"},
    "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 1.0}},
}


def _merged(base: Any, changes: Any) -> Any:
    """``base`` with ``changes`` merged in, key by key; a mapping naming another ``class_path`` replaces the whole
    section, ``None`` removes a key."""
    if not isinstance(base, dict) or not isinstance(changes, dict):
        return copy.deepcopy(changes)
    if changes.get("class_path", base.get("class_path")) != base.get("class_path"):
        return copy.deepcopy(changes)
    merged = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merged(merged[key], value) if key in merged else copy.deepcopy(value)
    return merged


def _filled(value: Any, fields: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {key: _filled(item, fields) for key, item in value.items()}
    if isinstance(value, list):
        return [_filled(item, fields) for item in value]
    return value.format(**fields) if isinstance(value, str) else value


def tiny_recipe(root: Path, corpus: Path | str, **changes: Any) -> dict[str, Any]:
    """:data:`TINY_FIT` writing under ``root`` and reading ``corpus``, with ``changes`` (sections, merged key by key:
    ``trainer={"max_epochs": 2}``, ``model={"init_args": {"tie_weights": True}}``; ``None`` removes a key)."""
    return _filled(_merged(TINY_FIT, changes), {"root": str(root), "corpus": str(corpus)})


def write_tiny_recipe(path: Path, corpus: Path | str, root: Path | None = None, **changes: Any) -> Path:
    """Write :func:`tiny_recipe` (under ``root``, default ``path`` without its suffix) to ``path``; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recipe = tiny_recipe(root if root is not None else path.with_suffix(""), corpus, **changes)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


#: The tiny fit as ``lm-zoo tune`` trials it (``write_tiny_recipe(path, corpus, root, **TINY_TUNE)``): validated every
#: 2 steps, each trial's checkpoints where tune puts them, the runs under ``{root}/runs``.
TINY_TUNE: dict[str, Any] = {
    "trainer": {
        "limit_val_batches": 3,
        "val_check_interval": 2,
        "num_sanity_val_steps": 0,
        "default_root_dir": "{root}/runs",
        "enable_progress_bar": None,
        "enable_model_summary": None,
    },
    "checkpoint": None,
}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's folder, as its working directory and with its own corpus cache (``$LM_ZOO_CACHE``)."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny fit, trained once for the session: a folder holding ``corpus/`` (seed ``"a"``), ``run.yaml`` and
    ``run/checkpoints/{last,best}.ckpt``. Read it, never change it: :func:`trained` gives a test its own copy."""
    import cli  # deferred: collecting the tests needs no CLI

    folder = tmp_path_factory.mktemp("tiny-run")
    corpus = write_word_corpus(folder / "corpus", "a")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LM_ZOO_CACHE", str(folder / "cache"))
        env.chdir(folder)
        assert cli.main(["fit", "--config", str(write_tiny_recipe(folder / "run.yaml", corpus))]) == 0
    return folder


@pytest.fixture
def trained(tiny_run: Path, workdir: Path) -> Path:
    """A copy of :func:`tiny_run` in ``workdir`` (``corpus/``, ``run.yaml`` naming the copy, ``run/``); returns its
    ``last.ckpt``. The checkpoints still name the session's corpus, which is the same text."""
    shutil.copytree(tiny_run / "corpus", workdir / "corpus")
    shutil.copytree(tiny_run / "run", workdir / "run")
    write_tiny_recipe(workdir / "run.yaml", workdir / "corpus")
    return workdir / "run" / "checkpoints" / "last.ckpt"


def fit_exported_run(root: Path, **publish: str) -> Path:
    """Fit the tiny fit with tied weights and EMA weight averaging (decay 0.5), whose ``PublishBest`` exports the best
    checkpoint into ``run/export`` (and publishes it, given ``publish``: its ``repo_id``, ``tag``, ``endpoint``), under
    ``root`` (its corpus cache in ``root/cache``); returns ``root/run``."""
    import cli  # deferred: collecting the tests needs no CLI

    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.EMAWeightAveraging", "init_args": {"decay": 0.5}},
        {"class_path": "checkpoints.callbacks.PublishBest", "init_args": {"out_dir": "{root}/export", **publish}},
    ]
    config = write_tiny_recipe(
        root / "run.yaml",
        write_word_corpus(root / "corpus", "export"),
        trainer={"log_every_n_steps": 4, "callbacks": callbacks},
        model={"init_args": {"tie_weights": True}},
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LM_ZOO_CACHE", str(root / "cache"))
        assert cli.main(["fit", "--config", str(config)]) == 0
    return root / "run"


@pytest.fixture(scope="session")
def exported_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`fit_exported_run` once for the session (read it, never change it): the run folder, ``export/`` in it."""
    return fit_exported_run(tmp_path_factory.mktemp("exported-run"))


#: The tiny architecture search (``lm-zoo search --config``): one memorisation setting, one task on a small synthetic
#: XML corpus.
TINY_SEARCH = """
search: {settings_per_task: 1, baseline_settings: 1, memorise_threshold: 0.0, task_threshold: 0.0, top: 10}
grid: {num_layers: [1]}
memorise:
  data:
    class_path: datamodules.ReverseCopyDataModule
    init_args: {num_symbols: 4, min_length: 2, max_length: 2, reverse: false, train_examples: 40, eval_examples: 10,
                batch_size: 4, eval_batch_size: 5}
  num_params: [400]
  epochs: 1
tasks:
  xml:
    data:
      class_path: datamodules.TextDataModule
      init_args: {corpus: synthetic-xml, tokenizer: char, batch_size: 4, bptt: 10, eval_batch_size: 4,
                  corpus_options: {seed: 0, train_chars: 600, valid_chars: 200, test_chars: 200}}
    num_params: [2000]
    epochs: 1
"""


# -------------------------------------------------------------------------------- readers independent of lm-zoo's
def roll_from_midi(path: Path, frames: int, frame_beats: float) -> np.ndarray:
    """Replay a MIDI file's note_on / note_off into a ``(frames, 88)`` piano roll, independently of the writer."""
    import mido

    from zoo.music import NUM_NOTES

    midi = mido.MidiFile(path)
    ticks_per_frame = round(midi.ticks_per_beat * frame_beats)
    roll = np.zeros((frames, NUM_NOTES), dtype=np.uint8)
    sounding: dict[int, int] = {}
    now = 0
    for message in midi.tracks[0]:
        now += message.time
        if message.type == "note_on" and message.velocity > 0:
            sounding[message.note] = now
        elif message.type in ("note_off", "note_on"):
            start = sounding.pop(message.note)
            roll[start // ticks_per_frame : now // ticks_per_frame, message.note - 21] = 1
    assert not sounding
    return roll


XML_TAG = re.compile(r"<(/?)([^<>]*)>")  # a tag of the synthetic XML task: (closing "/" or "", name)


def drawn_bits(document: str) -> float:
    """The bits of the draws that wrote ``document``, read from its tags: each opening name's length (log2 9) and
    letters (log2 26 each), and each decision (1 bit while the 50 steps last; one after the last tag ends the line)."""
    from datamodules import synthetic

    tags = XML_TAG.findall(document)
    openings = [name for close, name in tags if not close]
    decisions = len(tags)  # every tag after the first, then the one that ends the line
    bits = len(openings) * math.log2(9) + sum(map(len, openings)) * math.log2(26)
    return bits + min(decisions, synthetic.XML_MAX_ITERATIONS)


def registered_figure(capsys: pytest.CaptureFixture[str], name: str, expected: dict | None = None) -> tuple[dict, dict]:
    """The registered test result (or ``expected``) and ``lm-zoo evaluate``'s at its batch size and BPTT (and, for a
    check figure, over as many of the first tokens)."""
    import cli
    from checkpoints import registry

    expected = expected or registry.load_registry(registry.DEFAULT_PATH)[name].results["test"]
    capsys.readouterr()
    argv = ["evaluate", name, "--split", "test", "--json", "--bptt", str(expected["bptt"])]
    argv += ["--batch-size", str(expected["eval_batch_size"])]
    argv += ["--max-tokens", str(expected["max_tokens"])] if "max_tokens" in expected else []  # a check figure
    assert cli.main(argv) == 0
    return expected, json.loads(capsys.readouterr().out)


def assert_same_figure(expected: dict, measured: dict) -> None:
    """The registered figure (a music model's: NLL per frame) re-measured, on as many tokens (frames)."""
    metric = next(m for m in ("nll_per_step", "bpc", "ppl") if m in expected)
    assert measured[metric] == pytest.approx(expected[metric], rel=1e-4)
    assert (measured["eval_batch_size"], measured["bptt"]) == (expected["eval_batch_size"], expected["bptt"])
    count = "frames" if metric == "nll_per_step" else "tokens"
    assert measured[count] == expected[count]
    assert measured.get("max_tokens") == expected.get("max_tokens")


def tiny_stack(name: str) -> tuple[torch.nn.Module, int]:
    """Architecture ``name``'s two-layer stack at its ``tiny`` preset's sizes, seeded, and its input size."""
    options = dict(zoo.preset(name, "tiny"))
    size, hidden = options.pop("input_size"), options.pop("hidden_size")
    options.pop("num_layers")
    torch.manual_seed(0)
    return zoo.build(name, size, hidden, 2, **options), size
