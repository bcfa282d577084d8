"""The registry of published models: short names for Hub repos, pinned to a revision, with their measured results.

``checkpoints/registry.json`` (or the file ``$LM_ZOO_REGISTRY`` names)::

    {
      "format_version": 1,
      "models": {
        "ptb-lstm-small": {
          "repo_id": "owner/ptb-lstm-small",
          "revision": "v1",                      # a tag or commit, so the numbers below stay true
          "dataset": "ptb",
          "architecture": "lstm",
          "description": "Zaremba et al. 2014 small, 2 x 200",   # optional
          "results": {"test": {"ppl": 112.38, "eval_batch_size": 1, "bptt": 35}}
        }
      }
    }

A result holds ``ppl`` (word level) and/or ``bpc`` (character level) with the eval batch size and BPTT it was measured
at. ``lm-zoo models --pretrained`` prints the registry; ``lm-zoo download NAME`` and ``checkpoints.load(NAME)``
accept a short name. ``lm-zoo publish --json`` prints the entry for a new model.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zoo.errors import ConfigError

REGISTRY_VERSION = 1
DEFAULT_PATH = Path(__file__).with_name("registry.json")
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # no "/": a short name is never mistaken for a repo id
REPO_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REQUIRED = {"repo_id", "revision", "dataset", "architecture", "results"}
_OPTIONAL = {"description"}
_METRICS = ("ppl", "bpc")


@dataclass(frozen=True)
class RegistryEntry:
    """One published model."""

    name: str
    repo_id: str
    revision: str
    dataset: str
    architecture: str
    results: dict[str, dict[str, float | int]] = field(default_factory=dict)
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        """The entry as JSON (with its name)."""
        return asdict(self)


def registry_path() -> Path:
    """``$LM_ZOO_REGISTRY`` if set, else the registry shipped in this package."""
    return Path(os.environ["LM_ZOO_REGISTRY"]) if os.environ.get("LM_ZOO_REGISTRY") else DEFAULT_PATH


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_results(results: Any, where: str) -> dict[str, dict[str, float | int]]:
    if not isinstance(results, dict):
        raise ConfigError(f"{where}: results must be an object of split -> result")
    for split, result in results.items():
        if split not in ("train", "valid", "test") or not isinstance(result, dict):
            raise ConfigError(f"{where}: results[{split!r}] must be a train/valid/test result object")
        unknown = set(result) - {*_METRICS, "eval_batch_size", "bptt", "tokens"}
        if unknown:
            raise ConfigError(f"{where}: results[{split!r}] has unknown keys {sorted(unknown)}")
        metrics = [result[m] for m in _METRICS if m in result]
        if not metrics or not all(_positive_number(m) for m in metrics):
            raise ConfigError(f"{where}: results[{split!r}] needs a positive ppl or bpc")
        for key in ("eval_batch_size", "bptt"):
            if not _positive_int(result.get(key)):
                raise ConfigError(f"{where}: results[{split!r}] needs {key}, a positive integer (results depend on it)")
    return results


def parse_registry(data: Any, where: str) -> dict[str, RegistryEntry]:
    """Check a registry's contents and return its entries by name.

    Raises:
        ConfigError: naming the entry and the field that is wrong.
    """
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise ConfigError(f'{where}: a registry is an object with "format_version" and "models"')
    if data.get("format_version") != REGISTRY_VERSION:
        raise ConfigError(f"{where}: registry format {data.get('format_version')!r} is not {REGISTRY_VERSION}")
    entries = {}
    for name, entry in data["models"].items():
        at = f"{where}: model {name!r}"
        if not NAME_PATTERN.match(name):
            raise ConfigError(f"{at}: a short name is lower case letters, digits, '.', '_' or '-' (no '/')")
        if not isinstance(entry, dict):
            raise ConfigError(f"{at} must be an object")
        missing, unknown = _REQUIRED - set(entry), set(entry) - _REQUIRED - _OPTIONAL
        if missing or unknown:
            raise ConfigError(f"{at}: missing {sorted(missing)}, unknown {sorted(unknown)}")
        for key in ("repo_id", "revision", "dataset", "architecture"):
            if not isinstance(entry[key], str) or not entry[key]:
                raise ConfigError(f"{at}: {key} must be a non-empty string")
        if not isinstance(entry.get("description", ""), str):
            raise ConfigError(f"{at}: description must be a string")
        if not REPO_ID_PATTERN.match(entry["repo_id"]):
            raise ConfigError(f"{at}: repo_id {entry['repo_id']!r} is not owner/name")
        results = _check_results(entry["results"], at)
        entries[name] = RegistryEntry(name=name, **{**entry, "results": results})
    return entries


def load_registry(path: str | Path | None = None) -> dict[str, RegistryEntry]:
    """Read the registry (default :func:`registry_path`).

    Raises:
        ConfigError: the file is missing, not JSON, or an entry is malformed.
    """
    path = Path(path) if path is not None else registry_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"cannot read the model registry {path} ({err.strerror}): check $LM_ZOO_REGISTRY") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"the model registry {path} is not valid JSON ({err})") from None
    return parse_registry(data, str(path))


def lookup(name: str) -> RegistryEntry | None:
    """The registry entry called ``name``, or ``None``."""
    return load_registry().get(name)


def resolve(name: str, revision: str | None = None) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` for a Hub id (it has a "/") or a registered short name; ``None`` for neither.

    A registered model's pinned revision is used unless ``revision`` is given.
    """
    if "/" in name:
        return name, revision
    entry = lookup(name)
    return None if entry is None else (entry.repo_id, revision or entry.revision)


def entry_for(config: dict[str, Any], name: str, repo_id: str, revision: str) -> RegistryEntry:
    """A registry entry for a published export (from its ``config.json``), to add to ``registry.json``."""
    results: dict[str, dict[str, float | int]] = {}
    for result in config.get("results", []):
        metric = "bpc" if "bpc" in result and result.get("tokenizer") != "sentencepiece" else "ppl"
        results[result["split"]] = {
            metric: round(result[metric], 4),
            "eval_batch_size": result["eval_batch_size"],
            "bptt": result["bptt"],
        }
    corpus = Path(str(config.get("training", {}).get("data", {}).get("corpus", "unknown"))).name
    model = config.get("model", {})
    return RegistryEntry(
        name=name,
        repo_id=repo_id,
        revision=revision,
        dataset=corpus,
        architecture=str(config.get("architecture")),
        results=results,
        description=f"{model.get('num_layers')} x {model.get('hidden_size')} {config.get('architecture')} on {corpus}",
    )
