"""The synthetic tasks of Jozefowicz, Zaremba & Sutskever 2015, "An Empirical Exploration of Recurrent Network
Architectures", section 3.5: XML modelling and arithmetic with distractors.

Both are character-level next-step prediction tasks. Every generator draws only from the ``random.Random`` it is
given, so a seed fixes the text exactly, on any machine and Python run.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable

from zoo.errors import DataError

# Part of the cache key of generated corpora (datamodules.corpora): bump it whenever a generator's output changes.
GENERATOR_VERSION = 1

XML_MAX_ITERATIONS = 50  # after this many steps a document only closes tags (paper: "or after 50 iterations")
XML_TAG_LENGTH = (2, 10)  # lowercase letters per tag name
ARITHMETIC_MAX_DIGITS = 8
ARITHMETIC_MAX_DISTRACTORS = 3  # random letters between successive input characters, 0 to this many


def _tag_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(*XML_TAG_LENGTH)))


def xml_document(rng: random.Random) -> str:
    """Generate one synthetic XML document (one line, no newline).

    Each step, with probability 0.5 (always once :data:`XML_MAX_ITERATIONS` steps have passed) the most recently
    opened tag is closed, or the document ends if none is open; otherwise a new random tag is opened. The paper's
    sample reads "etdomp pegshmnaj zbhbmg /zbhbmg /pegshmnaj ..." only because its text extraction lost the angle
    brackets; the tags are written here as ``<name>`` and ``</name>``, with nothing between them.
    :func:`xml_next_characters` follows this procedure step by step: a change here is a change there.

    Args:
        rng: The source of randomness.

    Returns:
        E.g. ``<etdomp><pegshmnaj><zbhbmg></zbhbmg></pegshmnaj><autmh></autmh></etdomp>``.
    """
    # Starting with one open tag keeps a document from being empty (a first "close" step would otherwise end it).
    open_tags = [_tag_name(rng)]
    parts = [f"<{open_tags[0]}>"]
    step = 0
    while True:
        step += 1
        if step > XML_MAX_ITERATIONS or rng.random() < 0.5:
            if not open_tags:
                break
            parts.append(f"</{open_tags.pop()}>")
        else:
            open_tags.append(_tag_name(rng))
            parts.append(f"<{open_tags[-1]}>")
    return "".join(parts)


XML_TAG = re.compile(r"<(/?)([a-z]+)>")
XML_LINE_END = "\n"  # what ends a document in a corpus (one per line)


def _close_probability(decision: int) -> float:
    """The chance that :func:`xml_document`'s ``decision``-th step (counted from 1) closes rather than opens."""
    return 1.0 if decision > XML_MAX_ITERATIONS else 0.5


def _name_letter(k: int) -> dict[str, float]:
    """What follows an opening name's first ``k`` letters: its length is uniform over :data:`XML_TAG_LENGTH`, so
    it ends here (``>``) with probability P(length = k | length >= k); each letter is uniform."""
    low, high = XML_TAG_LENGTH
    ends = 0.0 if k < low else 1.0 / (high - k + 1)
    letters = dict.fromkeys(string.ascii_lowercase, (1.0 - ends) / 26) if ends < 1.0 else {}
    return letters | ({">": ends} if ends > 0.0 else {})


def xml_next_characters(document: str) -> list[dict[str, float]]:
    """The generator's own distribution of each character of ``document`` and of the line end after it, given the
    document's characters before it: what a model that knew :func:`xml_document` exactly would predict.

    The generator draws only each step's open-or-close decision (1 bit, none once :data:`XML_MAX_ITERATIONS` steps
    have passed), each opening name's length and its letters; a closing tag copies a name, so its characters are
    certain. The text shows each decision as it is drawn: after a tag's ``>`` comes ``<`` unless no tag is open (then
    a close ends the document), and after that ``<`` either ``/`` (a close) or an opening name's first letter.

    Args:
        document: one document of :func:`xml_document` (no line end).

    Returns:
        One ``{character: probability}`` per character of ``document + "\\n"`` (characters of probability 0 left out).

    Raises:
        DataError: ``document`` is not a document the generator can write.
    """
    tags = [(bool(slash), name) for slash, name in XML_TAG.findall(document)]
    low, high = XML_TAG_LENGTH
    if (
        not tags
        or tags[0][0]
        or "".join(f"<{'/' * closing}{name}>" for closing, name in tags) != document
        or any(not low <= len(name) <= high for _, name in tags)
    ):
        raise DataError(f"not a synthetic XML document: {document[:60]!r}")
    uniform = dict.fromkeys(string.ascii_lowercase, 1 / 26)
    distributions: list[dict[str, float]] = [{"<": 1.0}, uniform]  # the first tag: opened before any decision
    open_tags = [tags[0][1]]
    distributions += [_name_letter(k) for k in range(1, len(tags[0][1]) + 1)]
    for decision, (closing, name) in enumerate([*tags[1:], (True, None)], start=1):
        close = _close_probability(decision)
        if not open_tags:  # nothing open: a close ends the document, so a "<" opens, with a uniform first letter
            distributions.append(_possible({"<": 1.0 - close, XML_LINE_END: close}))
            if name is None:
                break
            distributions.append(uniform)
        elif name is None:
            raise DataError(f"not a synthetic XML document (tags left open): {document[:60]!r}")
        else:  # "<" either way, then the decision shows: "/" or an opening name's first letter
            after = dict.fromkeys(string.ascii_lowercase, (1.0 - close) / 26) | {"/": close}
            distributions += [{"<": 1.0}, _possible(after)]
        if closing:
            if not open_tags or open_tags.pop() != name:
                raise DataError(f"not a synthetic XML document (a closing tag that does not nest): {document[:60]!r}")
            distributions += [{letter: 1.0} for letter in name] + [{">": 1.0}]  # a copy: certain
        else:
            if close == 1.0:
                raise DataError(f"not a synthetic XML document (opens after {XML_MAX_ITERATIONS} steps)")
            open_tags.append(name)
            distributions += [_name_letter(k) for k in range(1, len(name) + 1)]
    return distributions


def _possible(distribution: dict[str, float]) -> dict[str, float]:
    return {character: p for character, p in distribution.items() if p > 0.0}


def xml_closing_tags_matched(text: str) -> tuple[int, int]:
    """How many closing tags of ``text`` close the most recently opened tag, and how many closing tags there are.

    What a model of the XML task must learn (Jozefowicz et al. 2015 §3.5): to close a tag it has to remember which
    tags are open and copy the innermost one's name. A wrong closing tag still closes the innermost tag, so one
    mistake is counted once; a closing tag with no tag open counts as wrong.

    Args:
        text: generated documents (e.g. samples of a model), each tag ``<name>`` or ``</name>``.

    Returns:
        ``(matched, closing)``.
    """
    open_tags: list[str] = []
    matched = closing = 0
    for slash, name in XML_TAG.findall(text):
        if not slash:
            open_tags.append(name)
            continue
        closing += 1
        if open_tags:
            matched += open_tags.pop() == name
    return matched, closing


def _operand(rng: random.Random) -> int:
    digits = rng.randint(1, ARITHMETIC_MAX_DIGITS)
    # Draw the digit count first, then the digits, so short and long numbers are equally common (a uniform draw over
    # the range would make nearly every number 8 digits long).
    value = rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)
    return -value if rng.random() < 0.5 else value


def arithmetic_example(rng: random.Random) -> str:
    """Generate one arithmetic example with distractors (one line, no newline).

    Two integers of 1 to 8 digits with random signs and an operator ``+`` or ``-`` are written with 0 to 3 random
    lowercase letters after every character of the problem, then ``=``, the exact result and ``.`` (the paper's
    end-of-output symbol). The paper prints a space after ``=``, but its 40-symbol alphabet (a-z, 0-9, ``+-=.``) has
    none, so none is written. A negative second operand follows the operator directly (``12--5=17.``), which is
    unambiguous.

    Args:
        rng: The source of randomness.

    Returns:
        E.g. ``3e36d9-h1h39f94eeh43keg3c=-13991064.`` (that is, 3369-13994433=-13991064).
    """
    a, b = _operand(rng), _operand(rng)
    op = rng.choice("+-")
    result = a + b if op == "+" else a - b
    parts = []
    for ch in f"{a}{op}{b}":
        parts.append(ch)
        parts.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(0, ARITHMETIC_MAX_DISTRACTORS))))
    return "".join(parts) + f"={result}."


SYNTHETIC_TASKS: dict[str, Callable[[random.Random], str]] = {
    "xml": xml_document,
    "arithmetic": arithmetic_example,
}


def generate_splits(
    task: str, seed: int = 0, train_chars: int = 1_000_000, valid_chars: int = 100_000, test_chars: int = 100_000
) -> dict[str, str]:
    """Generate the train/valid/test text of a synthetic task, one example per line.

    Each split is drawn from its own stream, seeded by ``"<seed>-<split>"``, so changing one split's size leaves the
    others unchanged. Lines are added until the split holds at least its number of characters.

    Args:
        task: A key of :data:`SYNTHETIC_TASKS`.
        seed: The seed.
        train_chars: Minimum characters of the train split.
        valid_chars: Minimum characters of the valid split.
        test_chars: Minimum characters of the test split.

    Returns:
        ``{"train": ..., "valid": ..., "test": ...}``, each ending with a newline.

    Raises:
        DataError: The task is unknown or a size is not positive.
    """
    try:
        make = SYNTHETIC_TASKS[task]
    except KeyError:
        raise DataError(f"unknown synthetic task {task!r}; use one of {', '.join(SYNTHETIC_TASKS)}") from None
    sizes = {"train": train_chars, "valid": valid_chars, "test": test_chars}
    for split, size in sizes.items():
        if size <= 0:
            raise DataError(f"{split}_chars of synthetic task {task!r} must be positive, got {size}")
    out = {}
    for split, size in sizes.items():
        # A str seed is hashed with SHA-512 by random.Random, so unlike hash() it is the same in every Python run.
        rng = random.Random(f"{seed}-{split}")
        lines, total = [], 0
        while total < size:
            line = make(rng) + "\n"
            lines.append(line)
            total += len(line)
        out[split] = "".join(lines)
    return out
