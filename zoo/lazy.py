"""Packages that hand out their public names on first use (PEP 562), so that importing a light part of a package
(``zoo.errors``, a tokenizer, the scoring procedures) does not import its heavy parts (torch, Lightning)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for names defined in its modules, each imported when first used.

    Args:
        package: the package's ``__name__``.
        homes: each public name -> the module that defines it.

    Returns:
        ``(__getattr__, __dir__)``, to assign in the package's ``__init__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        vars(sys.modules[package])[name] = value  # the next lookup is a plain attribute, not this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return __getattr__, __dir__
