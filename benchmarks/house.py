"""Figures of the house's shape: the library functions of 60 lines or more, which a newcomer reads least easily, each
with its place and length; and the places in the library that repeat six or more lines of another.

    python benchmarks/house.py            # the lists and the counts
    python benchmarks/house.py --count    # the counts alone

The library is the seven packages of docs/architecture.md's layers; a function's lines run from its ``def`` (its
decorators left out) to its last line, docstring included, as a reader meets them. Repeated code is counted in pairs of
places: two runs of :data:`REPEATED` or more lines that are the same once each line's indentation is stripped (blank
lines and comments skipped), each maximal run once. Lines that only close a bracket or a docstring, or open one, say
nothing of their own and do not count towards a run. ``tests/test_layers.py`` holds both counts at or under
:data:`LONG_FUNCTIONS_AT_MOST` and :data:`REPEATED_PAIRS_AT_MOST`, so that they only fall.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("commands", "checkpoints", "search", "lightning_modules", "evaluation", "datamodules", "zoo")  # top first
LONG = 60  # lines
#: The count when it was first measured was 13; lower it as functions are split, never raise it.
LONG_FUNCTIONS_AT_MOST = 6
REPEATED = 6  # lines
#: The count when it was first measured (6); lower it as repeats are folded into one place, never raise it.
REPEATED_PAIRS_AT_MOST = 6
# Lines that carry no code of their own: a run made of them is no repeat.
_EMPTY_LINES = {"", ")", "]", "}", "),", "],", "},", '"""', "):", ") -> None:", "else:", "try:", "return", "pass"}


def _empty(line: str) -> bool:
    """Whether a stripped line carries no code of its own (an import is a file's, not its logic's)."""
    return (
        line in _EMPTY_LINES or line.startswith(("#", "import ")) or (line.startswith("from ") and " import " in line)
    )


def _library_files(root: Path) -> list[Path]:
    return [path for package in LIBRARY for path in sorted((root / package).rglob("*.py"))]


def long_functions(root: Path = ROOT, at_least: int = LONG) -> list[tuple[int, str, str]]:
    """The library's functions and methods of ``at_least`` lines or more: ``(lines, "path:line", name)``, longest
    first."""
    found = []
    for path in _library_files(root):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines >= at_least:
                    found.append((lines, f"{path.relative_to(root)}:{node.lineno}", node.name))
    return sorted(found, key=lambda row: (-row[0], row[1]))


def repeated_code(root: Path = ROOT, at_least: int = REPEATED) -> list[tuple[int, str, str]]:
    """The library's pairs of places that share ``at_least`` or more consecutive lines (see the module's docstring):
    ``(lines, "path:line", "path:line")``, longest first."""
    code: list[tuple[str, list[tuple[int, str]]]] = []  # each file's lines that carry code: (line number, text)
    for path in _library_files(root):
        lines = [(number, line.strip()) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)]
        kept = [(number, text) for number, text in lines if not _empty(text)]
        code.append((str(path.relative_to(root)), kept))
    places = defaultdict(list)  # a window of `at_least` lines -> where it starts: (file index, position)
    for file, (_, kept) in enumerate(code):
        for start in range(len(kept) - at_least + 1):
            places[tuple(text for _, text in kept[start : start + at_least])].append((file, start))

    def same(a: tuple[int, int], b: tuple[int, int]) -> bool:
        (fa, sa), (fb, sb) = a, b
        return 0 <= sa < len(code[fa][1]) and 0 <= sb < len(code[fb][1]) and code[fa][1][sa][1] == code[fb][1][sb][1]

    pairs = []
    for starts in places.values():
        for i, a in enumerate(starts):
            for b in starts[i + 1 :]:
                if a[0] == b[0] and abs(a[1] - b[1]) < at_least:  # a run overlapping itself
                    continue
                if same((a[0], a[1] - 1), (b[0], b[1] - 1)):  # not where the run starts
                    continue
                length = at_least
                while same((a[0], a[1] + length), (b[0], b[1] + length)):
                    length += 1
                (fa, sa), (fb, sb) = a, b
                pairs.append((length, f"{code[fa][0]}:{code[fa][1][sa][0]}", f"{code[fb][0]}:{code[fb][1][sb][0]}"))
    return sorted(pairs, key=lambda row: (-row[0], row[1], row[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", action="store_true", help="print the count alone")
    args = parser.parse_args()
    rows = long_functions()
    if not args.count:
        for lines, place, name in rows:
            print(f"{lines:4d}  {place}  {name}")
    print(f"{len(rows)} library functions of {LONG} lines or more (at most {LONG_FUNCTIONS_AT_MOST} allowed)")
    pairs = repeated_code()
    if not args.count:
        for lines, first, second in pairs:
            print(f"{lines:4d}  {first}  {second}")
    print(f"{len(pairs)} pairs of places repeating {REPEATED} lines or more (at most {REPEATED_PAIRS_AT_MOST} allowed)")


if __name__ == "__main__":
    main()
