"""The documentation says only what its results files hold: every rendered table is current, and the README stays a
page a newcomer finishes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from benchmarks import render

ROOT = Path(__file__).resolve().parents[1]


def test_every_rendered_block_matches_its_results_file() -> None:
    assert render.stale_blocks() == [], "run python benchmarks/render.py"


def test_every_block_names_a_renderer_and_every_renderer_is_used() -> None:
    used = {m["name"] for path in render.documents() for m in render.BLOCK.finditer(path.read_text(encoding="utf-8"))}
    assert used == set(render.RENDERERS)


def test_a_figure_edited_by_hand_inside_a_block_is_caught(tmp_path: Path) -> None:
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    music = tmp_path / "docs" / "music.md"
    text = music.read_text(encoding="utf-8")
    block = next(m for m in render.BLOCK.finditer(text) if m["name"] == "music-table")
    first_figure = re.search(r"\d\.\d{3}", block["body"])
    assert first_figure is not None
    edited = block[0].replace(first_figure[0], "9.999", 1)
    music.write_text(text.replace(block[0], edited), encoding="utf-8")
    assert render.stale_blocks(tmp_path) == ["docs/music.md: music-table"]


def test_the_readme_is_a_page_a_newcomer_finishes() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    words = len(re.sub(r"<!--.*?-->", "", text, flags=re.S).split())
    assert words <= 2000, f"README.md has {words} words; move detail to docs/"


def test_relative_links_in_the_docs_point_at_files() -> None:
    broken = []
    for path in render.documents():
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert broken == []


# Our tracker's issues are not the reader's: "issue 32" in a card, a doc or a config means nothing to a user. Upstream
# projects' issues are named with their project and a '#' ("Lightning issue #21724") and stay.
TRACKER_REFERENCE = re.compile(r"\bissues? \d+", re.I)


def _shipped_text() -> list[Path]:
    """The text lm-zoo ships to its readers: README, docs, recipes, model cards and their notes, library code."""
    files = [ROOT / "README.md", ROOT / "cli.py", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "configs").rglob("*.yaml"))
    files += sorted((ROOT / "pretrained").glob("*/README.md")) + sorted((ROOT / "pretrained").glob("*/config.json"))
    for package in ("zoo", "datamodules", "lightning_modules", "checkpoints", "commands"):
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def test_no_shipped_text_names_a_tracker_issue() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match[0]}"
        for path in _shipped_text()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in TRACKER_REFERENCE.finditer(line)
    ]
    assert found == []
    assert TRACKER_REFERENCE.search("once it met issue 32's aim") and not TRACKER_REFERENCE.search("issue #21724")


def test_a_ratio_whose_rounds_span_1_is_said_to_show_no_difference() -> None:
    assert (
        render.ratio_cell(0.93, [0.77, 1.11], "× the time")
        == "no difference measured: 0.93× the time (rounds 0.77-1.11)"
    )
    assert render.ratio_cell(1.57, [1.61, 1.50]) == "1.57× (rounds 1.50-1.61)"
    assert render.ratio_cell(0.50, [0.31, 0.86]).startswith("0.50×")
    # Every page's ratios go through the rule: a rendered "no difference" is there exactly where a range spans 1.
    pages = "".join(path.read_text(encoding="utf-8") for path in render.documents())
    for low, high in re.findall(r"\(rounds (\d+\.\d+)-(\d+\.\d+)\)", pages):
        assert float(low) <= float(high)
    stated = re.findall(r"(no difference measured: )?[\d.]+×?[^|(]*\(rounds (\d+\.\d+)-(\d+\.\d+)\)", pages)
    assert stated and all(bool(said) == (float(low) <= 1 <= float(high)) for said, low, high in stated)


def test_every_gpu_result_says_what_ran_it_and_whether_the_code_moved_on() -> None:
    for path in sorted((ROOT / "benchmarks" / "results").glob("*_cuda.json")):
        provenance = render.provenance_of(json.loads(path.read_text(encoding="utf-8"))) or {}
        assert {"commit", "device", "torch", "cuda"} <= set(provenance), path.name
        assert path.name in render.MEASURED_CODE, f"{path.name}: say which code it measured in render.MEASURED_CODE"
        paragraph = render.gpu_provenance(path.name)
        assert provenance["commit"] in paragraph and f"CUDA {provenance['cuda']}" in paragraph
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert render._changed_since(first.stdout.split()[0], ("zoo",)) == ["zoo"]
    assert render._changed_since("HEAD", ("zoo", "datamodules")) == []
    assert render._changed_since("0" * 12, ("zoo",)) is None
    assert render._outside_pins({"huggingface_hub": "1.33.0", "lightning": "2.6.6"}) == [
        "huggingface_hub 1.33.0 (the project: <3,>=2.4)"
    ]
    assert render._outside_pins({"torch": "2.11.0+cu130"}) and not render._outside_pins({"torch": "2.13.0+cpu"})


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_architecture_guides_name_files_and_names_that_exist() -> None:
    """docs/architecture.md's "Decisions made once" and "Where to add things" point at the code: every file they name
    exists, every dotted name imports, and every "`NAME` in `FILE`" is defined in that file."""
    import importlib

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    guides = _section(text, "Decisions made once") + _section(text, "Where to add things")
    files = set(re.findall(r"`([\w/]+\.py)`", guides))
    assert len(files) >= 10, files
    for path in files:
        assert (ROOT / path).is_file(), f"docs/architecture.md names {path}, which is not there"
    packages = "zoo|datamodules|evaluation|lightning_modules|search|checkpoints|commands|cli"
    dotted = set(re.findall(rf"`((?:{packages})\.[\w.]+)`", guides))
    assert len(dotted) >= 8, dotted
    for name in dotted:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attribute in parts[cut:]:
                assert hasattr(found, attribute), f"docs/architecture.md names {name}: no {attribute}"
                found = getattr(found, attribute)
            break
        else:
            raise AssertionError(f"docs/architecture.md names {name}, which does not import")
    defined = re.findall(r"`(\w+)` in\s+`([\w/]+\.py)`", guides)
    defined += [(name, path) for path, name in re.findall(r"`([\w/]+\.py)`\s+\(`(\w+)`\)", guides)]
    assert len(defined) >= 5, defined
    for name, path in defined:
        source = (ROOT / path).read_text(encoding="utf-8")
        pattern = rf"^\s*(def|class) {name}\b|^{name}\b[^=\n]*="
        assert re.search(pattern, source, re.M), f"docs/architecture.md says {name} is in {path}; it is not"


def test_the_change_footprint_table_lists_files_that_exist_and_counts_them() -> None:
    """docs/architecture.md's table of what each common change touches: a row per change (cell, corpus, scoring
    procedure, subcommand, export field), each file it lists there (a ``<name>`` one: its folder holds such files), and
    its count the number of files listed."""
    from benchmarks.house import LIBRARY

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text[text.index("<!-- change-footprint -->") : text.index("<!-- /change-footprint -->")]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [change.strip() for change, _, _ in rows] == [
        "a cell",
        "a corpus",
        "a way to score a model",
        "a subcommand",
        "an export field",
    ]
    for change, files, count in rows:
        paths = re.findall(r"`([\w/<>]+\.py)`", files)
        assert len(paths) == int(count), (change, paths)
        for path in paths:
            assert path.split("/")[0] in LIBRARY, (change, path)
            matches = list(ROOT.glob(re.sub(r"<\w+>", "*", path)))
            assert matches, f"docs/architecture.md: {change} touches {path}, which is not there"
