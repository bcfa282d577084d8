"""Lightning ``.ckpt`` files written by ``lm-zoo fit``, and what every loader shares: :class:`LoadedModel`, building the
model from its settings and strict weight loading.

A ``.ckpt`` on disk is read with ``torch.load(weights_only=True)``: tensors and plain data only, never arbitrary
pickled objects. Files that come from the Hub or an export directory are never read this way (see
:mod:`checkpoints.export`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from datamodules.tokenizers import Tokenizer
from lightning_modules.language_model import MODEL_PREFIX, TRAINING_OPTIONS
from zoo.errors import CheckpointError, ConfigError, clip
from zoo.language_model import RecurrentLM
from zoo.music import PianoRollLM

if TYPE_CHECKING:
    from lightning import LightningDataModule


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
    def is_music(self) -> bool:
        """Whether this is a model of piano-roll frames (``lm-zoo evaluate`` and ``generate`` treat it as music)."""
        return isinstance(self.model, PianoRollLM)

    def datamodule(self, corpus: str | None = None, data_root: str | None = None) -> LightningDataModule:
        """The data module the model was trained with (its class and settings, or on ``corpus``: for a music model
        another dataset), using the model's own tokenizer.

        Raises:
            ConfigError: the model does not say which corpus it was trained on and none was given.
            CheckpointError: the recorded data module class is not one of lm-zoo's.
        """
        settings = dict(self.data)
        data_class = data_module_class(settings.pop("class_path", None), self.source)
        key = "dataset" if self.is_music else "corpus"
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
        datamodule = data_class(**settings)
        if self.tokenizer is not None:
            datamodule.load_state_dict({"tokenizer": self.tokenizer.state_dict()})
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
        sentences = tokenizer.bos_id != tokenizer.eos_id
        temperature = temperature if temperature is not None else (0.7 if sentences else 1.0)
        prompt_ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
        prompt_batch = torch.tensor([prompt_ids] * num_samples, device=device)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        samples = model.generate(
            prompt_batch, max_tokens, temperature, top_k, stop_id=tokenizer.eos_id, generator=generator
        )
        return [tokenizer.decode(prompt_ids[1:] + ids).rstrip("\n") for ids in samples], temperature


def data_module_class(class_path: str | None, where: str) -> type[LightningDataModule]:
    """The data module class a model records in its data settings (``class_path``); ``None`` (models saved before
    it was recorded) means ``TextDataModule``.

    Only lm-zoo's own data modules are looked up, by name: a downloaded ``config.json`` never makes lm-zoo import
    anything else.

    Raises:
        CheckpointError: the class is not one of lm-zoo's data modules.
    """
    from lightning import LightningDataModule

    import datamodules

    name = (class_path or "TextDataModule").rsplit(".", 1)[-1]
    found = getattr(datamodules, name, None) if name in datamodules.__all__ else None
    if not (isinstance(found, type) and issubclass(found, LightningDataModule)):
        raise CheckpointError(
            f"{where} was trained with the data module {class_path!r}, which this lm-zoo does not have; upgrade lm-zoo"
        )
    return found


def _data_class_path(ckpt: dict[str, Any]) -> str:
    """The data module's class: LightningCLI records it; a plain ``Trainer`` run leaves only its state's key."""
    recorded = ckpt.get("datamodule_hyper_parameters", {}).get("_class_path")
    if isinstance(recorded, str):
        return recorded
    for key, value in ckpt.items():
        if isinstance(value, dict) and (
            isinstance(value.get("tokenizer"), dict) or isinstance(value.get("music"), dict)
        ):
            return f"datamodules.{key}"
    return "datamodules.TextDataModule"


def public_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Constructor settings without LightningCLI's private entries (``_class_path``, ``_instantiator``)."""
    return {k: v for k, v in settings.items() if not k.startswith("_")}


def build_model(settings: dict[str, Any], tokenizer: Tokenizer, where: str) -> RecurrentLM:
    """Construct the network its settings describe, after checking them against the tokenizer.

    Args:
        settings: :class:`zoo.RecurrentLM` constructor arguments; a ``.ckpt``'s (and a format-1 export's) are the
            ``LanguageModel``'s, whose training-only options are left out here.
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
    network = {name: value for name, value in settings.items() if name not in TRAINING_OPTIONS}
    try:
        return RecurrentLM(**network)
    except TypeError as err:
        raise CheckpointError(f"{where} has settings this lm-zoo does not know ({err}); upgrade lm-zoo") from None


def build_music_model(settings: dict[str, Any], where: str) -> PianoRollLM:
    """Construct the piano-roll network a ``MusicModel``'s settings (or an export's) describe.

    Raises:
        CheckpointError: the settings are unknown to this lm-zoo.
    """
    from lightning_modules.music import TRAINING_OPTIONS as MUSIC_TRAINING_OPTIONS

    network = {name: value for name, value in settings.items() if name not in MUSIC_TRAINING_OPTIONS}
    if "vocab_size" in network:  # the LightningModule's name for it (LightningCLI links the data's vocab_size)
        network["num_notes"] = network.pop("vocab_size")
    try:
        return PianoRollLM(**network)
    except TypeError as err:
        raise CheckpointError(f"{where} has settings this lm-zoo does not know ({err}); upgrade lm-zoo") from None


def _tied_names(state: dict[str, Tensor]) -> dict[str, set[str]]:
    """Each tensor name -> the other names that share its storage (tied weights), for names that have any."""
    groups: dict[tuple[int, tuple[int, ...]], set[str]] = {}
    for name, tensor in state.items():
        groups.setdefault((tensor.data_ptr(), tuple(tensor.shape)), set()).add(name)
    return {name: group - {name} for group in groups.values() if len(group) > 1 for name in group}


def load_weights(model: RecurrentLM | PianoRollLM, state: dict[str, Tensor], where: str) -> None:
    """Load ``state`` into ``model`` strictly: every tensor must be there and nothing else.

    A tied tensor (the softmax sharing the embedding) may be stored under any one of its names, as safetensors stores
    it once; loading it once fills all of them.

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
            f"{unexpected[:5]}; use weights written by this lm-zoo version for this configuration"
        )
    try:
        model.load_state_dict(state, strict=False)  # strictness checked above, tied names included
    except RuntimeError as err:
        mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), clip(str(err)))
        raise CheckpointError(f"{where}: {mismatch.rstrip('.')}; the weights do not fit the stored settings") from None


def network_weights(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The network's tensors of a ``LanguageModel`` state dict, without the ``model.`` prefix (which checkpoints
    written before the network was a module of its own lack)."""
    if not any(name.startswith(MODEL_PREFIX) for name in state):
        return state
    return {name[len(MODEL_PREFIX) :]: tensor for name, tensor in state.items() if name.startswith(MODEL_PREFIX)}


def unreadable(path: Path | str, err: BaseException) -> CheckpointError:
    """The one line for a file ``torch.load`` could not read: its first line of reason, never PyTorch's advice to
    retry with ``weights_only=False`` (lm-zoo never unpickles arbitrary objects)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    reason = next((line for line in lines if "weights_only" not in line and not line.startswith("(")), "")
    reason = reason or type(err).__name__
    reason = clip(reason, 160)
    return CheckpointError(
        f"{path} is not a readable checkpoint ({reason.rstrip('.')}); it may be truncated or not a .ckpt: "
        "use another checkpoint (e.g. last.ckpt) or train again"
    )


def _read_ckpt(path: Path) -> dict[str, Any]:
    try:
        # weights_only: a checkpoint holds tensors and plain data; nothing in it needs unpickling arbitrary objects.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt bytes make torch.load raise nearly anything (pickle errors, IndexError, ...)
        raise unreadable(path, err) from None


def _find_tokenizer(ckpt: dict[str, Any], path: Path) -> Tokenizer:
    # The data module's state_dict is stored under its class name; its hyperparameters also have a "tokenizer" (the
    # kind, a string or None), so look for the saved tokenizer state itself.
    for value in ckpt.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), dict):
            return Tokenizer.from_state_dict(value["tokenizer"])
    raise CheckpointError(f"{path} has no tokenizer (it was not written by `lm-zoo fit`): retrain with lm-zoo")


def _plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value)
    )


def _training_record(ckpt: dict[str, Any], path: Path) -> dict[str, Any]:
    """What a checkpoint says about how it was trained, beyond the model and data settings."""
    # Optimizer settings live in the saved param groups (the optimizer's class is not in a .ckpt); implementation
    # switches (foreach, fused, ...) are dropped, they are no part of the recipe.
    switches = {"params", "foreach", "fused", "differentiable", "capturable", "maximize"}
    optimizers = [
        {"param_groups": [{k: v for k, v in g.items() if k not in switches and _plain(v)} for g in opt["param_groups"]]}
        for opt in ckpt.get("optimizer_states", [])
        if isinstance(opt, dict) and "param_groups" in opt
    ]
    record: dict[str, Any] = {
        "checkpoint": path.name,
        "epoch": ckpt.get("epoch"),
        "global_step": ckpt.get("global_step"),
        "optimizers": optimizers,
        # Lightning's WeightAveraging stores the averaged weights as "state_dict" and the live ones beside them.
        "weight_averaged": "current_model_state" in ckpt,
    }
    config = _run_config(path, ckpt)
    if config is not None:
        record["config"] = config
        # The run's config names the classes a .ckpt leaves out.
        optimizer, scheduler = config.get("optimizer"), config.get("lr_scheduler")
        if len(optimizers) == 1 and isinstance(optimizer, dict) and "class_path" in optimizer:
            optimizers[0]["class"] = optimizer["class_path"]
        if isinstance(scheduler, dict) and "class_path" in scheduler:
            record["lr_schedulers"] = [scheduler["class_path"]]
    return record


def _run_config(path: Path, ckpt: dict[str, Any]) -> dict[str, Any] | None:
    """The LightningCLI ``config.yaml`` of the run, when the checkpoint sits in its default place beside it.

    (``<root>/lightning_logs/version_N/checkpoints/best.ckpt`` next to ``version_N/config.yaml``.) It is used only if
    its corpus is the checkpoint's, so a config of another run is never attached.
    """
    import yaml

    candidate = path.parent.parent / "config.yaml"
    if not candidate.is_file():
        return None
    try:
        config = yaml.safe_load(candidate.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    try:
        data = config["data"]["init_args"]
        key = "corpus" if "corpus" in data else "dataset"  # a text corpus, or a music dataset
        corpus = data[key]
    except (KeyError, TypeError):
        return None
    return config if corpus == ckpt.get("datamodule_hyper_parameters", {}).get(key) else None


def load_checkpoint(path: str | Path) -> LoadedModel:
    """Load a Lightning checkpoint written by ``lm-zoo fit``.

    A checkpoint of a weight-averaged run (Lightning's ``WeightAveraging`` / ``EMAWeightAveraging``) gives the
    averaged weights: Lightning stores them as the checkpoint's ``state_dict``.

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
    music = any(isinstance(value, dict) and isinstance(value.get("music"), dict) for value in ckpt.values())
    tokenizer = None if music else _find_tokenizer(ckpt, path)
    settings = public_settings(ckpt["hyper_parameters"])
    model = build_music_model(settings, str(path)) if music else build_model(settings, tokenizer, str(path))
    load_weights(model, network_weights(ckpt["state_dict"]), str(path))
    data = public_settings(ckpt.get("datamodule_hyper_parameters", {}))
    data["class_path"] = _data_class_path(ckpt)  # which data module rebuilds the splits (exports keep it too)
    return LoadedModel(model.eval(), tokenizer, data, str(path), training=_training_record(ckpt, path))
