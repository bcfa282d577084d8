"""Where an XML model's sampled closing tags go wrong: the card's nesting measure, broken down by how far back the
tag being closed was opened.

``synthetic-xml-lstm``'s card gives one fraction (the closing tags of 100 sampled documents that close the innermost
open tag, :func:`checkpoints.bundle.xml_nesting`). This script samples the same documents (the same seed, count and
length) and splits that fraction by the characters between the opening tag's end and the closing tag's start: 0 (the
tag closed right after it was opened, so the name to copy was the last thing written), under 30, under 100, and
more (one or more whole elements between, so the name had to be kept while others were opened and closed)::

    python benchmarks/xml_nesting.py synthetic-xml-lstm
    python benchmarks/xml_nesting.py runs/synthetic/xml-lstm-wide/lightning_logs/version_0/checkpoints/best.ckpt

It prints the table and writes a new results file (``--out``; see benchmarks/output.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks import output  # noqa: E402

NAME = "xml_nesting"
SPANS = ((0, 1, "0: closed right after opening"), (1, 30, "1-29 characters"), (30, 100, "30-99"), (100, None, "100+"))
TAG = re.compile(r"<(/?)([a-z]+)>")


def closing_tags_by_span(text: str) -> list[tuple[int, bool]]:
    """``(characters between the tag's opening and its closing, whether the closing tag names it)`` for every closing
    tag of ``text`` that has a tag open (the rule of :func:`datamodules.synthetic.xml_closing_tags_matched`: a wrong
    closing tag still closes the innermost tag)."""
    open_tags: list[tuple[str, int]] = []  # (name, where its opening tag ends)
    closed = []
    for match in TAG.finditer(text):
        slash, name = match.groups()
        if not slash:
            open_tags.append((name, match.end()))
        elif open_tags:
            opened, end = open_tags.pop()
            closed.append((match.start() - end, opened == name))
    return closed


def by_span(texts: list[str]) -> list[dict[str, Any]]:
    """Matched and closing tags per span of :data:`SPANS`, over ``texts``."""
    closed = [pair for text in texts for pair in closing_tags_by_span(text)]
    rows = []
    for low, high, label in SPANS:
        inside = [matched for span, matched in closed if span >= low and (high is None or span < high)]
        rows.append({"span": label, "closing_tags": len(inside), "matched": sum(inside)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a registered name, an export directory or a .ckpt")
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)

    from checkpoints import LMZooError, load
    from checkpoints.bundle import SAMPLE_SEED, XML_MAX_TOKENS, XML_SAMPLES

    try:
        loaded = load(args.source)
    except LMZooError as error:  # a source that is not a model: lm-zoo's own one line, as its commands say it
        output.fail(str(error))
    texts, temperature = loaded.sample("", XML_SAMPLES, XML_MAX_TOKENS, seed=SAMPLE_SEED)
    rows = by_span(texts)
    command = " ".join(["python", "benchmarks/xml_nesting.py", *(sys.argv[1:] if argv is None else argv)])
    settings = {"samples": XML_SAMPLES, "max_tokens": XML_MAX_TOKENS, "seed": SAMPLE_SEED, "temperature": temperature}
    output.write(path, {"command": command, "source": args.source, **settings, "rows": rows})
    for row in rows:
        share = f"{row['matched'] / row['closing_tags']:.1%}" if row["closing_tags"] else "-"
        print(f"{row['span']:<32} {row['matched']:>5} of {row['closing_tags']:>5} matched ({share})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
