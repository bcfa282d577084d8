"""Shared test helpers."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from zoo import settings


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
