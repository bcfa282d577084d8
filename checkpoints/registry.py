"""The registry of pretrained models: short names for exports bundled under ``pretrained/`` and published on the Hub.

``checkpoints/registry.json`` (or the file ``$LM_ZOO_REGISTRY`` names)::

    {
      "format_version": 2,
      "models": {
        "ptb-lstm-small": {
          "repo_id": "lm-zoo/ptb-lstm-small",        # where `python -m release publish` puts it on the Hub
          "revision": "v1",                          # a tag, so the numbers below stay true
          "dataset": "ptb",
          "architecture": "lstm",
          "description": "Zaremba et al. 2014 small, 2 x 200",   # optional
          "num_parameters": 4653200,                 # optional: the network's, tied weights once
          "size_bytes": 18623456,                    # optional: the export's files together
          "files": {"config.json": "<sha256>", ...},  # optional: every file of the export and its sha256
          "results": {"test": {"ppl": 112.38, "eval_batch_size": 1, "bptt": 35, "tokens": 82430}},
          "check_results": {"test": {"ppl": 112.42, "eval_batch_size": 10, "bptt": 35, "tokens": 82430}},  # optional
          "int8_results": {"test": {"ppl": 112.51, "eval_batch_size": 1, "bptt": 35, "tokens": 82430}},  # optional
          "training": {"command": "lm-zoo fit --config configs/ptb/lstm-small.yaml", ...}   # optional
        }
      }
    }

A result holds ``ppl`` (word level) and/or ``bpc`` (character level) with the eval batch size and BPTT it was measured
at; a music model's holds ``nll_per_step`` (nats per frame, summed over the 88 notes) and ``frames`` instead of
``tokens``, e.g. ``{"nll_per_step": 8.54, "eval_batch_size": 20, "bptt": 35, "frames": 4725}``.

``results`` are the figures a user quotes (at eval batch size 1, the papers' convention, where the model was measured
there). ``check_results`` hold the same model's test figure over a fixed part of the split: the windows up to the one
holding its :data:`CHECK_TOKENS`-th token (``max_tokens``; ``lm-zoo evaluate --max-tokens``), at the training
recipe's own eval batch size (10 or 16; GBW's 64; a music model's data module's), as the same result objects with
``max_tokens`` added. It runs the same weights, files and code path as the registered figure in a few seconds, so the
test suite re-measures ``check_results`` on every run and ``make verify-pretrained`` the whole-split ``results``.
``python -m release check`` measures them again and records them.
``int8_results`` are the test figure of the model run with ``--quantize int8`` (:mod:`zoo.quantization`), where that
applies and was measured (``benchmarks/quantize.py``).

``lm-zoo models --pretrained`` prints the registry; ``lm-zoo download NAME``, ``checkpoints.load(NAME)`` and
``checkpoints.from_pretrained(NAME)`` accept a short name. A model
with ``files`` is served from its bundled export ``pretrained/<name>/`` (``$LM_ZOO_PRETRAINED`` overrides the folder)
when that exists and every hash matches, and from the Hub otherwise, where the downloaded files must match the same
hashes. Format-1 registries (no ``files``) still load. ``python -m release`` writes the bundle and its entry
(:mod:`release.bundle`).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from checkpoints.export_read import check_hashes, is_export_file
from datamodules.corpora import SPLITS
from datamodules.kinds import METRICS, TEXT, ModelKind, kind_of_config, kind_of_result, kinds_of_result, result_figures
from zoo.errors import CheckpointError, ConfigError

REGISTRY_VERSION = 2
READABLE_VERSIONS = (1, 2)
DEFAULT_PATH = Path(__file__).with_name("registry.json")
# The bundled exports, beside the packages in a source checkout (a pip-installed lm-zoo has none: it uses the Hub).
DEFAULT_BUNDLE_ROOT = Path(__file__).resolve().parent.parent / "pretrained"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # no "/": a short name is never mistaken for a repo id
REPO_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REQUIRED = {"repo_id", "revision", "dataset", "architecture", "results"}
_OPTIONAL = {"check_results", "int8_results", "description", "num_parameters", "size_bytes", "files", "training"}
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
_RESULT_KEYS = {*METRICS, "nll_per_note", "eval_batch_size", "bptt", "tokens", "frames", "max_tokens"}
# A check figure scores the test split up to the window holding this token (a music model's: frame), at the recipe's
# eval batch size: 2-8% of the bundled models' test splits (GBW's, PTB's, WikiText-2's 245k tokens), so each takes
# seconds where its whole split took up to minutes on a 2-core CPU.
CHECK_TOKENS = 5000


@dataclass(frozen=True)
class RegistryEntry:
    """One published model."""

    name: str
    repo_id: str
    revision: str
    dataset: str
    architecture: str
    results: dict[str, dict[str, float | int]] = field(default_factory=dict)
    #: The test figure at the recipe's eval batch size, which the test suite re-measures (module doc).
    check_results: dict[str, dict[str, float | int]] = field(default_factory=dict)
    #: The test figure under ``--quantize int8``, where measured (module doc).
    int8_results: dict[str, dict[str, float | int]] = field(default_factory=dict)
    description: str = ""
    num_parameters: int | None = None
    size_bytes: int | None = None
    files: dict[str, str] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> ModelKind:
        """Text or music, told by its results' figures (a music model's are NLL per frame)."""
        return next((kind_of_result(result) for result in self.results.values()), TEXT)

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
        if split not in SPLITS or not isinstance(result, dict):
            raise ConfigError(f"{where}: results[{split!r}] must be a train/valid/test result object")
        unknown = set(result) - _RESULT_KEYS
        if unknown:
            raise ConfigError(f"{where}: results[{split!r}] has unknown keys {sorted(unknown)}")
        if len(kinds_of_result(result)) > 1:
            raise ConfigError(
                f"{where}: results[{split!r}] mixes a text model's ppl/bpc with a music model's nll_per_step: keep "
                "the figures of the model's kind"
            )
        metrics = [result[m] for m in METRICS if m in result]
        if not metrics or not all(_positive_number(m) for m in metrics):
            raise ConfigError(f"{where}: results[{split!r}] needs a positive ppl or bpc (a music model: nll_per_step)")
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
    if data.get("format_version") not in READABLE_VERSIONS:
        raise ConfigError(
            f"{where}: registry format {data.get('format_version')!r} is not one this lm-zoo reads "
            f"({', '.join(map(str, READABLE_VERSIONS))}): upgrade lm-zoo"
        )
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
        for key in ("num_parameters", "size_bytes"):
            if entry.get(key) is not None and not _positive_int(entry[key]):
                raise ConfigError(f"{at}: {key} must be a positive integer")
        files = entry.get("files") or {}
        if not isinstance(files, dict) or not all(
            isinstance(f, str) and isinstance(h, str) and SHA256_PATTERN.match(h) for f, h in files.items()
        ):
            raise ConfigError(f"{at}: files must map each file name to its sha256 (64 lower-case hex digits)")
        if not isinstance(entry.get("training") or {}, dict):
            raise ConfigError(f"{at}: training must be an object")
        results = _check_results(entry["results"], at)
        check_results = _check_results(entry.get("check_results") or {}, f"{at}: check_results")
        int8_results = _check_results(entry.get("int8_results") or {}, f"{at}: int8_results")
        entries[name] = RegistryEntry(
            name=name,
            **{
                **entry,
                "results": results,
                "check_results": check_results,
                "int8_results": int8_results,
                "files": files,
                "training": entry.get("training") or {},
            },
        )
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


def verify_files(entry: RegistryEntry, directory: Path, where: str) -> None:
    """Check that ``directory`` holds exactly the files the entry lists, each with its registered sha256.

    Raises:
        CheckpointError: naming the first file that is missing, extra (an export file the registry does not list) or
            different, and what to do.
    """
    check_hashes(directory, entry.files, where, f"the registry lists for {entry.name}", _RESTORE)
    extra = sorted(p.name for p in directory.iterdir() if is_export_file(p.name) and p.name not in entry.files)
    if extra:
        raise CheckpointError(
            f"{where} holds {extra[0]}, which the registry does not list for {entry.name}: {_RESTORE}"
        )


_RESTORE = "restore it (git checkout -- pretrained/, or lm-zoo download again) or update checkpoints/registry.json"


def bundle_root() -> Path:
    """``$LM_ZOO_PRETRAINED`` if set, else the ``pretrained/`` folder of this source checkout."""
    return Path(os.environ["LM_ZOO_PRETRAINED"]) if os.environ.get("LM_ZOO_PRETRAINED") else DEFAULT_BUNDLE_ROOT


def bundled(entry: RegistryEntry) -> Path | None:
    """The entry's bundled export directory, checked against its hashes; ``None`` when there is none here.

    Raises:
        CheckpointError: the bundle is there but a file is missing or differs from the registry.
    """
    directory = bundle_root() / entry.name
    if not entry.files or not directory.is_dir():
        return None
    verify_files(entry, directory, str(directory))
    return directory


def entry_for(
    config: dict[str, Any], name: str, repo_id: str, revision: str, check: dict[str, Any] | None = None
) -> RegistryEntry:
    """A registry entry for a published export (from its ``config.json``), to add to ``registry.json``.

    Per split it keeps the result at eval batch size 1 when there is one (the papers' convention), else the first;
    and as ``check_results`` ``check`` (``python -m release build`` measures it over the first :data:`CHECK_TOKENS`),
    else the test result at the largest eval batch size measured. A music model's keeps its NLL per frame and the
    frames it was measured on.
    """
    results: dict[str, dict[str, float | int]] = {}
    for result in sorted(config.get("results", []), key=lambda r: r["eval_batch_size"] != 1, reverse=True):
        results[result["split"]] = registry_result(result)  # a later (batch-1) result replaces an earlier one
    tests = [r for r in config.get("results", []) if r["split"] == "test"]
    if check is None:
        check = max(tests, key=lambda r: r["eval_batch_size"], default=None)  # the first of the largest batch size
    data = config.get("training", {}).get("data", {})
    corpus = Path(str(data.get(kind_of_config(config).data_key) or "unknown")).name
    model = config.get("model", {})
    return RegistryEntry(
        name=name,
        repo_id=repo_id,
        revision=revision,
        dataset=corpus,
        architecture=str(config.get("architecture")),
        results=results,
        check_results={"test": registry_result(check)} if check is not None else {},
        description=f"{model.get('num_layers')} x {model.get('hidden_size')} {config.get('architecture')} on {corpus}",
    )


def registry_result(result: dict[str, Any]) -> dict[str, float | int]:
    """A ``config.json`` result as the registry keeps it: its metric (a music model's NLL per frame, a character
    model's bpc, else ppl), eval batch size, BPTT, token (frame) count and, for a part of the split, ``max_tokens``."""
    metric, count = result_figures(result)[0], kind_of_result(result).count
    return {
        metric: result[metric],
        "eval_batch_size": result["eval_batch_size"],
        "bptt": result["bptt"],
        **({count: result[count]} if count in result else {}),
        **({"max_tokens": result["max_tokens"]} if result.get("max_tokens") is not None else {}),
    }


def write_entry(entry: RegistryEntry, path: str | Path | None = None) -> None:
    """Add or replace ``entry`` in the registry file (default :func:`registry_path`), keeping names sorted."""
    path = Path(path) if path is not None else registry_path()
    load_registry(path)  # refuses to rewrite a malformed registry
    data = json.loads(path.read_text(encoding="utf-8"))
    fields = {k: v for k, v in entry.to_json().items() if k != "name" and (k in _REQUIRED or v not in (None, {}, ""))}
    models = {**data["models"], entry.name: fields}
    data = {"format_version": REGISTRY_VERSION, "models": dict(sorted(models.items()))}
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def update_check_results(name: str, check_results: dict[str, dict[str, Any]], path: str | Path | None = None) -> None:
    """Record a model's re-measured check figures (:func:`release.bundle.measure_check`) in its entry's
    ``check_results``, nothing else.

    Raises:
        ConfigError: the registry is malformed, has no entry ``name``, or a result is malformed.
    """
    path = Path(path) if path is not None else registry_path()
    if name not in load_registry(path):
        raise ConfigError(f"{name!r} is not in the registry {path}")
    _check_results(check_results, f"{name}: check_results")
    data = json.loads(path.read_text(encoding="utf-8"))
    data["models"][name]["check_results"] = check_results
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def update_files(name: str, files: dict[str, str], size_bytes: int, path: str | Path | None = None) -> None:
    """Record a bundle's changed files in the registry: its entry's ``files`` (sha256 per file) and ``size_bytes``,
    nothing else, read and written back at once (a re-rendered card: :func:`release.bundle.render_again`).

    Raises:
        ConfigError: the registry is malformed or has no entry ``name``.
    """
    path = Path(path) if path is not None else registry_path()
    if name not in load_registry(path):
        raise ConfigError(f"{name!r} is not in the registry {path}")
    data = json.loads(path.read_text(encoding="utf-8"))
    data["models"][name]["files"] = dict(files)
    data["models"][name]["size_bytes"] = size_bytes
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
