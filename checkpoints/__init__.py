"""Trained models in and out: ``checkpoints.load(source)`` gives the model, its tokenizer and its data settings.

A SOURCE is a Lightning ``.ckpt`` written by ``lm-zoo fit`` (:mod:`checkpoints.ckpt`), a directory written by
``lm-zoo export`` (:mod:`checkpoints.export`), a Hugging Face Hub repo id ``owner/name`` (:mod:`checkpoints.hub`,
downloaded into the Hugging Face cache) or the short name of a registered model (:mod:`checkpoints.registry`).
Exports and Hub repos are read as JSON, safetensors and tokenizer files only: nothing from them is ever unpickled.
"""

from __future__ import annotations

from pathlib import Path

from checkpoints import hub, registry
from checkpoints.ckpt import LoadedModel, load_checkpoint
from checkpoints.export import export, export_model, load_export
from zoo.errors import CheckpointError, ConfigError, LMZooError


def load(source: str | Path, revision: str | None = None, *, endpoint: str | None = None) -> LoadedModel:
    """Load a model from a SOURCE.

    Args:
        source: a ``.ckpt`` file, an export directory, a Hub repo id or a registered short name.
        revision: for a Hub source: a branch, tag or commit (default ``main``, or the registry's pinned revision).
        endpoint: for a Hub source: the Hub's URL (default ``$HF_ENDPOINT`` or huggingface.co).

    Raises:
        LMZooError: the source cannot be used; the message says why and what to do.
    """
    text, path = str(source), Path(source)
    if path.exists():
        if revision is not None:
            raise ConfigError(f"--revision applies to a Hub repo id, not to the local {text}")
        return load_export(path) if path.is_dir() else load_checkpoint(path)
    if path.suffix == ".ckpt":
        return load_checkpoint(path)  # says it does not exist
    resolved = registry.resolve(text, revision)
    if resolved is None:
        raise CheckpointError(
            f"cannot load {text!r}: it is no file or directory, no Hub repo id (owner/name) and no registered model "
            "(lm-zoo models --pretrained lists them)"
        )
    repo_id, revision = resolved
    directory = hub.download(repo_id, revision, endpoint=endpoint)
    return load_export(directory, source=f"{repo_id}@{revision}" if revision else repo_id)


__all__ = ["LMZooError", "LoadedModel", "export", "export_model", "load", "load_checkpoint", "load_export"]
