"""The documentation says only what its results files hold: every rendered table is current, and the README stays a
page a newcomer finishes."""

from __future__ import annotations

import re
import shutil
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
