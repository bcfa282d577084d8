"""The export format: a directory a model can be shared as, loaded without unpickling anything.

::

    config.json        what the model is: {"format": "lm-zoo", "format_version", "lm_zoo_version", "architecture",
                       "head", "model": <every zoo.RecurrentLM constructor argument>, "num_parameters", "dtype",
                       "tokenizer": {"kind", "vocab_size", "file", "options"} (null for music),
                       "training": {"data": <data module settings>, "optimizers", "epoch", "global_step",
                                    "weight_averaged", "config": <the run's LightningCLI config, when found>},
                       "results": [<lm-zoo evaluate results>]}
    model.safetensors  the weights (tied weights stored once)
    vocab.txt          word/char vocabularies: one "symbol<TAB>training count" per line, in id order
    tokenizer.model    SentencePiece models: the model proto
    README.md          the model card (checkpoints.model_card), whose model-index holds the results
    learning_curve.png, sample.mid, sample.png   optional: the run's learning curve and, for a music model, a sampled
                       piece (checkpoints.bundle writes them; the card shows them)

``config.json`` is written last, so a directory without it is never mistaken for a complete export. The model's
settings are copied from ``RecurrentLM.config`` as they are: options added to it later travel without any change here.

Format 2 (every text model's export) stores the plain network, :class:`zoo.RecurrentLM`: ``model`` holds its
constructor arguments and ``model.safetensors`` its state dict. Format 1 stored the ``LanguageModel``'s settings,
training-only ``ar`` / ``tar`` included; its tensor names are the same, so a format-1 export loads as it is (those two
options are ignored).

Format 3 adds models of piano-roll music (:class:`zoo.music.PianoRollLM`), told apart by ``"head": "bernoulli"`` (one
Bernoulli per note; a text model's head is ``softmax``, ``nce``, ...). Their ``model`` holds ``PianoRollLM.config``,
``"tokenizer"`` is ``null`` (a frame of 88 notes is its own input: there is no tokenizer and no tokenizer file),
``training.data`` the ``MusicDataModule`` settings (``dataset``, batch sizes, BPTT, ...) and ``results`` the
``lm-zoo evaluate`` records of music (:data:`MUSIC_RESULT_KEYS`: ``nll_per_step``, nats per frame summed over the
notes, and ``nll_per_note``, with the frames, pieces, eval batch size and BPTT). An export says the lowest version
that describes it: text exports are still written as format 2, byte for byte as before, so an lm-zoo from before
music reads them; a music export is format 3, so such an lm-zoo asks to be upgraded instead of failing on its
``null`` tokenizer.
"""

from __future__ import annotations

import base64
import copy
import importlib.metadata
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

import zoo
from checkpoints.ckpt import LoadedModel, build_model, build_music_model, load_weights
from datamodules.tokenizers import Tokenizer
from zoo.errors import CheckpointError, LMZooError, clip

FORMAT = "lm-zoo"
FORMAT_VERSION = 3  # the newest this lm-zoo reads (and writes, for music)
TEXT_FORMAT_VERSION = 2  # what a text model's export is written as: unchanged since format 2
MUSIC_HEAD = "bernoulli"  # config.json's "head" of a piano-roll model: one Bernoulli per note (zoo.music)
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
VOCAB_NAME = "vocab.txt"
SENTENCEPIECE_NAME = "tokenizer.model"
CARD_NAME = "README.md"
CURVE_NAME = "learning_curve.png"  # the run's learning curve, when the export was built from one (checkpoints.bundle)
SAMPLE_MIDI_NAME = "sample.mid"  # a music model's sampled piece (checkpoints.bundle), to listen to
SAMPLE_PNG_NAME = "sample.png"  # the same piece as a piano roll, which the card shows
# Files an export may ship besides its config, weights, tokenizer and card: copied in by export_model(assets=...).
ASSET_NAMES = (CURVE_NAME, SAMPLE_MIDI_NAME, SAMPLE_PNG_NAME)
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, VOCAB_NAME, SENTENCEPIECE_NAME, CARD_NAME, *ASSET_NAMES)
# How the weights may be stored; the loaded model computes in float32 either way.
STORED_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Files that hold pickles (torch.save / Lightning): loading one runs whatever code it names.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Settings of the training machine, not of the recipe: a downloaded model uses the user's own data root.
_LOCAL_DATA_SETTINGS = ("data_root",)
# What an evaluation result keeps in config.json and the card ("source" is a local path).
RESULT_KEYS = ("split", "corpus", "tokenizer", "tokens", "loss", "ppl", "bpc", "word_ppl", "eval_batch_size", "bptt")
# The same for a music model (lightning_modules.music.evaluate_music): nats per frame, summed over the 88 notes.
MUSIC_RESULT_KEYS = ("split", "dataset", "nll_per_step", "nll_per_note", "frames", "pieces", "eval_batch_size", "bptt")
# How a result was obtained (lm-zoo evaluate's procedures): kept, so a tempered, MC-dropout or dynamic-evaluation
# number is never shown as a plain deterministic one.
PROCEDURE_KEYS = (
    "method",
    "long_context",
    "temperature",
    "temperature_search",
    "mc_samples",
    "dropout_scale",
    "dynamic",
)


def lm_zoo_version() -> str:
    """The installed lm-zoo version (``unknown`` when running from a source tree that is not installed)."""
    try:
        return importlib.metadata.version("lm-zoo")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------------------------------- writing
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


def is_music_result(result: dict[str, Any]) -> bool:
    """Whether ``result`` is a music model's (NLL per frame) rather than a text model's (perplexity / bpc)."""
    return "nll_per_step" in result


def result_record(result: dict[str, Any]) -> dict[str, Any]:
    """An ``lm-zoo evaluate`` result as exports keep it (no local paths), a text model's or a music model's.

    Raises:
        CheckpointError: the result lacks what a model card must state.
    """
    music = is_music_result(result)
    figures = ("nll_per_step",) if music else ("loss", "ppl")
    missing = [k for k in ("split", *figures, "eval_batch_size", "bptt") if k not in result]
    if missing:
        raise CheckpointError(
            f"an evaluation result lacks {', '.join(missing)}: pass the output of `lm-zoo evaluate --json`"
        )
    keys = MUSIC_RESULT_KEYS if music else RESULT_KEYS + PROCEDURE_KEYS
    return {k: result[k] for k in keys if k in result}


def _check_result_kinds(loaded: LoadedModel, results: Sequence[dict[str, Any]]) -> None:
    """Refuse a text model's result for a music model, or the other way round (they would mislabel the card)."""
    stray = next((r for r in results if is_music_result(r) != loaded.is_music), None)
    if stray is not None:
        kind, other = ("music", "perplexity / bpc") if loaded.is_music else ("text", "NLL per frame")
        raise CheckpointError(
            f"{loaded.source} is a {kind} model but a result to export is a {other} one (split "
            f"{stray.get('split')!r}): pass the `lm-zoo evaluate --json` output of this model"
        )


def build_config(
    loaded: LoadedModel,
    results: Sequence[dict[str, Any]],
    tokenizer_entry: dict[str, Any] | None,
    dtype: str = "float32",
) -> dict:
    """The ``config.json`` of ``loaded`` (``tokenizer_entry`` is ``None`` for a music model).

    Raises:
        CheckpointError: a result is of the other kind of model (perplexity for a music model, or NLL per frame for
            a text model), or a setting is not JSON-like.
    """
    settings = loaded.model.config
    music = loaded.is_music
    _check_result_kinds(loaded, results)
    training = {"data": {k: v for k, v in loaded.data.items() if k not in _LOCAL_DATA_SETTINGS}, **loaded.training}
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if music else TEXT_FORMAT_VERSION,
        "lm_zoo_version": lm_zoo_version(),
        "architecture": settings["architecture"],
        # A summary: "model" holds every option, a text model's head included; a piano-roll model has one output,
        # a Bernoulli per note, and this names it.
        "head": MUSIC_HEAD if music else settings["head"],
        "model": settings,
        "num_parameters": loaded.model.num_parameters(),
        "dtype": dtype,
        "tokenizer": tokenizer_entry,
        "training": training,
        "results": [result_record(r) for r in results],
    }
    return _jsonable(config, "the model's settings")


def export_model(
    loaded: LoadedModel,
    out_dir: str | Path,
    results: Sequence[dict[str, Any]] | None = None,
    dtype: str = "float32",
    curve: Path | None = None,
    repo_id: str | None = None,
    assets: dict[str, Path] | None = None,
) -> Path:
    """Write ``loaded`` as an export directory.

    Args:
        loaded: the model (e.g. from :func:`checkpoints.load`); its weights are written as they are, so a
            weight-averaged checkpoint exports the averaged weights.
        out_dir: created if needed; a previous export there is replaced.
        results: ``lm-zoo evaluate`` results for the model card; ``None`` keeps those ``loaded`` came with.
        dtype: ``float32``, or ``float16`` for half the size (loading casts back to float32; results measured on
            the float32 weights are then no longer those of the stored ones: measure the export itself).
        curve: a learning-curve PNG to ship as ``learning_curve.png`` (the card shows it).
        repo_id: the Hub repo the card's examples name (``lm-zoo publish`` renders it so anyway).
        assets: further files to ship, by their name in the export (:data:`ASSET_NAMES`): a music model's
            ``sample.mid`` and ``sample.png`` (the card shows them when ``training.run.sample`` records them).

    Returns:
        The directory.

    Raises:
        CheckpointError: ``out_dir`` holds something that is not an export, a setting is not JSON-like, an asset has
            a name an export does not ship, or a result is of the other kind of model (text / music).
    """
    from safetensors.torch import save_model

    from checkpoints.model_card import render_card

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file: choose a directory")
    if out.is_dir() and any(out.iterdir()) and not _is_export(out):
        raise CheckpointError(f"{out} exists and is not an lm-zoo export: choose an empty or new --out directory")
    if dtype not in STORED_DTYPES:
        raise CheckpointError(f"cannot store weights as {dtype!r}: choose one of {', '.join(STORED_DTYPES)}")
    files = dict(assets or {})
    if curve is not None:
        files[CURVE_NAME] = curve
    unknown = sorted(set(files) - set(ASSET_NAMES))
    if unknown:
        raise CheckpointError(f"an export does not ship {unknown[0]!r}: its extra files are {', '.join(ASSET_NAMES)}")
    # Read before clearing: an asset may be this export's own file (a bundle rebuilt in place).
    contents = {name: path.read_bytes() for name, path in files.items()}
    results = loaded.results if results is None else results
    _check_result_kinds(loaded, results)  # before writing anything
    out.mkdir(parents=True, exist_ok=True)
    for name in EXPORT_FILES:  # a previous export's files (its vocab.txt may not be this model's tokenizer.model)
        (out / name).unlink(missing_ok=True)
    tokenizer_entry = None if loaded.tokenizer is None else _write_tokenizer(loaded.tokenizer, out)
    config = build_config(loaded, results, tokenizer_entry, dtype)
    for name, data in contents.items():
        (out / name).write_bytes(data)
    network = loaded.model.cpu()
    if next(network.parameters()).dtype != STORED_DTYPES[dtype]:
        network = copy.deepcopy(network).to(STORED_DTYPES[dtype])  # the caller's model keeps its precision
    # save_model (not save_file) because tied tensors share memory: it stores one and records the alias.
    save_model(network, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CARD_NAME).write_text(render_card(config, repo_id), encoding="utf-8")
    shutil.copymode(out / CARD_NAME, out / WEIGHTS_NAME)  # safetensors writes 0600; share it like the rest
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


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
) -> list[dict[str, Any]]:
    """Evaluate ``loaded`` on each split the way ``lm-zoo evaluate`` does; the results for a model card.

    A music model is scored by :func:`lightning_modules.music.evaluate_music` (NLL per frame), a text model by
    :func:`lightning_modules.evaluation.evaluate` (deterministic, full softmax).
    """
    from lightning_modules.evaluation import evaluate
    from lightning_modules.music import evaluate_music

    splits = list(splits)
    if not splits:
        return []
    datamodule = loaded.datamodule(data_root=data_root)
    score = evaluate_music if loaded.is_music else evaluate
    return [result_record(score(loaded.model, datamodule, s, batch_size, bptt, device)) for s in splits]


def export(
    source: str | Path,
    out_dir: str | Path,
    *,
    splits: Sequence[str] = ("valid", "test"),
    results: Sequence[dict[str, Any]] | None = None,
    batch_size: int | None = None,
    bptt: int | None = None,
    data_root: str | None = None,
    device: str = "cpu",
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
    """
    from checkpoints import load

    loaded = load(source)
    if results is None:
        results = measure(loaded, splits, batch_size, bptt, data_root, device)
    # An export re-exported (a bundled or downloaded model) keeps the pictures and samples its card shows.
    origin = Path(loaded.source)
    assets = {name: origin / name for name in ASSET_NAMES if origin.is_dir() and (origin / name).is_file()}
    return export_model(loaded, out_dir, results, assets=assets)


# ------------------------------------------------------------------------------------------------------- reading
def pickle_refusal(where: str, pickles: Sequence[str]) -> CheckpointError:
    """The error for weights stored as pickles (``pytorch_model.bin``, ``*.pt``, ...) instead of safetensors."""
    return CheckpointError(
        f"{where} holds {', '.join(pickles[:3])} but no {WEIGHTS_NAME}: lm-zoo never loads pickled weights from a "
        "directory or the Hub (unpickling can run arbitrary code); for your own run pass the .ckpt file itself, or "
        "ask the publisher for an `lm-zoo export`"
    )


def refuse_pickles(directory: Path, where: str) -> None:
    """Refuse a directory whose weights are pickles instead of safetensors.

    Raises:
        CheckpointError: explaining why such files are never loaded.
    """
    if (directory / WEIGHTS_NAME).is_file():
        return  # the weights are safetensors; any pickle beside them is never read
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_refusal(where, pickles)


def read_config(directory: Path, where: str) -> dict[str, Any]:
    """Read and check an export's ``config.json``.

    Raises:
        CheckpointError: no such file, not JSON, not an lm-zoo config, or a newer format.
    """
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{where} is not an lm-zoo export (no {CONFIG_NAME}) nor a run (no checkpoints/best.ckpt under it): pass "
            "a .ckpt, a run's directory, a directory written by `lm-zoo export`, or a Hub repo id"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{where}: {CONFIG_NAME} is not valid JSON ({err}); export the model again") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        library = config.get("library_name") or config.get("model_type") if isinstance(config, dict) else None
        raise CheckpointError(
            f'{where} is not an lm-zoo model: its {CONFIG_NAME} has no "format": "{FORMAT}"'
            + (f" (it looks like a {library} model)" if library else "")
            + "; lm-zoo loads only models written by `lm-zoo export`"
        )
    version = config.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where} is in export format {version!r}, newer than this lm-zoo reads ({FORMAT_VERSION}): upgrade lm-zoo"
        )
    music = is_music_config(config)
    for key in ("model",) if music else ("model", "tokenizer"):
        if not isinstance(config.get(key), dict):
            raise CheckpointError(f'{where}: {CONFIG_NAME} has no "{key}" object; export the model again')
    if music and config.get("tokenizer") is not None:
        raise CheckpointError(
            f'{where}: {CONFIG_NAME} is a music model\'s ("head": "{MUSIC_HEAD}") yet names a tokenizer; a piano-roll '
            'model has none ("tokenizer": null): export the model again'
        )
    return config


def is_music_config(config: dict[str, Any]) -> bool:
    """Whether an export's ``config.json`` is a piano-roll model's (``"head": "bernoulli"``)."""
    return config.get("head") == MUSIC_HEAD


def _read_vocab(path: Path, where: str) -> tuple[list[str], list[int]]:
    symbols: list[str] = []
    counts: list[int] = []
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{where}: cannot read {path.name} ({err}); export the model again") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    for number, line in enumerate(lines, 1):
        symbol, _, count = line.rpartition("\t")
        if not symbol or not count.isdigit():
            raise CheckpointError(f"{where}: {path.name} line {number} is not 'symbol<TAB>count'; export again")
        symbols.append(symbol)
        counts.append(int(count))
    return symbols, counts


def _read_tokenizer(directory: Path, entry: dict[str, Any], where: str) -> Tokenizer:
    state: dict[str, Any] = {"kind": entry.get("kind"), **(entry.get("options") or {})}
    file = entry.get("file")
    if file is not None:
        if file not in (VOCAB_NAME, SENTENCEPIECE_NAME):
            raise CheckpointError(f"{where}: {CONFIG_NAME} names an unknown tokenizer file {file!r}")
        if not (directory / file).is_file():
            raise CheckpointError(f"{where} has no {file}, which its {CONFIG_NAME} names: download or export again")
    if file == VOCAB_NAME:
        state["symbols"], state["counts"] = _read_vocab(directory / VOCAB_NAME, where)
    elif file == SENTENCEPIECE_NAME:
        state["model_proto"] = base64.b64encode((directory / SENTENCEPIECE_NAME).read_bytes()).decode("ascii")
    try:
        tokenizer = Tokenizer.from_state_dict(state)
    except LMZooError as err:
        raise CheckpointError(f"{where}: its tokenizer cannot be rebuilt ({err})") from None
    except (RuntimeError, OSError) as err:  # sentencepiece refuses a corrupt model proto
        raise CheckpointError(f"{where}: {file} is not a valid tokenizer ({clip(str(err))})") from None
    if entry.get("vocab_size") != tokenizer.vocab_size:
        raise CheckpointError(
            f"{where}: {file} has {tokenizer.vocab_size} entries but {CONFIG_NAME} says the vocabulary has "
            f"{entry.get('vocab_size')}; the export is inconsistent, export it again"
        )
    return tokenizer


def _read_weights(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"{where} has no {WEIGHTS_NAME}: download or export the model again")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{where}: {WEIGHTS_NAME} is not a readable safetensors file ({clip(reason)}); it may be truncated: "
            "download or export the model again"
        ) from None


def load_export(directory: str | Path, source: str | None = None) -> LoadedModel:
    """Load an export directory: JSON, safetensors and the tokenizer files only, never a pickle.

    A music export (``"head": "bernoulli"``) gives a :class:`zoo.music.PianoRollLM` and no tokenizer.

    Args:
        directory: the directory (an ``lm-zoo export`` output, or a downloaded Hub snapshot).
        source: how to name it in messages and ``LoadedModel.source`` (e.g. the repo id); default the path.

    Raises:
        CheckpointError: it is not an export, a file is missing or corrupt, the architecture is unknown, or the
            weights do not fit the settings or vocabulary (the message names the tensors).
    """
    directory = Path(directory)
    where = source or str(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{where} is not a directory: pass a directory written by `lm-zoo export`")
    refuse_pickles(directory, where)
    config = read_config(directory, where)
    hparams = config["model"]
    architecture = hparams.get("architecture")
    if architecture not in zoo.names():
        raise CheckpointError(
            f"{where}: {CONFIG_NAME} names architecture {architecture!r}, which this lm-zoo does not have "
            f"(it has {', '.join(zoo.names())}): upgrade lm-zoo"
        )
    if is_music_config(config):
        tokenizer = None  # a frame is its own input
        model = build_music_model(hparams, where)
    else:
        tokenizer = _read_tokenizer(directory, config["tokenizer"], where)
        model = build_model(hparams, tokenizer, where)
    load_weights(model, _read_weights(directory / WEIGHTS_NAME, where), where)
    training = dict(config.get("training") or {})
    data = training.pop("data", {}) or {}
    results = [r for r in config.get("results") or [] if isinstance(r, dict)]
    return LoadedModel(model.eval(), tokenizer, data, where, training=training, results=results)
