"""The shipped recipes (``configs/<dataset>/<model>.yaml``) by name, and ``lm-zoo recipes``, which lists them.

A recipe is named by its path under ``configs/`` without ``.yaml``: ``ptb/lstm-small``. ``--config`` of ``fit``,
``validate``, ``test``, ``tune`` and ``search`` takes that name as well as a path, so a user who installed the wheel
(no clone, no ``configs/`` folder) can still run ``lm-zoo fit --config ptb/lstm-small``; the README's
``--config configs/ptb/lstm-small.yaml`` works there too, as the shipped copy of that file. A file that exists at the
given path always wins: a user's own recipe is never replaced by a shipped one.

Where the recipes are: pyproject.toml installs the repository's ``configs/`` folder as ``commands/configs`` inside the
wheel (package data, so ``pip install`` carries them); in a clone, installed editable or run from the checkout, they
are the checkout's own ``configs/``.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from pathlib import Path

from commands import COMMANDS
from commands.common import CommandParser
from zoo.errors import ConfigError

_HERE = Path(__file__).resolve().parent
SUFFIX = ".yaml"


def recipes_root() -> Path:
    """The folder the shipped recipes are in: the wheel's copy, else the clone's ``configs/``."""
    installed = _HERE / "configs"
    return installed if installed.is_dir() else _HERE.parent / "configs"


def recipes() -> dict[str, Path]:
    """Every shipped recipe, ``{"ptb/lstm-small": path, ...}``, sorted by name."""
    root = recipes_root()
    return {path.relative_to(root).with_suffix("").as_posix(): path for path in sorted(root.rglob(f"*{SUFFIX}"))}


def recipe_name(value: str) -> str:
    """The recipe name a ``--config`` value would stand for: ``configs/ptb/lstm-small.yaml`` -> ``ptb/lstm-small``."""
    name = value.replace("\\", "/").removeprefix("./").removeprefix("configs/")
    return name.removesuffix(SUFFIX).removesuffix(".yml")


def config_file(value: str, flag: str = "--config") -> str:
    """A ``--config`` value as a file: a path that exists as it is, else the shipped recipe it names.

    Raises:
        ConfigError: neither a file nor a shipped recipe's name; the message names the nearest recipe.
    """
    if Path(value).expanduser().is_file() or any(mark in value for mark in ":{\n"):
        return value  # a file, or YAML text given inline (jsonargparse takes both)
    known = recipes()
    name = recipe_name(value)
    if name in known:
        return str(known[name])
    near = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    raise ConfigError(
        f"{flag} {value}: no such file, and no shipped recipe of that name{hint}; lm-zoo recipes lists them"
    )


def as_given(path: str | Path) -> str:
    """How a user names ``path`` on a command line: a shipped recipe by its name (``ptb/lstm-small``; the file may be
    deep in site-packages), any other file as it is."""
    root = recipes_root()
    resolved = Path(path).resolve()
    if resolved.suffix == SUFFIX and resolved.is_relative_to(root):
        return resolved.relative_to(root).with_suffix("").as_posix()
    return str(path)


def with_config_files(args: Sequence[str]) -> list[str]:
    """``args`` with each ``--config NAME`` (or ``--config=NAME``) made a file's path (:func:`config_file`)."""
    resolved = list(args)
    for i, arg in enumerate(resolved):
        if arg == "--config" and i + 1 < len(resolved):
            resolved[i + 1] = config_file(resolved[i + 1])
        elif arg.startswith("--config="):
            resolved[i] = "--config=" + config_file(arg.removeprefix("--config="))
    return resolved


def summary(path: Path, width: int = 110) -> str:
    """A recipe's first sentence (at most ``width`` characters): the opening of its header comment, which names the
    paper and the model."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or not line.strip("# "):
            break
        words.append(line.lstrip("#").strip())
    text = " ".join(words)
    # A full stop ends the sentence unless it ends an abbreviation ("et al.", "e.g.").
    end = re.search(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.(\s|$)", text)
    text = text[: end.start() + 1] if end else text
    return text if len(text) <= width else text[: width - 1].rsplit(" ", 1)[0] + "…"


def cmd_recipes(argv: Sequence[str]) -> None:
    """``lm-zoo recipes``: the shipped recipes, their names for ``--config`` and what each is."""
    parser = CommandParser(prog="lm-zoo recipes", description=COMMANDS["recipes"].summary)
    parser.add_argument("dataset", nargs="?", help="only this dataset's recipes (ptb, ptb-char, wikitext-2, ...)")
    parser.add_argument("--json", action="store_true", help="print one JSON list of {name, path, summary}")
    args = parser.parse_args(argv)
    rows = [
        {"name": name, "path": str(path), "summary": summary(path)}
        for name, path in recipes().items()
        if args.dataset is None or name.split("/")[0] == args.dataset
    ]
    if not recipes():
        raise ConfigError(f"no recipes in {recipes_root()}: this installation of lm-zoo lacks its configs")
    if args.dataset is not None and not rows:
        datasets = sorted({name.split("/")[0] for name in recipes()})
        raise ConfigError(f"no recipes for {args.dataset!r}: the datasets are {', '.join(datasets)}")
    if args.json:
        print(json.dumps(rows))
        return
    width = max(len(row["name"]) for row in rows)
    for row in rows:
        print(f"{row['name']:<{width}}  {row['summary']}")
    print(f"\nlm-zoo fit --config NAME (e.g. {rows[0]['name']}); the files are in {recipes_root()}")
