"""Writing the export format (:mod:`checkpoints.export_read` describes it and reads it back): ``lm-zoo export``,
with the results measured for the model card."""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file, save_model

from checkpoints import load
from checkpoints.export_read import (
    ASSET_NAMES,
    CARD_NAME,
    CONFIG_NAME,
    CURVE_NAME,
    FORMAT,
    FORMAT_VERSIONS,
    HASHES_KEY,
    INDEX_NAME,
    SENTENCEPIECE_NAME,
    STORED_DTYPES,
    VOCAB_NAME,
    WEIGHTS_NAME,
    LoadedModel,
    export_file_hashes,
    is_export_file,
    lm_zoo_version,
    read_config,
)
from checkpoints.model_card import render_card
from datamodules.corpora import REPORTED_SPLITS
from datamodules.tokenizers import Tokenizer
from evaluation.dispatch import score_split
from evaluation.results import EvaluationResult, result_from_json
from zoo.errors import CheckpointError

# Settings of the training machine, not of the recipe: a downloaded model uses the user's own data root.
_LOCAL_DATA_SETTINGS = ("data_root",)


def _jsonable(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{what} cannot be written to {CONFIG_NAME} ({err}); use JSON-like values") from None


def _write_tokenizer(tokenizer: Tokenizer, out: Path) -> dict[str, Any]:
    """Write the tokenizer's files; return its ``config.json`` entry (everything else its state holds)."""
    state = tokenizer.state_dict()
    entry: dict[str, Any] = {"kind": state.pop("kind"), "vocab_size": tokenizer.vocab_size, "file": None}
    if "symbols" in state:
        symbols, counts = state.pop("symbols"), state.pop("counts")
        # A symbol never holds "\n" (lines are split on it) and may hold a tab only in character vocabularies, so
        # "symbol<TAB>count" split at the last tab is exact. Bytes, not text mode: a "\r" symbol must survive.
        lines = "".join(f"{symbol}\t{count}\n" for symbol, count in zip(symbols, counts, strict=True))
        (out / VOCAB_NAME).write_bytes(lines.encode("utf-8"))
        entry["file"] = VOCAB_NAME
    if "model_proto" in state:
        (out / SENTENCEPIECE_NAME).write_bytes(base64.b64decode(state.pop("model_proto")))
        entry["file"] = SENTENCEPIECE_NAME
    entry["options"] = _jsonable(state, "the tokenizer's settings")  # e.g. spaced_symbols
    return entry


def typed_result(result: EvaluationResult | dict[str, Any]) -> EvaluationResult:
    """An evaluation result, as scored or as its JSON (``lm-zoo evaluate --json``, an export's ``config.json``).

    Raises:
        CheckpointError: the JSON lacks what a model card must state, or holds what this lm-zoo does not know.
    """
    return result_from_json(result) if isinstance(result, dict) else result


def _check_result_kinds(loaded: LoadedModel, results: Sequence[EvaluationResult]) -> None:
    """Refuse a text model's result for a music model, or the other way round (they would mislabel the card)."""
    stray = next((r for r in results if r.kind is not loaded.kind), None)
    if stray is not None:
        raise CheckpointError(
            f"{loaded.source} is a {loaded.kind.name} model but a result to export is a {stray.kind.metric_words} "
            f"one (split {stray.split!r}): pass the `lm-zoo evaluate --json` output of this model"
        )


def build_config(
    loaded: LoadedModel,
    results: Sequence[EvaluationResult],
    tokenizer_entry: dict[str, Any] | None,
    dtype: str = "float32",
) -> dict:
    """The ``config.json`` of ``loaded`` (``tokenizer_entry`` is ``None`` for a music model).

    Raises:
        CheckpointError: a result is of the other kind of model (perplexity for a music model, or NLL per frame for
            a text model), or a setting is not JSON-like.
    """
    settings = asdict(loaded.model.config)  # zoo.language_model.LMConfig or zoo.music.PianoRollConfig
    _check_result_kinds(loaded, results)
    training = {"data": {k: v for k, v in loaded.data.items() if k not in _LOCAL_DATA_SETTINGS}, **loaded.training}
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSIONS[loaded.kind],
        "lm_zoo_version": lm_zoo_version(),
        "architecture": settings["architecture"],
        # A summary: "model" holds every option, a text model's head included; a piano-roll model has one output,
        # a Bernoulli per note, and this names it.
        "head": loaded.kind.head or settings["head"],
        "model": settings,
        "num_parameters": loaded.model.num_parameters(),
        "dtype": dtype,
        "tokenizer": tokenizer_entry,
        "training": training,
        "results": [result.to_json(stored=True) for result in results],
    }
    return _jsonable(config, "the model's settings")


def stored_dtype(name: str) -> torch.dtype:
    """The torch dtype an export stores its weights in, by name (:data:`STORED_DTYPES`).

    Raises:
        CheckpointError: no such storage dtype.
    """
    if name not in STORED_DTYPES:
        raise CheckpointError(f"cannot store weights as {name!r}: choose one of {', '.join(STORED_DTYPES)}")
    return STORED_DTYPES[name]


def export_model(
    loaded: LoadedModel,
    out_dir: str | Path,
    results: Sequence[EvaluationResult | dict[str, Any]] | None = None,
    dtype: str = "float32",
    curve: Path | None = None,
    repo_id: str | None = None,
    assets: dict[str, Path] | None = None,
    revision: str | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write ``loaded`` as an export directory.

    Args:
        loaded: the model (e.g. from :func:`checkpoints.load`); its weights are written as they are, so a
            weight-averaged checkpoint exports the averaged weights.
        out_dir: created if needed; a previous export there is replaced.
        results: ``lm-zoo evaluate`` results (or their JSON) for the model card; ``None`` keeps those ``loaded`` came
            with.
        dtype: ``float32``, or ``float16`` for half the size (loading casts back to float32; results measured on
            the float32 weights are then no longer those of the stored ones: measure the export itself).
        curve: a learning-curve PNG to ship as ``learning_curve.png`` (the card shows it).
        repo_id: the Hub repo the card's examples name (``lm-zoo publish`` renders it so anyway).
        assets: further files to ship, by their name in the export (:data:`ASSET_NAMES`): a music model's
            ``sample.mid`` and ``sample.png`` (the card shows them when ``training.run.sample`` records them).
        revision: a bundled model's registered revision: its card then names the model by its short name
            (:func:`checkpoints.model_card.render_card`).
        max_shard_size: write the weights as shards of at most this size (:func:`save_weights`); ``None``: one file.

    Returns:
        The directory.

    Raises:
        CheckpointError: ``out_dir`` holds something that is not an export, a setting is not JSON-like, an asset has
            a name an export does not ship, a result is of the other kind of model (text / music), or the system
            refused a write (the export that was there, if any, is then unchanged).
    """
    out = check_out_dir(out_dir)
    stored_dtype(dtype)
    files = dict(assets or {})
    if curve is not None:
        files[CURVE_NAME] = curve
    unknown = sorted(set(files) - set(ASSET_NAMES))
    if unknown:
        raise CheckpointError(f"an export does not ship {unknown[0]!r}: its extra files are {', '.join(ASSET_NAMES)}")
    # Read before clearing: an asset may be this export's own file (a bundle rebuilt in place).
    contents = {name: path.read_bytes() for name, path in files.items()}
    results = [typed_result(r) for r in (loaded.results if results is None else results)]
    _check_result_kinds(loaded, results)  # before writing anything
    out.mkdir(parents=True, exist_ok=True)
    # Everything is written into a folder beside ``out`` first: a write that fails (a full disk, a permission taken
    # away) leaves the previous export whole and no half-written files, and only whole files are moved in.
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        tokenizer_entry = None if loaded.tokenizer is None else _write_tokenizer(loaded.tokenizer, staging)
        config = build_config(loaded, results, tokenizer_entry, dtype)
        for name, data in contents.items():
            (staging / name).write_bytes(data)
        network = loaded.model.cpu()
        if next(network.parameters()).dtype != STORED_DTYPES[dtype]:
            network = copy.deepcopy(network).to(STORED_DTYPES[dtype])  # the caller's model keeps its precision
        save_weights(network, staging, max_shard_size)
        config[HASHES_KEY] = export_file_hashes(staging)  # checked at every load (format.verify_export_files)
        (staging / CARD_NAME).write_text(render_card(config, repo_id, revision), encoding="utf-8")
        for weights in staging.glob("model*.safetensors"):  # safetensors writes 0600; share them like the rest
            shutil.copymode(staging / CARD_NAME, weights)
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        reason = (error.strerror or str(error)).lower()
        kept = "the export that was there is unchanged" if _is_export(out) else "nothing was left there"
        raise CheckpointError(
            f"{out}: the export could not be written ({reason}); {kept}: free some space or fix the permissions, "
            "then export again"
        ) from error
    _move_into(staging, out)
    return out


def _move_into(staging: Path, out: Path) -> None:
    """Replace the export files in ``out`` with those written to ``staging`` (on the same filesystem: renames).

    ``config.json`` goes first and comes back last: while files are moved, ``out`` holds no config and loads as
    nothing, never as a mix of two exports. A previous export's files that this one does not ship go (its vocab.txt
    may not be this model's tokenizer.model); anything else in ``out`` stays.
    """
    (out / CONFIG_NAME).unlink(missing_ok=True)
    written = {path.name for path in staging.iterdir()}
    for path in out.iterdir():  # a previous export's files this one does not ship (old shards among them)
        if is_export_file(path.name) and path.name not in written:
            path.unlink()
    for name in sorted(written - {CONFIG_NAME}) + [CONFIG_NAME]:
        os.replace(staging / name, out / name)
    shutil.rmtree(staging, ignore_errors=True)


def save_weights(network: torch.nn.Module, directory: Path, max_shard_size: int | str | None = None) -> list[str]:
    """Write ``network``'s weights into ``directory``: ``model.safetensors``, or, with ``max_shard_size`` (bytes, or
    ``"16MB"``: decimal units, as the Hub writes them), shards of at most that size and their index, by
    huggingface_hub's ``split_torch_state_dict_into_shards`` (a tensor larger than the limit gets a shard of its own).
    Tied tensors share memory and are stored once, under one of their names (loading fills every name).

    Returns:
        The weight files written (the index last).
    """
    if max_shard_size is None:
        # save_model (not save_file) because tied tensors share memory: it stores one and records the alias.
        save_model(network, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return [WEIGHTS_NAME]
    from huggingface_hub import split_torch_state_dict_into_shards  # deferred: only a sharded export needs it

    state = network.state_dict()
    stored: dict[tuple[int, tuple[int, ...]], str] = {}  # a tied tensor (one memory, one shape) is saved once
    for name in sorted(state):
        stored.setdefault((state[name].data_ptr(), tuple(state[name].shape)), name)
    state = {name: state[name] for name in sorted(stored.values())}
    storages = [tensor.untyped_storage().data_ptr() for tensor in state.values()]
    # safetensors refuses tensors that share memory in other ways (views of one buffer): those are copied.
    state = {
        name: tensor.clone() if storages.count(tensor.untyped_storage().data_ptr()) > 1 else tensor.contiguous()
        for name, tensor in state.items()
    }
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        save_file({name: state[name] for name in names}, str(directory / file), metadata={"format": "pt"})
    files = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}}
        index["weight_map"] = dict(sorted(split.tensor_to_filename.items()))
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        files.append(INDEX_NAME)
    return files


def _is_export(directory: Path) -> bool:
    try:
        read_config(directory, str(directory))
    except CheckpointError:
        return False
    return True


def measure(
    loaded: LoadedModel,
    splits: Iterable[str],
    batch_size: int | None = None,
    bptt: int | None = None,
    data_root: str | None = None,
    device: str = "cpu",
    max_tokens: int | None = None,
) -> list[EvaluationResult]:
    """Evaluate ``loaded`` on each split the way ``lm-zoo evaluate`` does; the results for a model card.

    As its kind is scored (:func:`evaluation.dispatch.score_split`: a text model deterministically, with the full
    softmax; a music model in NLL per frame); ``max_tokens``: only
    up to the window holding each split's this-many-th token (frame), as ``lm-zoo evaluate --max-tokens``.
    """
    splits = list(splits)
    if not splits:
        return []
    datamodule = loaded.datamodule(data_root=data_root)
    sizes = (batch_size, bptt, device, max_tokens)
    return [score_split(loaded.model, loaded.kind, datamodule, split, *sizes) for split in splits]


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a path an export can be written to, checked before anything is measured or replaced.

    Raises:
        CheckpointError: it is a file, a directory that holds something other than an export, or under a path that
            cannot be created or written (the nearest existing parent is not a writable directory).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file: choose a directory")
    if out.is_dir() and any(out.iterdir()) and not _is_export(out):
        raise CheckpointError(f"{out} exists and is not an lm-zoo export: choose an empty or new --out directory")
    parent = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = "is not a directory" if not parent.is_dir() else "is not writable"
        raise CheckpointError(f"--out {out}: cannot be created, {parent} {why}: choose another directory")
    return out


def export(
    source: str | Path,
    out_dir: str | Path,
    *,
    splits: Sequence[str] = REPORTED_SPLITS,
    results: Sequence[dict[str, Any]] | None = None,
    batch_size: int | None = None,
    bptt: int | None = None,
    data_root: str | None = None,
    device: str = "cpu",
    max_shard_size: int | str | None = None,
    dtype: str = "float32",
) -> Path:
    """Load a SOURCE, measure it on ``splits`` (unless ``results`` are given), and export it.

    Args:
        source: a ``.ckpt``, an export directory or a Hub repo id.
        out_dir: the export directory.
        splits: splits to evaluate for the model card; empty to measure nothing.
        results: results measured before (``lm-zoo evaluate --json``), used instead of evaluating.
        batch_size: eval batch size (default: the training run's).
        bptt: eval BPTT (default: the training run's).
        data_root: where the corpus lives (default ``$LM_ZOO_DATA``).
        device: where to evaluate.
        max_shard_size: shards of at most this size (:func:`save_weights`); ``None``: one weights file.
        dtype: how the weights are stored (:data:`STORED_DTYPES`); the figures measured here are those of the
            stored weights (rounded to ``dtype`` first), as a load of the export computes with them.
    """
    check_out_dir(out_dir)  # before the minutes of measuring
    stored = stored_dtype(dtype)
    loaded = load(source)
    if results is None:
        with torch.no_grad():
            for tensor in loaded.model.state_dict().values():
                if tensor.is_floating_point():
                    tensor.copy_(tensor.to(stored))
        results = measure(loaded, splits, batch_size, bptt, data_root, device)
    # An export re-exported (a bundled or downloaded model) keeps the pictures and samples its card shows.
    origin = Path(loaded.source)
    assets = {name: origin / name for name in ASSET_NAMES if origin.is_dir() and (origin / name).is_file()}
    return export_model(loaded, out_dir, results, dtype, assets=assets, max_shard_size=max_shard_size)
