"""Lightning ``.ckpt`` files written by ``lm-zoo fit``: the model, its tokenizer and its data settings read back.

A ``.ckpt`` on disk is read with ``torch.load(weights_only=True)``: tensors and plain data only, never arbitrary
pickled objects. Files that come from the Hub or an export directory are never read this way (see
:mod:`checkpoints.export_read`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor

from checkpoints.export_read import LoadedModel, build_model, build_music_model, load_weights, public_settings
from datamodules.kinds import MUSIC, TEXT
from datamodules.tokenizers import Tokenizer
from lightning_modules.language_model import MODEL_PREFIX, TRAINING_OPTIONS
from lightning_modules.music import TRAINING_OPTIONS as MUSIC_TRAINING_OPTIONS
from zoo.errors import CheckpointError, clip


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
    # Where the run trained (lightning_modules.training.RunSettings), when its lm-zoo recorded it.
    environments = (ckpt.get("callbacks") or {}).get("RunSettings", {}).get("environments")
    if environments:
        record["environments"] = environments
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
    # A MusicDataModule's state holds its "music" settings; a text data module's its tokenizer.
    kind = MUSIC if any(isinstance(v, dict) and isinstance(v.get("music"), dict) for v in ckpt.values()) else TEXT
    tokenizer = _find_tokenizer(ckpt, path) if kind.has_tokenizer else None
    settings = public_settings(ckpt["hyper_parameters"])
    if kind is MUSIC:
        network = {name: value for name, value in settings.items() if name not in MUSIC_TRAINING_OPTIONS}
        network["num_notes"] = network.pop("vocab_size")  # the LightningModule's name (the data's, linked)
        model = build_music_model(network, str(path))
    else:
        network = {name: value for name, value in settings.items() if name not in TRAINING_OPTIONS}
        model = build_model(network, tokenizer, str(path))
    load_weights(model, network_weights(ckpt["state_dict"]), str(path))
    data = public_settings(ckpt.get("datamodule_hyper_parameters", {}))
    data["class_path"] = _data_class_path(ckpt)  # which data module rebuilds the splits (exports keep it too)
    return LoadedModel(model.eval(), tokenizer, data, str(path), training=_training_record(ckpt, path))
