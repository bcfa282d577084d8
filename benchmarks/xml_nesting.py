"""Where an XML model's sampled closing tags go wrong: the card's nesting measure, broken down by how far back the
tag being closed was opened.

``synthetic-xml-lstm``'s card gives one fraction (the closing tags of 100 sampled documents that close the innermost
open tag, :func:`release.bundle.xml_nesting`). This script samples the same documents (the same seed, count and
length) and splits that fraction by the characters between the opening tag's end and the closing tag's start: 0 (the
tag closed right after it was opened, so the name to copy was the last thing written), under 30, under 100, and
more (one or more whole elements between, so the name had to be kept while others were opened and closed), and a
last row for closing tags written with no tag open (the model lost count of how deep it was; the card counts each as
wrong), so that the rows add up to the card's count::

    python benchmarks/xml_nesting.py synthetic-xml-lstm
    python benchmarks/xml_nesting.py runs/synthetic/xml-lstm-wide/lightning_logs/version_0/checkpoints/best.ckpt

Where the model's bits go on the generator's own documents (``--documents``, fresh from a seed the training text did
not use) tells why: each character's bits under the model, by what the character is. A closing tag's name (and its
``>``) has no entropy in the generator, so every bit spent there is the model not knowing which tag is open; an
opening tag's letters are uniform (log2 26 = 4.70 bits each); the rest (``<``, ``/``, ``>``, the end of a line) are
the generator's open/close decisions and the name lengths. Beside each role stand the generator's own bits (its exact
next-character distribution, :func:`datamodules.synthetic.xml_next_characters`: no model can spend fewer on average)
and the next-step accuracy that the paper's Table 1 reports for this task, the model's and the best possible (what the
generator's own most likely next character gets right).

A third table belongs to the training recipe, not the model: for the closing tags of the same documents, how often a
training window of 64, 256 or 1024 characters holds both the closing tag and the opening name it copies, as truncated
BPTT needs for the closing name's loss to teach the model to keep that name (:func:`within_window`).

It prints the tables and writes a new results file (``--out``; see benchmarks/output.py).
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks import output  # noqa: E402

NAME = "xml_nesting"
SPANS = ((0, 1, "0: closed right after opening"), (1, 30, "1-29 characters"), (30, 100, "30-99"), (100, None, "100+"))
TAG = re.compile(r"<(/?)([a-z]+)>")
NOTHING_OPEN = "no tag open"  # the last row of the sampled closing tags: each counted wrong, as the card counts it
ROLES = ["opening name", "structure", *(f"closing name {label}" for _, _, label in SPANS)]  # the tables' order
WINDOWS = (64, 256, 1024)  # BPTT of configs/synthetic/xml-lstm-long.yaml, of -wide and -gpu, and of -1024


def span_label(span: int) -> str:
    """The :data:`SPANS` label of a closing tag ``span`` characters after its opening tag."""
    return next(label for low, high, label in SPANS if span >= low and (high is None or span < high))


def closing_tags_by_span(text: str) -> list[tuple[int | None, bool]]:
    """``(characters between the tag's opening and its closing, whether the closing tag names it)`` for every closing
    tag of ``text``, by the rule of :func:`datamodules.synthetic.xml_closing_tags_matched`: a wrong closing tag still
    closes the innermost tag, and one with no tag open is ``(None, False)``."""
    open_tags: list[tuple[str, int]] = []  # (name, where its opening tag ends)
    closed = []
    for match in TAG.finditer(text):
        slash, name = match.groups()
        if not slash:
            open_tags.append((name, match.end()))
        elif open_tags:
            opened, end = open_tags.pop()
            closed.append((match.start() - end, opened == name))
        else:
            closed.append((None, False))
    return closed


def by_span(texts: list[str]) -> list[dict[str, Any]]:
    """Matched and closing tags per span of :data:`SPANS`, over ``texts``, then those with no tag open; together, the
    card's count (:func:`datamodules.synthetic.xml_closing_tags_matched`)."""
    closed = [pair for text in texts for pair in closing_tags_by_span(text)]
    rows = []
    for low, high, label in SPANS:
        inside = [ok for span, ok in closed if span is not None and span >= low and (high is None or span < high)]
        rows.append({"span": label, "closing_tags": len(inside), "matched": sum(inside)})
    rows.append({"span": NOTHING_OPEN, "closing_tags": sum(span is None for span, _ in closed), "matched": 0})
    return rows


def character_roles(document: str) -> list[str]:
    """What each character of one generated document is: ``opening name``, ``closing name <span>`` (the name and its
    ``>``, by the :data:`SPANS` label of how far back its tag opened) or ``structure`` (everything else)."""
    roles = ["structure"] * len(document)
    open_ends: list[int] = []
    for match in TAG.finditer(document):
        slash, _ = match.groups()
        if not slash:
            open_ends.append(match.end())
            roles[match.start(2) : match.end(2)] = ["opening name"] * len(match.group(2))
            continue
        label = span_label(match.start() - open_ends.pop())
        roles[match.start(2) : match.end()] = [f"closing name {label}"] * (match.end() - match.start(2))
    return roles


def bits_by_role(loaded: Any, texts: Sequence[str]) -> list[dict[str, Any]]:
    """The model's bits per character of the generator documents ``texts`` (one line each, read as one stream from a
    line start), per :func:`character_roles` role, beside the generator's own
    (:func:`datamodules.synthetic.xml_next_characters`: the fewest bits any model can spend); ``share`` is the
    role's bits over all characters. With them the next-step accuracy (Jozefowicz et al. 2015's Table 1 measure):
    how many characters the model's most likely character gets right (``correct``), and ``best_accuracy``, how many
    the generator's own most likely character gets right (the best any model can do; a tie counts as a coin toss
    between the tied characters)."""
    import torch

    from datamodules.synthetic import xml_next_characters

    roles = [role for text in texts for role in [*character_roles(text), "structure"]]  # "structure": the newline
    exact = [d for text in texts for d in xml_next_characters(text)]  # one per character and line end
    characters = "".join(text + "\n" for text in texts)
    targets = torch.as_tensor(loaded.tokenizer.encode_text(characters), dtype=torch.long)
    inputs = torch.cat([torch.tensor([loaded.tokenizer.bos_id]), targets[:-1]])  # (N,)
    with torch.no_grad():
        scores, _ = loaded.model.eval()(inputs.unsqueeze(0))  # (1, N, V)
        log_probs = torch.log_softmax(scores[0].float(), dim=-1)  # (N, V)
    bits = (-log_probs.gather(1, targets.unsqueeze(1))[:, 0] / math.log(2)).tolist()
    correct = (log_probs.argmax(dim=-1) == targets).tolist()
    totals: dict[str, dict[str, float]] = {}
    for role, value, right, distribution, character in zip(roles, bits, correct, exact, characters, strict=True):
        total = totals.setdefault(
            role, {"characters": 0, "bits": 0.0, "generator_bits": 0.0, "correct": 0, "best": 0.0}
        )
        total["characters"] += 1
        total["bits"] += value
        total["generator_bits"] -= math.log2(distribution[character])
        total["correct"] += right
        top = max(distribution.values())
        likeliest = [c for c, p in distribution.items() if p == top]
        total["best"] += (character in likeliest) / len(likeliest)  # a tie split evenly, as a fair coin would
    return [
        {
            "role": role,
            "characters": total["characters"],
            "bits_per_char": total["bits"] / total["characters"],
            "share": total["bits"] / len(bits),
            "generator_bits_per_char": total["generator_bits"] / total["characters"],
            "correct": total["correct"],
            "best_accuracy": total["best"] / total["characters"],
        }
        for role, total in sorted(totals.items(), key=lambda item: ROLES.index(item[0]))
    ]


def within_window(texts: Sequence[str], windows: Sequence[int] = WINDOWS) -> list[dict[str, Any]]:
    """How often truncated BPTT lets a closing name's gradient reach the opening name it copies, by :data:`SPANS` row:
    over the closing tags of the documents ``texts``, the mean chance that one training window of
    ``W`` characters holds both the opening name's first letter and the closing tag's ``>``, ``D`` characters apart:
    ``max(0, 1 - D / W)`` when a window boundary is as likely to fall at any character (documents run on in one
    stream). Outside that chance the loss at the closing name cannot teach the model to keep the name so long."""
    distances: dict[str, list[int]] = {label: [] for _, _, label in SPANS}
    for document in texts:
        opened: list[tuple[int, int]] = []  # (the name's first letter, the opening tag's end)
        for match in TAG.finditer(document):
            if not match.group(1):
                opened.append((match.start(2), match.end()))
                continue
            first_letter, end = opened.pop()
            distances[span_label(match.start() - end)].append(match.end() - 1 - first_letter)
    return [
        {
            "span": label,
            "closing_tags": len(values),
            "within": {
                str(w): sum(max(0.0, 1 - d / w) for d in values) / len(values) if values else None for w in windows
            },
        }
        for label, values in distances.items()
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a registered name, an export directory or a .ckpt")
    parser.add_argument("--documents", type=int, default=300, help="generator documents for the bits per role")
    parser.add_argument("--seed", type=int, default=12345, help="their generator seed (the corpus's splits use 0)")
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)

    from checkpoints import LMZooError, load
    from datamodules.synthetic import xml_document
    from release.bundle import SAMPLE_SEED, XML_MAX_TOKENS, XML_SAMPLES

    try:
        loaded = load(args.source)
    except LMZooError as error:  # a source that is not a model: lm-zoo's own one line, as its commands say it
        output.fail(str(error))
    texts, temperature = loaded.sample("", XML_SAMPLES, XML_MAX_TOKENS, seed=SAMPLE_SEED)
    rows = by_span(texts)
    command = " ".join(["python", "benchmarks/xml_nesting.py", *(sys.argv[1:] if argv is None else argv)])
    settings = {"samples": XML_SAMPLES, "max_tokens": XML_MAX_TOKENS, "seed": SAMPLE_SEED, "temperature": temperature}
    rng = random.Random(args.seed)
    generated = [xml_document(rng) for _ in range(args.documents)]  # fresh: the corpus's splits use seed 0
    bits = bits_by_role(loaded, generated)
    documents = {"documents": args.documents, "seed_documents": args.seed}
    windows = within_window(generated)
    results = {"command": command, "source": args.source, **settings, "rows": rows, "bits": bits, **documents}
    output.write(path, results | {"windows": windows})
    for row in rows:
        share = f"{row['matched'] / row['closing_tags']:.1%}" if row["closing_tags"] else "-"
        print(f"{row['span']:<32} {row['matched']:>5} of {row['closing_tags']:>5} matched ({share})")
    total = sum(row["share"] for row in bits)
    print(f"bits per character of {args.documents} generated documents (seed {args.seed}): {total:.3f}")
    for row in bits:
        print(
            f"{row['role']:<44} {row['characters']:>7} chars {row['bits_per_char']:6.3f} bits each "
            f"(the generator's {row['generator_bits_per_char']:.3f}), {row['share']:.3f}; next-step accuracy "
            f"{row['correct'] / row['characters']:.3f} (at best {row['best_accuracy']:.3f})"
        )
    for row in windows:
        within = ", ".join(f"BPTT {w} {'-' if share is None else f'{share:.1%}'}" for w, share in row["within"].items())
        print(f"closing tags {row['span']:<32} {row['closing_tags']:>6}: one window holds the name to copy: {within}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
