"""Loading trained models: ``checkpoints.load(source)`` gives the model, its tokenizer and the data settings it used.

A SOURCE is, for now, a Lightning ``.ckpt`` written by ``lm-zoo fit``. (Exported directories and Hub repo ids are the
export/Hub issue's part; they will plug in here.)
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from datamodules.tokenizers import Tokenizer
from lightning_modules.language_model import LanguageModel
from zoo.errors import CheckpointError, LMZooError


@dataclass
class LoadedModel:
    """A model ready to evaluate or sample from.

    Attributes:
        model: the language model, in eval mode.
        tokenizer: the tokenizer it was trained with.
        data: the data module's settings at training time (corpus, batch sizes, BPTT, ...).
        source: where it was loaded from.
    """

    model: LanguageModel
    tokenizer: Tokenizer
    data: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def _read_ckpt(path: Path) -> dict[str, Any]:
    try:
        # weights_only: a checkpoint holds tensors and plain data; nothing in it needs unpickling arbitrary objects.
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path} is not a readable checkpoint ({reason[:200]}); it may be truncated or not a .ckpt: "
            "use another checkpoint (e.g. last.ckpt) or train again"
        ) from None


def _find_tokenizer(ckpt: dict[str, Any], path: Path) -> Tokenizer:
    # The data module's state_dict is stored under its class name; its hyperparameters also have a "tokenizer" (the
    # kind, a string or None), so look for the saved tokenizer state itself.
    for value in ckpt.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), dict):
            return Tokenizer.from_state_dict(value["tokenizer"])
    raise CheckpointError(f"{path} has no tokenizer (it was not written by `lm-zoo fit`): retrain with lm-zoo")


def load_checkpoint(path: str | Path) -> LoadedModel:
    """Load a Lightning checkpoint written by ``lm-zoo fit``.

    Raises:
        CheckpointError: the file is missing, corrupt, lacks weights or tokenizer, or its weights do not fit its
            configuration or vocabulary (the message names the tensors).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist: pass a .ckpt written by `lm-zoo fit`")
    ckpt = _read_ckpt(path)
    if "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise CheckpointError(f"{path} holds no model weights and settings: pass a .ckpt written by `lm-zoo fit`")
    hparams = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}
    tokenizer = _find_tokenizer(ckpt, path)
    if hparams.get("vocab_size") != tokenizer.vocab_size:
        raise CheckpointError(
            f"{path}: the model expects {hparams.get('vocab_size')} tokens but its tokenizer has "
            f"{tokenizer.vocab_size}; the checkpoint is inconsistent, use another one"
        )
    try:
        model = LanguageModel(**hparams)
    except TypeError as err:
        raise CheckpointError(f"{path} has settings this lm-zoo does not know ({err}); upgrade lm-zoo") from None
    missing, unexpected = _compare_keys(model.state_dict(), ckpt["state_dict"])
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match its architecture: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "use a checkpoint written by this lm-zoo version"
        )
    try:
        model.load_state_dict(ckpt["state_dict"], strict=True)
    except RuntimeError as err:
        mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err)[:200])
        raise CheckpointError(f"{path}: {mismatch}; the weights do not fit the stored settings") from None
    data = {k: v for k, v in ckpt.get("datamodule_hyper_parameters", {}).items() if not k.startswith("_")}
    return LoadedModel(model.eval(), tokenizer, data, str(path))


def _compare_keys(expected: dict[str, Any], found: dict[str, Any]) -> tuple[list[str], list[str]]:
    return sorted(set(expected) - set(found)), sorted(set(found) - set(expected))


def load(source: str | Path) -> LoadedModel:
    """Load a model from a SOURCE (a ``.ckpt`` file).

    Raises:
        LMZooError: the source cannot be used; the message says why and what to do.
    """
    path = Path(source)
    if path.suffix == ".ckpt" or path.is_file():
        return load_checkpoint(path)
    raise CheckpointError(f"cannot load {source!r}: pass a .ckpt file written by `lm-zoo fit`")


__all__ = ["LMZooError", "LoadedModel", "load", "load_checkpoint"]
