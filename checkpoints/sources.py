"""Resolving a SOURCE to a loaded model: a ``.ckpt`` file, a run's directory, an export directory, a registered short
name (its bundled copy under ``pretrained/``, hash-checked, else its pinned Hub revision) or a Hub repo id.

:func:`from_pretrained` is the door for inference: it reads an export (JSON, safetensors, the tokenizer file) and
imports neither Lightning nor torchmetrics; only a ``.ckpt`` source, whose settings are the LightningModule's, imports
the training stack (:mod:`checkpoints.ckpt_read`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from checkpoints import hub, registry
from checkpoints.export_read import LoadedModel, load_export
from zoo.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from datamodules.tokenizers import Tokenizer
    from zoo.language_model import RecurrentLM
    from zoo.music import PianoRollLM


def load(source: str | Path, revision: str | None = None, *, endpoint: str | None = None) -> LoadedModel:
    """Load a model from a SOURCE.

    Args:
        source: a ``.ckpt`` file, a run's directory (its newest ``best.ckpt``), an export directory, a Hub repo id or
            a registered short name.
        revision: for a Hub source: a branch, tag or commit (default ``main``, or the registry's pinned revision).
        endpoint: for a Hub source: the Hub's URL (default ``$HF_ENDPOINT`` or huggingface.co).

    Raises:
        LMZooError: the source cannot be used; the message says why and what to do.
    """
    text, path = str(source), Path(source)
    if path.exists():
        if revision is not None:
            raise ConfigError(f"--revision applies to a Hub repo id, not to the local {text}")
        best = newest_best_checkpoint(path) if path.is_dir() and not (path / "config.json").exists() else None
        if best is not None:
            return _load_checkpoint(best)
        return load_export(path) if path.is_dir() else _load_checkpoint(path)
    if path.suffix == ".ckpt":
        return _load_checkpoint(path)  # says it does not exist
    entry = registry.lookup(text) if "/" not in text else None
    if entry is not None:
        return load_registered(entry, revision, endpoint=endpoint)
    if "/" not in text:
        raise CheckpointError(
            f"cannot load {text!r}: it is no file or directory, no Hub repo id (owner/name) and no registered model "
            "(lm-zoo models --pretrained lists them)"
        )
    directory = hub.download(text, revision, endpoint=endpoint)
    return load_export(directory, source=f"{text}@{revision}" if revision else text)


def from_pretrained(
    source: str | Path, revision: str | None = None, *, endpoint: str | None = None
) -> tuple[RecurrentLM | PianoRollLM, Tokenizer | None]:
    """A trained network, in eval mode, and its tokenizer: ``model, tokenizer = from_pretrained("ptb-lstm-small")``.

    The network is a plain ``torch.nn.Module`` (:class:`zoo.RecurrentLM`, or :class:`zoo.music.PianoRollLM` for a
    model of piano rolls, which has no tokenizer: ``None``). ``huggingface_hub.PyTorchModelHubMixin`` is not used: it
    rebuilds a model from a flat ``config.json`` and fetches only the weights, while an lm-zoo model also needs its
    tokenizer file, accepts registry names served from the bundled ``pretrained/`` directory (hash-checked) and
    ``.ckpt`` files, and refuses pickled weights. :func:`load` gives the rest of the record (data settings, recipe,
    results).

    Args:
        source: a registered name (``lm-zoo models --pretrained``), an export directory, a Hub repo id
            ``owner/name`` or a ``.ckpt`` written by ``lm-zoo fit``.
        revision: for a Hub repo: a branch, tag or commit.
        endpoint: for a Hub repo: the Hub's URL (default ``$HF_ENDPOINT`` or huggingface.co).

    Returns:
        ``(model, tokenizer)``; ``tokenizer.encode`` / ``decode`` map text to ids and back.

    Raises:
        zoo.errors.LMZooError: the source cannot be loaded; the message says why and what to do.
    """
    loaded = load(source, revision, endpoint=endpoint)
    return loaded.model, loaded.tokenizer


def _load_checkpoint(path: Path) -> LoadedModel:
    # Deferred: a .ckpt holds the LightningModule's settings, so reading it imports Lightning; an export never does.
    from checkpoints.ckpt_read import load_checkpoint

    return load_checkpoint(path)


def newest_best_checkpoint(run: Path) -> Path | None:
    """The newest ``best.ckpt`` under a run's directory (``runs/ptb/lstm-small``, its ``lightning_logs``, or one
    ``version_N``), so that a user need not spell out which version it went to; ``None`` if there is none."""
    found = [p for p in run.rglob("best.ckpt") if p.is_file() and p.parent.name == "checkpoints"]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def registered_directory(
    entry: registry.RegistryEntry, revision: str | None = None, *, endpoint: str | None = None
) -> Path:
    """Where a registered model's export is: its bundled copy when this checkout has one (and no other revision is
    asked for), else a Hub download of its pinned revision; either way checked against the registry's hashes.

    Raises:
        CheckpointError: a bundled or downloaded file does not match the registry (naming it), or the model is not
            bundled here and the Hub does not serve it.
    """
    if revision in (None, entry.revision):
        directory = registry.bundled(entry)
        if directory is not None:
            return directory
    try:
        directory = hub.download(entry.repo_id, revision or entry.revision, endpoint=endpoint)
    except CheckpointError as err:
        if not entry.files:
            raise
        raise CheckpointError(
            f"{entry.name} is not bundled with this installation (no {registry.bundle_root() / entry.name}) and the "
            f"Hub did not serve {entry.repo_id}@{revision or entry.revision}: {err}; clone the lm-zoo repository, "
            "which ships it under pretrained/"
        ) from None
    if entry.files and revision in (None, entry.revision):  # the files the registry's numbers were measured on
        registry.verify_files(entry, directory, f"{entry.repo_id}@{entry.revision}")
    return directory


def load_registered(
    entry: registry.RegistryEntry, revision: str | None = None, *, endpoint: str | None = None
) -> LoadedModel:
    """Load a registered model (:func:`registered_directory` says from where); its ``source`` is the name when the
    bundle served it, else the Hub repo and revision."""
    directory = registered_directory(entry, revision, endpoint=endpoint)
    bundled = directory == registry.bundle_root() / entry.name
    # registered_directory checked the pinned revision's files against the registry: not hashed a second time.
    verified = entry.files if revision in (None, entry.revision) else None
    source = entry.name if bundled else f"{entry.repo_id}@{revision or entry.revision}"
    return load_export(directory, source=source, verified=verified)
