"""Every call lm-zoo makes to the Hugging Face Hub: publish an export, download one, look a repo up.

Settings are resolved when a call is made, not when huggingface_hub is imported (which reads its environment once):
``HF_ENDPOINT`` (or an explicit ``endpoint``), ``HF_TOKEN`` (or the token ``hf auth login`` saved), ``HF_HOME`` /
``HF_HUB_CACHE`` (where downloads are cached) and ``HF_HUB_OFFLINE`` (use the cache only). Every huggingface_hub
error becomes one :class:`~zoo.errors.CheckpointError` line that says what to do.

Only the export's own files are ever downloaded (``config.json``, ``model.safetensors``, the tokenizer file, the
card, and the learning curve and a music model's ``sample.mid`` / ``sample.png`` when there), so a pickle in a repo
never reaches the disk, let alone ``torch.load``.

huggingface_hub is imported inside the functions that reach the Hub: its HTTP stack costs every command's start-up
about 0.14 s (``python -X importtime``), and a bundled or local model never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoints.export_read import (
    CARD_NAME,
    CONFIG_NAME,
    EXPORT_PATTERNS,
    INDEX_NAME,
    PICKLE_SUFFIXES,
    WEIGHTS_NAME,
    lm_zoo_version,
    load_export,
    pickle_refusal,
    read_config,
)
from checkpoints.model_card import GENERATED_MARK, render_card
from zoo.errors import CheckpointError, clip

if TYPE_CHECKING:
    from huggingface_hub import HfApi


@dataclass(frozen=True)
class HubSettings:
    """Where and how to reach the Hub, resolved from arguments and the environment at call time."""

    endpoint: str
    token: str | None  # None: huggingface_hub finds HF_TOKEN or the saved login itself
    cache_dir: str
    offline: bool


def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_settings(endpoint: str | None = None, token: str | None = None) -> HubSettings:
    """The Hub settings for a call: explicit arguments first, then the environment as it is now."""
    from huggingface_hub import constants

    env = os.environ
    if env.get("HF_HUB_CACHE"):
        cache_dir = env["HF_HUB_CACHE"]
    elif env.get("HF_HOME"):
        cache_dir = os.path.join(env["HF_HOME"], "hub")
    else:
        cache_dir = constants.HF_HUB_CACHE
    return HubSettings(
        endpoint=(endpoint or env.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/"),
        token=token,
        cache_dir=os.path.expanduser(os.path.expandvars(cache_dir)),
        offline=_true(env["HF_HUB_OFFLINE"]) if "HF_HUB_OFFLINE" in env else constants.HF_HUB_OFFLINE,
    )


def _api(settings: HubSettings) -> HfApi:
    from huggingface_hub import HfApi

    return HfApi(
        endpoint=settings.endpoint, token=settings.token, library_name="lm-zoo", library_version=lm_zoo_version()
    )


def _label(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id


# -------------------------------------------------------------------------------------------------------- errors
def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return clip(text) if text else type(err).__name__


def _translate(
    err: Exception, repo_id: str, revision: str | None, settings: HubSettings, writing: bool
) -> CheckpointError | None:
    """The one-line error for a huggingface_hub or network error; ``None`` for anything else."""
    from huggingface_hub import errors

    label, endpoint = _label(repo_id, revision), settings.endpoint
    if isinstance(err, errors.HFValidationError):
        local = "" if writing else ", nor a local file or directory"
        return CheckpointError(f"{repo_id!r} is not a valid Hub repo id ({_reason(err)}){local}: use owner/name")
    if isinstance(err, errors.GatedRepoError):
        return CheckpointError(
            f"{label} is gated on {endpoint}: accept its conditions at {endpoint}/{repo_id} while logged in, then "
            "set HF_TOKEN to a token of that account"
        )
    if isinstance(err, errors.RevisionNotFoundError):
        return CheckpointError(
            f"{repo_id} has no revision {revision!r} on {endpoint}: pass a branch, tag or commit it has "
            "(or no --revision for main)"
        )
    if isinstance(err, errors.RepositoryNotFoundError):
        return CheckpointError(
            f"there is no model repo {repo_id} on {endpoint} (or it is private and HF_TOKEN does not grant access), "
            "and no local file or directory of that name: check the id, or set HF_TOKEN for a private repo"
        )
    if isinstance(err, errors.DisabledRepoError):
        return CheckpointError(f"{repo_id} has been disabled on {endpoint}: it cannot be used")
    if isinstance(err, errors.OfflineModeIsEnabled):
        return CheckpointError(f"HF_HUB_OFFLINE is set, so {label} cannot be fetched from {endpoint}: unset it")
    # huggingface_hub turns every HTTP response it refuses into an HfHubHTTPError; an HTTP error that is not one got no
    # response at all (no connection, a timeout): the network's fault, not the repo's.
    unreachable = isinstance(err, errors.HTTPError) and not isinstance(err, errors.HfHubHTTPError)
    if unreachable or isinstance(err, (errors.LocalEntryNotFoundError, errors.FileMetadataError)):
        if writing:
            return CheckpointError(
                f"cannot reach the Hub at {endpoint} ({_reason(err)}): check the network or HF_ENDPOINT"
            )
        hint = (
            f"{label} is in the local cache: set HF_HUB_OFFLINE=1 to use it"
            if _cached_snapshot(repo_id, revision, settings) is not None
            else f"{label} is not in the cache ({settings.cache_dir}) either: check the network or HF_ENDPOINT"
        )
        return CheckpointError(f"cannot reach the Hub at {endpoint} ({_reason(err)}); {hint}")
    if isinstance(err, errors.HfHubHTTPError):
        status = err.response.status_code if err.response is not None else "?"
        if status in (401, 403):
            need = "write access to the namespace" if writing else "read access"
            return CheckpointError(
                f"the Hub at {endpoint} refused access to {label} (HTTP {status}): set HF_TOKEN to a token with {need}"
            )
        message = err.server_message or _reason(err)
        return CheckpointError(f"the Hub at {endpoint} answered HTTP {status} for {label}: {_reason(message)}")
    return None


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, settings: HubSettings, writing: bool = False) -> Iterator[None]:
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:
        ours = _translate(err, repo_id, revision, settings, writing)
        if ours is None:
            raise
        raise ours from None


# ------------------------------------------------------------------------------------------------------ download
def _cached_snapshot(repo_id: str, revision: str | None, settings: HubSettings) -> Path | None:
    """The cached export of ``repo_id`` at ``revision``, if a complete one is in the cache."""
    from huggingface_hub import errors, snapshot_download

    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=settings.cache_dir,
            local_files_only=True,
            allow_patterns=list(EXPORT_PATTERNS),
        )
    except (errors.LocalEntryNotFoundError, errors.HFValidationError, OSError):
        return None
    return Path(path) if (Path(path) / CONFIG_NAME).is_file() else None


def _check_is_lm_zoo(info: Any, label: str) -> None:
    """Refuse, before downloading anything, a repo that is not an lm-zoo export."""
    names = {sibling.rfilename for sibling in info.siblings or []}
    weights = WEIGHTS_NAME in names or INDEX_NAME in names
    if CONFIG_NAME in names and weights and info.library_name in (None, "lm-zoo"):
        return
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if not weights and pickles:
        raise pickle_refusal(label, pickles)
    library = f" (its library is {info.library_name})" if info.library_name not in (None, "lm-zoo") else ""
    raise CheckpointError(
        f"{label} is not an lm-zoo model{library}: it needs {CONFIG_NAME} and {WEIGHTS_NAME} written by "
        "`lm-zoo export`; lm-zoo loads only repos published with `lm-zoo publish`"
    )


def download(
    repo_id: str, revision: str | None = None, *, endpoint: str | None = None, token: str | None = None
) -> Path:
    """Download an exported model into the Hugging Face cache (or find it there) and return its directory.

    Args:
        repo_id: ``owner/name``.
        revision: a branch, tag or commit (default ``main``).
        endpoint: the Hub's URL (default ``$HF_ENDPOINT`` or huggingface.co).
        token: an access token (default ``$HF_TOKEN`` or the saved login).

    Raises:
        CheckpointError: the repo or revision does not exist, is gated or private, is no lm-zoo model, or the Hub
            cannot be reached (the message says whether the cache has it and ``HF_HUB_OFFLINE=1`` would do).
    """
    from huggingface_hub import snapshot_download

    settings = hub_settings(endpoint, token)
    label = _label(repo_id, revision)
    if settings.offline:
        path = _cached_snapshot(repo_id, revision, settings)
        if path is None:
            raise CheckpointError(
                f"{label} is not in the Hugging Face cache ({settings.cache_dir}) and HF_HUB_OFFLINE is set: "
                f"download it once with the network on (lm-zoo download {repo_id}), or unset HF_HUB_OFFLINE"
            )
        return path
    with _hub_errors(repo_id, revision, settings):
        _check_is_lm_zoo(_api(settings).model_info(repo_id, revision=revision), label)
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=settings.cache_dir,
            endpoint=settings.endpoint,
            token=settings.token,
            allow_patterns=list(EXPORT_PATTERNS),  # the export's files only: nothing else is ever fetched
            library_name="lm-zoo",
            library_version=lm_zoo_version(),
        )
    return Path(path)


# ------------------------------------------------------------------------------------------------------- publish
@dataclass(frozen=True)
class Published:
    """Where a publish went."""

    repo_id: str
    url: str  # the repo's page
    commit: str  # the new commit's id: pin it as a revision for reproducible downloads
    commit_url: str
    revision: str  # the branch committed to
    tag: str | None


def _ready_to_publish(directory: Path, repo_id: str, tag: str | None) -> str:
    """Check the export (it is loaded, so a broken one is never published), render its model card for ``repo_id``
    unless it was edited, and return the default commit message, which names the architecture and the corpus."""
    load_export(directory)  # refuses anything incomplete, corrupt or pickled before it leaves the machine
    config = read_config(directory, str(directory))
    card = directory / CARD_NAME
    if not card.is_file() or GENERATED_MARK in card.read_text(encoding="utf-8"):
        card.write_text(render_card(config, repo_id, tag), encoding="utf-8")
    data = config.get("training", {}).get("data", {})
    corpus = data.get("corpus") or data.get("dataset")  # a text corpus, or a music model's dataset
    return f"lm-zoo export: {config.get('architecture')} on {Path(str(corpus)).name}"


def publish(
    directory: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    tag: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> Published:
    """Upload an export directory to a model repo, creating the repo (and the branch) if needed.

    The export is loaded first, so a broken one is never published; its model card is re-rendered to name the repo
    unless it was edited (see :data:`checkpoints.model_card.GENERATED_MARK`): a bundled model's card, published with
    its registered ``tag``, names its short name and gives the repo and tag as its Hub location. Export files the
    directory no longer has (a ``vocab.txt`` replaced by a ``tokenizer.model``) are deleted from the repo in the same
    commit.

    Args:
        directory: written by ``lm-zoo export``.
        repo_id: ``owner/name``.
        private: create the repo private (an existing repo keeps its visibility).
        revision: the branch to commit to, created from ``main`` if missing (default ``main``).
        tag: also tag the new commit (e.g. ``v1``), for ``lm-zoo download --revision v1``.
        commit_message: default names the architecture and corpus.
        endpoint: the Hub's URL (default ``$HF_ENDPOINT`` or huggingface.co).
        token: a token with write access (default ``$HF_TOKEN`` or the saved login).

    Raises:
        CheckpointError: the directory is not a loadable export, or the Hub refused or could not be reached.
    """
    settings = hub_settings(endpoint, token)
    if settings.offline:
        raise CheckpointError("HF_HUB_OFFLINE is set: publishing needs the network, unset it")
    directory = Path(directory)
    message = commit_message or _ready_to_publish(directory, repo_id, tag)
    api = _api(settings)
    with _hub_errors(repo_id, revision, settings, writing=True):
        url = api.create_repo(repo_id, private=private or None, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=directory,
            revision=revision,
            commit_message=message,
            allow_patterns=list(EXPORT_PATTERNS),  # never whatever else lies in the directory
            delete_patterns=list(EXPORT_PATTERNS),  # remote export files not uploaded now are stale
        )
        if tag:
            api.create_tag(repo_id, tag=tag, revision=commit.oid)
    return Published(repo_id, str(url), commit.oid, commit.commit_url, revision or "main", tag)
