"""Figures of the house's shape: the library functions of 60 lines or more, which a newcomer reads least easily, each
with its place and length.

    python benchmarks/house.py            # the list and the count
    python benchmarks/house.py --count    # the count alone

The library is the five packages of docs/architecture.md's layers; a function's lines run from its ``def`` (its
decorators left out) to its last line, docstring included, as a reader meets them. ``tests/test_layers.py`` holds the
count at or under :data:`LONG_FUNCTIONS_AT_MOST`, so that it only falls.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("commands", "checkpoints", "lightning_modules", "datamodules", "zoo")  # top layer first
LONG = 60  # lines
#: The count when it was first measured (13); lower it as functions are split, never raise it.
LONG_FUNCTIONS_AT_MOST = 13


def long_functions(root: Path = ROOT, at_least: int = LONG) -> list[tuple[int, str, str]]:
    """The library's functions and methods of ``at_least`` lines or more: ``(lines, "path:line", name)``, longest
    first."""
    found = []
    for package in LIBRARY:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines >= at_least:
                        found.append((lines, f"{path.relative_to(root)}:{node.lineno}", node.name))
    return sorted(found, key=lambda row: (-row[0], row[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", action="store_true", help="print the count alone")
    args = parser.parse_args()
    rows = long_functions()
    if not args.count:
        for lines, place, name in rows:
            print(f"{lines:4d}  {place}  {name}")
    print(f"{len(rows)} library functions of {LONG} lines or more (at most {LONG_FUNCTIONS_AT_MOST} allowed)")


if __name__ == "__main__":
    main()
