"""The export format: a directory a model can be shared as, loaded without unpickling anything.

::

    config.json        what the model is: {"format": "lm-zoo", "format_version", "lm_zoo_version", "architecture",
                       "head", "model": <every zoo.LMConfig field>, "num_parameters", "dtype",
                       "tokenizer": {"kind", "vocab_size", "file", "options"} (null for music),
                       "training": {"data": <data module settings>, "optimizers", "epoch", "global_step",
                                    "weight_averaged", "config": <the run's LightningCLI config, when found>},
                       "results": [<lm-zoo evaluate results>]}
    model.safetensors  the weights (tied weights stored once); or, exported with --max-shard-size, shards
                       model-00001-of-0000N.safetensors ... and model.safetensors.index.json naming each tensor's
                       shard, Hugging Face's convention (every shard's sha256 is recorded like the single file's)
    vocab.txt          word/char vocabularies: one "symbol<TAB>training count" per line, in id order
    tokenizer.model    SentencePiece models: the model proto
    README.md          the model card (checkpoints.model_card), whose model-index holds the results
    learning_curve.png, sample.mid, sample.png   optional: the run's learning curve and, for a music model, a sampled
                       piece (release.bundle writes them; the card shows them)

``config.json`` is written last, so a directory without it is never mistaken for a complete export. The model's
settings are ``RecurrentLM.config`` (a :class:`zoo.LMConfig`) as a dict: fields added to it later travel without any
change here.

Format 2 (every text model's export) stores the plain network, :class:`zoo.RecurrentLM`: ``model`` holds its settings
(the fields of :class:`zoo.LMConfig`) and ``model.safetensors`` its state dict. Format 1 stored the ``LanguageModel``'s
settings, training-only ``ar`` / ``tar`` included; its tensor names are the same, so a format-1 export loads as it is
(those two options are ignored).

Format 3 adds models of piano-roll music (:class:`zoo.music.PianoRollLM`), told apart by ``"head": "bernoulli"`` (one
Bernoulli per note; a text model's head is ``softmax``, ``nce``, ...). Their ``model`` holds ``PianoRollLM.config``,
``"tokenizer"`` is ``null`` (a frame of 88 notes is its own input: there is no tokenizer and no tokenizer file),
``training.data`` the ``MusicDataModule`` settings (``dataset``, batch sizes, BPTT, ...) and ``results`` the
``lm-zoo evaluate`` records of music (:class:`~evaluation.results.MusicResult`: ``nll_per_step``,
nats per frame summed over the notes, and ``nll_per_note``, with the frames, pieces, eval batch size and BPTT). An
export says the lowest version
that describes it: text exports are still written as format 2, byte for byte as before, so an lm-zoo from before
music reads them; a music export is format 3, so such an lm-zoo asks to be upgraded instead of failing on its
``null`` tokenizer.
"""

from __future__ import annotations

import base64
import importlib.metadata
import inspect
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

import datamodules
import zoo
from datamodules.corpora import sha256_file
from datamodules.kinds import MUSIC, TEXT, ModelKind, kind_of_config
from datamodules.tokenizers import Tokenizer
from zoo.errors import CheckpointError, ConfigError, LMZooError, clip
from zoo.language_model import LMConfig, RecurrentLM
from zoo.music import PianoRollLM

if TYPE_CHECKING:
    from datamodules.stream_data import StreamData


FORMAT = "lm-zoo"
FORMAT_VERSION = 3  # the newest this lm-zoo reads
# What each kind's export is written as: the lowest version that describes it (a text model's is unchanged since 2).
FORMAT_VERSIONS = {TEXT: 2, MUSIC: FORMAT_VERSION}
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
VOCAB_NAME = "vocab.txt"
SENTENCEPIECE_NAME = "tokenizer.model"
CARD_NAME = "README.md"
CURVE_NAME = "learning_curve.png"  # the run's learning curve, when the export was built from one (release.bundle)
SAMPLE_MIDI_NAME = "sample.mid"  # a music model's sampled piece (release.bundle), to listen to
SAMPLE_PNG_NAME = "sample.png"  # the same piece as a piano roll, which the card shows
# Files an export may ship besides its config, weights, tokenizer and card: copied in by export_model(assets=...).
ASSET_NAMES = (CURVE_NAME, SAMPLE_MIDI_NAME, SAMPLE_PNG_NAME)
# Sharded weights, Hugging Face's convention (transformers' save_pretrained, huggingface_hub's
# split_torch_state_dict_into_shards): model-00001-of-00003.safetensors ..., and an index naming each tensor's shard.
INDEX_NAME = "model.safetensors.index.json"
SHARD_PATTERN = "model-*-of-*.safetensors"  # a glob, as the Hub's allow_patterns take it
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, VOCAB_NAME, SENTENCEPIECE_NAME, CARD_NAME, *ASSET_NAMES)
EXPORT_PATTERNS = (*EXPORT_FILES, SHARD_PATTERN)  # every file an export may hold, as Hub patterns
# The files whose sha256 an export's config records under HASHES_KEY (written by `lm-zoo export` and `bundle`), checked
# whenever the export is loaded: what the model computes with. The card and pictures describe it and may be redrawn.
HASHED_FILES = (WEIGHTS_NAME, INDEX_NAME, VOCAB_NAME, SENTENCEPIECE_NAME)  # and every shard
HASHES_KEY = "sha256"
# How the weights may be stored; the loaded model computes in float32 either way.
STORED_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Files that hold pickles (torch.save / Lightning): loading one runs whatever code it names.
NETWORK_OPTIONS = tuple(field.name for field in fields(LMConfig))  # what a format-1 export's model settings keep
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@dataclass
class LoadedModel:
    """A model ready to evaluate, sample from or export.

    Attributes:
        model: the network (a plain ``nn.Module``), in eval mode: a :class:`zoo.RecurrentLM`, or a
            :class:`zoo.music.PianoRollLM` for a model of piano rolls.
        tokenizer: the tokenizer it was trained with (``None`` for piano rolls, whose frames need none).
        data: the data module's settings at training time (corpus, batch sizes, BPTT, ...) and its ``class_path``.
        source: where it was loaded from.
        training: the rest of the recipe: optimizer settings, steps, epochs, whether the weights are an average, and
            the run's LightningCLI config when it was found.
        results: measured results (``lm-zoo evaluate`` dicts) that came with an exported model.
    """

    model: RecurrentLM | PianoRollLM
    tokenizer: Tokenizer | None
    data: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    training: dict[str, Any] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)

    @property
    def kind(self) -> ModelKind:
        """Text or music (a model of piano-roll frames): what its figures, data, output and commands are."""
        return MUSIC if isinstance(self.model, PianoRollLM) else TEXT

    def refuse(self, what: str) -> None:
        """Stop a command that does not serve this model: its kind's refusal (:meth:`ModelKind.refuse`, ``what`` one
        of :data:`datamodules.kinds.SCORE`, ``PROCEDURES``, ``SYNEVAL``, ``PARSE``, ``QUANTIZE``), told by its kind and
        its tokenizer's.

        Raises:
            ConfigError: one line naming the model, its kind and what would serve.
        """
        self.kind.refuse(what, self.source, self._tokens)

    @property
    def called(self) -> str:
        """What it is, in words, for a message: ``a word-level text model``, ``a music model (piano rolls)``."""
        return self.kind.called(self._tokens)

    @property
    def _tokens(self) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.kind

    def datamodule(self, corpus: str | None = None, data_root: str | None = None) -> StreamData:
        """The data module the model was trained with (its class and settings, or on ``corpus``: for a music model
        another dataset), using the model's own tokenizer. A text model's is :class:`datamodules.TextData`, the
        ``TextDataModule`` without Lightning: scoring and sampling need the corpus, not a Trainer. Its windows are
        of fixed length, the training split's too: a recipe's ``variable_bptt`` draws the lengths of training windows,
        while what reads a loaded model's training split scores with it (``--dynamic``'s gradient statistics, one
        segment of ``--dyn-max-time-steps`` at a time, as Krause et al. 2017 take them).

        Raises:
            ConfigError: the model does not say which corpus it was trained on and none was given.
            CheckpointError: the recorded data module class is not one of lm-zoo's.
        """
        settings = dict(self.data)
        data_class = data_module_class(settings.pop("class_path", None), self.source)
        key = self.kind.data_key
        # A module that generates its examples from its settings (the reverse-copy task) reads no corpus files.
        reads_files = key in inspect.signature(data_class).parameters
        if corpus is not None and not reads_files:
            raise ConfigError(f"{self.source} generates its data ({data_class.__name__}): --corpus does not apply")
        if reads_files and not settings.get(key) and corpus is None:
            raise ConfigError(f"{self.source} does not say which {key} it was trained on: pass --corpus")
        if corpus is not None:
            settings[key] = corpus
        if data_root is not None and reads_files:
            settings["data_root"] = data_root
        if settings.get("variable_bptt"):
            settings["variable_bptt"] = False  # scored, never trained: fixed-length windows (above)
        datamodule = data_class(**settings)
        if self.tokenizer is not None:
            datamodule.use_tokenizer(self.tokenizer)
        return datamodule

    def sample(
        self,
        prompt: str = "",
        num_samples: int = 5,
        max_tokens: int = 100,
        temperature: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        device: str = "cpu",
    ) -> tuple[list[str], float]:
        """Sample text continuing ``prompt`` (``lm-zoo generate``).

        Every sample starts at the beginning of a line: the end-of-line token is its context, then the prompt. A
        sentence model (GBW) starts from <S> with a zero state and a row stops at </S>, so each sample is one
        independent sentence.

        Args:
            prompt: text to continue.
            num_samples: how many samples.
            max_tokens: most tokens per sample (a sample ends at the end-of-line / end-of-sentence token).
            temperature: softmax temperature; ``None``: 0.7 for sentence models (as Léonard 2016 samples), else 1.
            top_k: sample among the k most likely tokens only.
            seed: for reproducible samples.
            device: where to run the model.

        Returns:
            ``(texts, temperature)``: the samples with their prompt, and the temperature used.
        """
        tokenizer, model = self.tokenizer, self.model.to(device)
        temperature = temperature if temperature is not None else (0.7 if tokenizer.sentences else 1.0)
        prompt_ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
        prompt_batch = torch.tensor([prompt_ids] * num_samples, device=device)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        samples = model.generate(
            prompt_batch, max_tokens, temperature, top_k, stop_id=tokenizer.eos_id, generator=generator
        )
        return [tokenizer.decode(prompt_ids[1:] + ids).rstrip("\n") for ids in samples], temperature


def data_module_class(class_path: str | None, where: str) -> type[StreamData]:
    """The data module class a model records in its data settings (``class_path``); ``None`` (models saved before
    it was recorded) means ``TextDataModule``, for which its Lightning-free twin ``TextData`` is returned.

    Only lm-zoo's own data modules are looked up, by name: a downloaded ``config.json`` never makes lm-zoo import
    anything else.

    Raises:
        CheckpointError: the class is not one of lm-zoo's data modules.
    """
    from datamodules.stream_data import StreamData

    name = (class_path or "TextDataModule").rsplit(".", 1)[-1]
    name = "TextData" if name == "TextDataModule" else name  # the same class without Lightning, which costs its import
    found = getattr(datamodules, name, None) if name in datamodules.__all__ else None
    if not (isinstance(found, type) and issubclass(found, StreamData)):
        raise CheckpointError(
            f"{where} was trained with the data module {class_path!r}, which this lm-zoo does not have; upgrade lm-zoo"
        )
    return found


def public_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Constructor settings without LightningCLI's private entries (``_class_path``, ``_instantiator``)."""
    return {k: v for k, v in settings.items() if not k.startswith("_")}


def build_model(settings: dict[str, Any], tokenizer: Tokenizer, where: str) -> RecurrentLM:
    """Construct the network its settings describe, after checking them against the tokenizer.

    Args:
        settings: :class:`zoo.RecurrentLM` constructor arguments (a ``.ckpt``'s reader leaves out the
            ``LanguageModel``'s own, :mod:`checkpoints.ckpt_read`).
        tokenizer: the tokenizer the model is used with.
        where: names the source in error messages.

    Raises:
        CheckpointError: the vocabulary sizes disagree, or the settings are unknown to this lm-zoo.
    """
    if settings.get("vocab_size") != tokenizer.vocab_size:
        raise CheckpointError(
            f"{where}: the model expects {settings.get('vocab_size')} tokens but its tokenizer has "
            f"{tokenizer.vocab_size}; the checkpoint is inconsistent, use another one"
        )
    try:
        return RecurrentLM(**settings)
    except TypeError as err:
        raise CheckpointError(f"{where} has settings this lm-zoo does not know ({err}); upgrade lm-zoo") from None


def build_music_model(settings: dict[str, Any], where: str) -> PianoRollLM:
    """Construct the piano-roll network its settings (:class:`zoo.music.PianoRollLM` constructor arguments) describe.

    Raises:
        CheckpointError: the settings are unknown to this lm-zoo.
    """
    try:
        return PianoRollLM(**settings)
    except TypeError as err:
        raise CheckpointError(f"{where} has settings this lm-zoo does not know ({err}); upgrade lm-zoo") from None


def _tied_names(state: dict[str, Tensor]) -> dict[str, set[str]]:
    """Each tensor name -> the other names that share its storage (tied weights), for names that have any."""
    groups: dict[tuple[int, tuple[int, ...]], set[str]] = {}
    for name, tensor in state.items():
        groups.setdefault((tensor.data_ptr(), tuple(tensor.shape)), set()).add(name)
    return {name: group - {name} for group in groups.values() if len(group) > 1 for name in group}


def load_weights(
    model: RecurrentLM | PianoRollLM, state: dict[str, Tensor], where: str, remedy: str | None = None
) -> None:
    """Load ``state`` into ``model`` strictly: every tensor must be there and nothing else.

    A tied tensor (the softmax sharing the embedding) may be stored under any one of its names, as safetensors stores
    it once; loading it once fills all of them.

    Args:
        model: the network to fill.
        state: its weights, by name.
        where: names the weights' source in error messages.
        remedy: what the error says to do (default: for weights read with their own settings).

    Raises:
        CheckpointError: naming the missing or unexpected tensors, or the first size mismatch.
    """
    expected = model.state_dict()
    tied = _tied_names(expected)
    missing = sorted(k for k in expected if k not in state and not (tied.get(k, set()) & state.keys()))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not match its architecture: missing tensors {missing[:5]}, unexpected tensors "
            f"{unexpected[:5]}; {remedy or 'use weights written by this lm-zoo version for this configuration'}"
        )
    try:
        model.load_state_dict(state, strict=False)  # strictness checked above, tied names included
    except RuntimeError as err:
        mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), clip(str(err)))
        remedy = remedy or "the weights do not fit the stored settings"
        raise CheckpointError(f"{where}: {mismatch.rstrip('.')}; {remedy}") from None


def lm_zoo_version() -> str:
    """The installed lm-zoo version (``unknown`` when running from a source tree that is not installed)."""
    try:
        return importlib.metadata.version("lm-zoo")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------------------------------- reading
def pickle_refusal(where: str, pickles: Sequence[str]) -> CheckpointError:
    """The error for weights stored as pickles (``pytorch_model.bin``, ``*.pt``, ...) instead of safetensors."""
    return CheckpointError(
        f"{where} holds {', '.join(pickles[:3])} but no {WEIGHTS_NAME}: lm-zoo never loads pickled weights from a "
        "directory or the Hub (unpickling can run arbitrary code); for your own run pass the .ckpt file itself, or "
        "ask the publisher for an `lm-zoo export`"
    )


def is_export_file(name: str) -> bool:
    """Whether a file of this name belongs to an export (:data:`EXPORT_FILES`, or a shard of sharded weights)."""
    return name in EXPORT_FILES or _SHARD_NAME.fullmatch(name) is not None


def refuse_pickles(directory: Path, where: str) -> None:
    """Refuse a directory whose weights are pickles instead of safetensors.

    Raises:
        CheckpointError: explaining why such files are never loaded.
    """
    if (directory / WEIGHTS_NAME).is_file() or (directory / INDEX_NAME).is_file():
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
    kind = kind_of_config(config)
    for key in ("model", "tokenizer") if kind.has_tokenizer else ("model",):
        if not isinstance(config.get(key), dict):
            raise CheckpointError(f'{where}: {CONFIG_NAME} has no "{key}" object; export the model again')
    if not kind.has_tokenizer and config.get("tokenizer") is not None:
        raise CheckpointError(
            f'{where}: {CONFIG_NAME} is a {kind.name} model\'s ("head": "{kind.head}") yet names a tokenizer; a '
            'piano-roll model has none ("tokenizer": null): export the model again'
        )
    return config


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


def read_weights(directory: Path, where: str) -> dict[str, torch.Tensor]:
    """The exported weights: ``model.safetensors``, or every shard its ``model.safetensors.index.json`` names.

    Raises:
        CheckpointError: a weights file or the index is missing, unreadable or inconsistent (naming the file).
    """
    if not (directory / INDEX_NAME).is_file():
        return _read_safetensors(directory / WEIGHTS_NAME, where)
    try:
        weight_map = json.loads((directory / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{where}: {INDEX_NAME} is not a shard index ({clip(str(err))}): {_AGAIN}") from None
    if not shards or not all(isinstance(s, str) and _SHARD_NAME.fullmatch(s) for s in shards):
        raise CheckpointError(f"{where}: {INDEX_NAME} names files that are not weight shards: {_AGAIN}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = _read_safetensors(directory / shard, where)
        listed = {name for name, file in weight_map.items() if file == shard}
        if set(tensors) != listed:
            raise CheckpointError(f"{where}: {shard} does not hold the tensors {INDEX_NAME} lists for it: {_AGAIN}")
        state.update(tensors)
    return state


def _read_safetensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{where} has no {path.name}: download or export the model again")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{where}: {path.name} is not a readable safetensors file ({clip(reason)}); it may be truncated: "
            "download or export the model again"
        ) from None


def export_file_hashes(directory: Path) -> dict[str, str]:
    """The sha256 of each of :data:`HASHED_FILES` and each weight shard that ``directory`` holds, for its config's
    :data:`HASHES_KEY`."""
    names = [name for name in HASHED_FILES if (directory / name).is_file()]
    names += sorted(p.name for p in directory.glob(SHARD_PATTERN) if _SHARD_NAME.fullmatch(p.name))
    return {name: sha256_file(directory / name) for name in names}


def verify_export_files(
    directory: Path, config: dict[str, Any], where: str, verified: dict[str, str] | None = None
) -> None:
    """Check the weight and tokenizer files against the sha256 the config records, naming the first that differs.

    An export written before lm-zoo recorded them still loads, with a one-line note on stderr that it cannot be
    verified.

    Args:
        verified: files already checked in this load to have these sha256 (a registered model's, against the
            registry): a file whose recorded sha256 is the one checked is not read and hashed again.

    Raises:
        CheckpointError: a recorded file is missing or its bytes changed.
    """
    recorded = config.get(HASHES_KEY)
    if recorded is None:
        print(
            f"lm-zoo: note: {where} was exported before lm-zoo recorded its files' sha256, so its weights and "
            "tokenizer cannot be verified (lm-zoo export it again to record them)",
            file=sys.stderr,
        )
        return
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise CheckpointError(f'{where}: {CONFIG_NAME}\'s "{HASHES_KEY}" is not a map of file names to sha256')
    unchecked = {name: sha256 for name, sha256 in recorded.items() if (verified or {}).get(name) != sha256}
    check_hashes(directory, unchecked, where, f"its {CONFIG_NAME} records", _AGAIN)


def check_hashes(directory: Path, hashes: dict[str, str], where: str, lister: str, remedy: str) -> None:
    """Check that ``directory`` holds each of ``hashes``' files with its sha256 (the export's own record, or the
    registry's), naming the first (by name) that is missing or differs.

    Args:
        where: the directory as messages name it.
        lister: who lists the files and their sha256 (``its config.json records``).
        remedy: what to do about a mismatch.

    Raises:
        CheckpointError: a file is missing or its bytes changed.
    """
    for name, expected in sorted(hashes.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{where} has no {name}, whose sha256 {lister}: {remedy}")
        if sha256_file(path) != expected:
            raise CheckpointError(
                f"{where}/{name} does not match the sha256 {lister}: the file was changed or damaged; {remedy}"
            )


_AGAIN = "download or export the model again"


def load_export(
    directory: str | Path, source: str | None = None, verified: dict[str, str] | None = None
) -> LoadedModel:
    """Load an export directory: JSON, safetensors and the tokenizer files only, never a pickle.

    A music export (``"head": "bernoulli"``) gives a :class:`zoo.music.PianoRollLM` and no tokenizer.

    Args:
        directory: the directory (an ``lm-zoo export`` output, or a downloaded Hub snapshot).
        source: how to name it in messages and ``LoadedModel.source`` (e.g. the repo id); default the path.
        verified: the sha256 of files this load has checked already (:func:`verify_export_files`), so that each
            file is read and hashed once.

    Raises:
        CheckpointError: it is not an export, a file is missing, corrupt or not the one its config's sha256 names,
            the architecture is unknown, or the weights do not fit the settings or vocabulary (the message names the
            tensors).
    """
    directory = Path(directory)
    where = source or str(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{where} is not a directory: pass a directory written by `lm-zoo export`")
    refuse_pickles(directory, where)
    config = read_config(directory, where)
    verify_export_files(directory, config, where, verified)
    hparams = config["model"]
    architecture = hparams.get("architecture")
    if architecture not in zoo.names():
        raise CheckpointError(
            f"{where}: {CONFIG_NAME} names architecture {architecture!r}, which this lm-zoo does not have "
            f"(it has {', '.join(zoo.names())}): upgrade lm-zoo"
        )
    tokenizer: Tokenizer | None = None  # a music model's frame is its own input
    if kind_of_config(config) is MUSIC:
        model: RecurrentLM | PianoRollLM = build_music_model(hparams, where)
    else:
        tokenizer = _read_tokenizer(directory, config["tokenizer"], where)
        if config["format_version"] == 1:  # the LanguageModel's settings: its training-only ar / tar are dropped
            hparams = {name: value for name, value in hparams.items() if name in NETWORK_OPTIONS}
        model = build_model(hparams, tokenizer, where)
    load_weights(model, read_weights(directory, where), where)
    training = dict(config.get("training") or {})
    data = training.pop("data", {}) or {}
    results = [r for r in config.get("results") or [] if isinstance(r, dict)]
    return LoadedModel(model.eval(), tokenizer, data, where, training=training, results=results)
