"""Shared test helpers, and the one rule for finding the real corpora.

Real-data tests read the corpora root :data:`DATA_ROOT`: ``$LM_ZOO_DATA`` if set, else ``../shared/data`` beside the
checkout; a test that needs a corpus carries ``@needs_data("<corpus>", ...)`` and is skipped, with the path it
looked for, when that is missing. The session also points ``$LM_ZOO_DATA`` at ``../shared/data`` when it is unset
and that folder exists, so that the code under test (whose own default is ``~/.cache/lm-zoo/data``) and the commands
it starts find the same corpora: ``make test`` needs no ``LM_ZOO_DATA`` in a checkout beside ``shared/``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zoo import settings

ROOT = Path(__file__).resolve().parents[1]  # the checkout
SHARED_DATA = ROOT.parent / "shared" / "data"
# Fixed when the session starts: tests that point $LM_ZOO_DATA elsewhere for a while do not move it.
DATA_ROOT = Path(os.environ["LM_ZOO_DATA"]).expanduser() if os.environ.get("LM_ZOO_DATA") else SHARED_DATA


def pytest_configure(config: pytest.Config) -> None:
    """``$LM_ZOO_DATA`` for the code under test (and its subprocesses): the tests' root when it is unset."""
    if not os.environ.get("LM_ZOO_DATA") and SHARED_DATA.is_dir():
        os.environ["LM_ZOO_DATA"] = str(SHARED_DATA)


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
