"""Targeted syntactic evaluation (Marvin & Linzen 2018; Shen et al. 2019 §5.3): does the model give the grammatical
sentence of a minimal pair the higher probability?

The test sentences are Marvin & Linzen's templates (BeckyMarvin/LM_syneval): pickles, each a dict from a sub-case to a
list of tuples ``(grammatical, ungrammatical)``, or ``(grammatical, intrusive, ungrammatical)`` for negative polarity
items. A pickle can run code when it is loaded, so lm-zoo reads them only from the two archives named in
``MANIFEST.md`` (``templates.tar.xz``, ``emnlp2018_templates.tar.xz``, checked by sha256) or from a directory of the
original pickle files (each checked against :data:`KNOWN_PICKLES`), and even then with an unpickler that refuses every
global: the templates are plain dicts, lists, tuples and strings.

Scoring follows the authors' code (``src/LM_eval.py``, ``src/analyze_results.py``):

- each sentence is read from a zero state after ``<eos>``; its log-probability is the sum over its words and its end:
  the code appends ``" ."`` to every sentence and scores the words and the full stop; a model whose vocabulary has no
  ``"."`` (Mikolov's PTB) scores its end-of-sentence ``<eos>`` instead;
- words the model does not know are read and scored as ``<unk>``, as the code does; lm-zoo counts the tuples that hold
  one per condition, and also gives the accuracy on the tuples without any;
- a pair is right when the grammatical sentence is strictly more probable (the code's ``full_sent`` analysis);
- the ``_anim`` / ``_inanim`` files of a condition are joined (the code's default);
- NPI tuples give two comparisons, grammatical against the intrusive-licensor and against the unlicensed sentence;
  both are reported, and the condition's accuracy counts both (the code also reports intrusive vs. unlicensed, here
  too).
"""

from __future__ import annotations

import hashlib
import io
import pickle
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from evaluation.sentences import score_sentences
from zoo.errors import DataError

TEMPLATES_SOURCE = "https://github.com/BeckyMarvin/LM_syneval/tree/edb7378 (data/templates, EMNLP2018/templates)"
ARCHIVES = {  # sha256 of the tar.xz archives that repack the pickles of TEMPLATES_SOURCE
    "045082eeb12743e822def32b5b8992982b2665f18599ced850ff993d2e023952": "templates.tar.xz",
    "4e235382c5ab1ab4a0bf34aa4ff6286049226df835dfc6e55a37ac689242c056": "emnlp2018_templates.tar.xz",
}
KNOWN_PICKLES = {  # sha256 of each pickle in those archives -> archive/stem (BeckyMarvin/LM_syneval @ edb7378)
    "1cb1cfb8c948ff5215a232651bf8e1e9614b551e3bdd54aafaa4602d1a452f55": "templates/long_vp_coord",
    "2b7fa7b982203bb6dbebac195dbfa2c1cd85b6513dc7f55cda3190576a2f7880": "templates/npi_across_anim",
    "266c018281917f1724d98e58daafb18f564bfb972c9a1acd59d0e1f43112b68a": "templates/npi_across_inanim",
    "7b2de6479f0d7e40b5cc00bf94c040e83b5073623e7469de2e45f81b14cad553": "templates/obj_rel_across_anim",
    "e1ff3d8ec257877c9e29f6055c599fe77945c6792c36fe141fe742128f2abd96": "templates/obj_rel_across_inanim",
    "0c25e62c023b8271e7be10cb31dbc6758c012aca15c00734764edbb1856a7061": "templates/obj_rel_no_comp_across_anim",
    "aed5549987a0e67c6d8fd9d6a54d020ccb487a66773fae544c0f65a1275632ba": "templates/obj_rel_no_comp_across_inanim",
    "83df142f7637ecbb002bbdce000f4a60713da56c71e5f6f639abeadbc057097b": "templates/obj_rel_no_comp_within_anim",
    "b19061a2ea9b0dee802ef0768f18d0b874dec3d29c5dda1bb1f74b6b988c05a3": "templates/obj_rel_no_comp_within_inanim",
    "f22fcdd2bd67d0c3b8b31db51b6c93eb526356e5519494cee5909cebbf53f977": "templates/obj_rel_within_anim",
    "ada5adf816d090164a18d7e73c3922a490e3028fa3412b00e617fd0ce9f1f30f": "templates/obj_rel_within_inanim",
    "f4e77f02c09476020779c1bf4e783b7acfdca7ff7ef18d3b25044ef6e8bd3bfc": "templates/prep_anim",
    "bcc2f47d77bcf67e12fffeb1931151121ebf313a53a2bddf673cdcd858032cbc": "templates/prep_inanim",
    "ddc7e41441905f1238bca64f0ee5efabeb7786ff2ff7038d73823d2fbaddc80d": "templates/reflexive_sent_comp",
    "b750c5c037c1565d34c3703a6b1b6757e47333f99e35d2c0a21ccef9437ee577": "templates/reflexives_across",
    "df1b20958ca4cae2201e76d3d6d29463be04e3cafe641e6e4b110605648273ad": "templates/sent_comp",
    "8fe0028fae901a0a54569bd6614bef6f9aabe05b8f24b6b1486fb07df7dc0739": "templates/simple_agrmt",
    "abd2655c2977692458c3545145eb508f4fb33282413e92b0c1115cb6d9a293f7": "templates/simple_npi_anim",
    "7125d042f12357f5d9c7bddd87f450602afc28fcd86a1c3df3b026e49dcb243c": "templates/simple_npi_inanim",
    "e4cbf81ca6715d40f210242775278b98958f38d2a97fea32a0cf81a586bfcb93": "templates/simple_reflexives",
    "9c4af66ccaf5594bc387d5598cc421f6278c9595679aebe4c3abf01e53f4be9e": "templates/subj_rel",
    "9a2036902d1cad6fe7ec55110204a80aa7a0e71c381fdcd6f091c0fd40f71b65": "templates/vp_coord",
    "9d7554090a51e36f0d36cd62abdbd254449de0fa584e8b9eca5debfa6387dc37": "emnlp2018/long_vp_coord",
    "ea32dc8b8cf5c01e1f87c350e5664ea289bc2e62020f84e8da136fa164d28e57": "emnlp2018/npi_across_anim",
    "482a56b315e515c86b0ab68fbc3cc9454095c90a7106d8a968fc8b107b0ef6f1": "emnlp2018/npi_across_inanim",
    "4517b75b48911de2884e3b713a86653a2ed3661b4a1e36b02804b56aeb0534ab": "emnlp2018/obj_rel_across_anim",
    "214f588151ab0483c2b1d91f02e06ee7935a186024bb109185961cb7c4a96f83": "emnlp2018/obj_rel_across_inanim",
    "ef148a8bdcdf87e7f3bec87a0e065440848b08f62fc6d36eb8ddc403e84c32da": "emnlp2018/obj_rel_no_comp_across_anim",
    "ec4134f7e410ea535e9e7cd0f5220d0d3211b67d230d544bd7f9f45784eed790": "emnlp2018/obj_rel_no_comp_across_inanim",
    "0c3bee2aec08dad8da2dfff353808b9ba80f6da6be5925aad53f033d3b443860": "emnlp2018/obj_rel_no_comp_within_anim",
    "842f882b01a6dd4e95f52d5a25c4ac37f7678942b42fc1468fba96cd9b1045c8": "emnlp2018/obj_rel_no_comp_within_inanim",
    "fa50aa3547d5e3c1425739ef2b91db2994923f068dde5e5441a6dd9f2f0118d7": "emnlp2018/obj_rel_within_anim",
    "327bdbf47f25b0bc82c21d528363eed0a47a5218c06cc9e8f51221b4365fdec3": "emnlp2018/obj_rel_within_inanim",
    "598fc011ed827631bb351d08dd1af2e82f85c1789be87282dcc82637531bf64a": "emnlp2018/prep_anim",
    "4fb992548d8cad5fbfd7fa88a07cdcf27c847774648cb1605b5787567cc6de20": "emnlp2018/prep_inanim",
    "50b39c0e0ca93fe16744d80124ff318d1efcf4aafddbea151284b8b18f9c0950": "emnlp2018/reflexive_sent_comp",
    "47f4115b1b003146ece857d3fcb7ca8b0e272c0384953b55d8ddf499594a8a1b": "emnlp2018/reflexives_across",
    "0a1a7b0dfcc09823b01f6a14dffce3d483ef04a740007277b0327bd5decac303": "emnlp2018/sent_comp",
    "d10585a3db5b22512ad6fec2238116c1f56634a9b60b743b123cac766aec2ea8": "emnlp2018/simple_agrmt",
    "f69699b4aea7c4186032e8707deb383a72f711d64a6ecf5ecdce1796bb9061f1": "emnlp2018/simple_npi_anim",
    "b3c6eab2314ec0fe8cb7573e0833861ba068c9996c62635deb33fd39af79e73a": "emnlp2018/simple_npi_inanim",
    "13997fd212fa5363d70ebd03f006497bd493492b03033a2ae73aa23c17c27b05": "emnlp2018/simple_reflexives",
    "8460fc3ef12233c9e1cfb91a2f228ace34cb4216a6de807aa4a8612edf119fc9": "emnlp2018/subj_rel",
    "c69a77842035878fdee77d1591e94e559b14d8b872a66bc909cfcbe5a06880df": "emnlp2018/vp_coord",
}
TEMPLATES_URL = "https://github.com/BeckyMarvin/LM_syneval"

# Marvin & Linzen's conditions (their Table 3 and Shen et al.'s), in their order: file stem after joining -> name.
CONDITIONS = {
    "simple_agrmt": "agreement: simple",
    "sent_comp": "agreement: in a sentential complement",
    "vp_coord": "agreement: short VP coordination",
    "long_vp_coord": "agreement: long VP coordination",
    "prep": "agreement: across a prepositional phrase",
    "subj_rel": "agreement: across a subject relative clause",
    "obj_rel_across": "agreement: across an object relative clause",
    "obj_rel_no_comp_across": "agreement: across an object relative (no that)",
    "obj_rel_within": "agreement: in an object relative clause",
    "obj_rel_no_comp_within": "agreement: in an object relative (no that)",
    "simple_reflexives": "reflexive anaphora: simple",
    "reflexive_sent_comp": "reflexive anaphora: in a sentential complement",
    "reflexives_across": "reflexive anaphora: across a relative clause",
    "simple_npi": "NPI: simple",
    "npi_across": "NPI: across a relative clause",
}


class _NoGlobals(pickle.Unpickler):
    """An unpickler for plain data: any class or function reference is refused, so loading cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"the templates may only hold plain data, and this one names {module}.{name}")


def _plain_load(data: bytes, name: str) -> dict[str, list[tuple[str, ...]]]:
    try:
        loaded = _NoGlobals(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise DataError(f"{name} is not a Marvin & Linzen template file: {error}") from None
    if not isinstance(loaded, dict):
        raise DataError(f"{name} is not a Marvin & Linzen template file: it holds a {type(loaded).__name__}")
    return loaded


def condition_of(stem: str) -> str:
    """The condition a template file belongs to: its stem without ``_anim`` / ``_inanim`` (joined, as the code)."""
    return stem.rsplit("_", 1)[0] if stem.endswith("anim") else stem


def read_templates(path: str | Path) -> dict[str, list[tuple[str, ...]]]:
    """Every condition's tuples, sub-cases in file order, from a known archive or a directory of known pickles.

    Raises:
        DataError: the path is missing, or is not one of the known archives or files (named in the message).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(
            f"no templates at {path}: give --templates templates.tar.xz or emnlp2018_templates.tar.xz "
            f"(Marvin & Linzen's pickles, {TEMPLATES_URL}), or a directory of those pickles"
        )
    files: list[tuple[str, bytes]] = []
    if path.is_dir():
        for file in sorted(path.glob("*.pickle")):
            data = file.read_bytes()
            if hashlib.sha256(data).hexdigest() not in KNOWN_PICKLES:
                raise DataError(
                    f"{file} is not one of Marvin & Linzen's template files (its sha256 is unknown), and a pickle "
                    "can run code when loaded: lm-zoo loads only the published ones"
                )
            files.append((file.stem, data))
    else:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest not in ARCHIVES:
            raise DataError(
                f"{path} is not one of the template archives lm-zoo knows (sha256 {digest[:12]}...), and the "
                f"pickles inside could run code when loaded: give {' or '.join(ARCHIVES.values())}"
            )
        with tarfile.open(path) as archive:
            for member in sorted((m for m in archive.getmembers() if m.isfile()), key=lambda m: m.name):
                if member.name.endswith(".pickle"):
                    extracted = archive.extractfile(member)
                    assert extracted is not None  # a regular file always has data
                    files.append((Path(member.name).stem, extracted.read()))
    if not files:
        raise DataError(f"{path} holds no template .pickle file")
    conditions: dict[str, list[tuple[str, ...]]] = {}
    for stem, data in files:
        for cases in _plain_load(data, stem).values():
            conditions.setdefault(condition_of(stem), []).extend(tuple(sentences) for sentences in cases)
    return conditions


# ------------------------------------------------------------------------------------------------------------ scoring
def sentence_log_probs(
    model: torch.nn.Module, tokenizer: Any, sentences: Sequence[str], batch_size: int = 256
) -> list[float]:
    """log p(sentence) in nats: each read from a zero state after ``<eos>`` (``<S>`` for GBW models), summed over its
    words and its end (``"."`` when the vocabulary has it, else ``<eos>``).

    Args:
        model: a word-level ``zoo.RecurrentLM``.
        tokenizer: its tokenizer; unknown words are read as ``<unk>``.
        sentences: space-separated words.
        batch_size: sentences per forward pass (padded at their ends, which earlier steps cannot see).
    """
    end = [tokenizer.index["."]] if "." in getattr(tokenizer, "index", {}) else [tokenizer.eos_id]
    scores = score_sentences(model, tokenizer, sentences, batch_size, end=end)
    return [score.logprob for score in scores]


@dataclass
class _Condition:
    """Counts of one condition."""

    tuples: int = 0
    with_unknown: int = 0
    comparisons: dict[str, list[int]] = field(default_factory=dict)  # kind -> [right, total, right_known, total_known]

    def add(self, kind: str, right: bool, known: bool) -> None:
        counts = self.comparisons.setdefault(kind, [0, 0, 0, 0])
        counts[0] += right
        counts[1] += 1
        counts[2] += right and known
        counts[3] += known


def evaluate_syneval(
    model: torch.nn.Module,
    tokenizer: Any,
    conditions: dict[str, list[tuple[str, ...]]],
    batch_size: int = 256,
    max_tuples: int | None = None,
) -> dict[str, Any]:
    """Accuracy per condition, as Marvin & Linzen report it, with lm-zoo's sentence log-probabilities.

    Args:
        model: a word-level ``zoo.RecurrentLM``.
        tokenizer: its tokenizer.
        conditions: :func:`read_templates`.
        batch_size: sentences per forward pass.
        max_tuples: score only the first ``max_tuples`` tuples of each condition (a quick look); ``None``: all.

    Returns:
        A JSON-ready dict: per condition, its name, tuples, tuples with an unknown word, and for each comparison the
        accuracy over all tuples and over those without unknown words; the overall accuracy over every comparison.
    """
    chosen = {name: cases[:max_tuples] if max_tuples else cases for name, cases in conditions.items()}
    # Sentences that differ only in words the model does not know read as the same ids (a quarter of some templates'
    # pairs on a PTB vocabulary): each reading is scored once, so such a pair ties exactly (and the grammatical one
    # is not "more probable") instead of being decided by float rounding, which moves with the batching.
    reading = {s: tuple(tokenizer.encode(s)) for cases in chosen.values() for case in cases for s in case}
    first_of = {}
    for sentence, ids in reading.items():
        first_of.setdefault(ids, sentence)
    scored = dict(zip(first_of, sentence_log_probs(model, tokenizer, list(first_of.values()), batch_size)))
    score = {sentence: scored[ids] for sentence, ids in reading.items()}
    counts: dict[str, _Condition] = {}
    for name, cases in chosen.items():
        condition = counts.setdefault(name, _Condition())
        for case in cases:
            known = not any(tokenizer.unknown(s) for s in case)
            condition.tuples += 1
            condition.with_unknown += not known
            if len(case) == 3:  # NPI: grammatical, intrusive licensor, no licensor
                grammatical, intrusive, ungrammatical = (score[s] for s in case)
                condition.add("grammatical > intrusive", grammatical > intrusive, known)
                condition.add("grammatical > ungrammatical", grammatical > ungrammatical, known)
                condition.add("intrusive > ungrammatical", intrusive > ungrammatical, known)
            else:
                condition.add("grammatical > ungrammatical", score[case[0]] > score[case[1]], known)
    order = [c for c in CONDITIONS if c in counts] + sorted(c for c in counts if c not in CONDITIONS)
    results, right, total = {}, 0, 0
    for name in order:
        condition = counts[name]
        headline = [kind for kind in condition.comparisons if kind.startswith("grammatical")]
        won = sum(condition.comparisons[kind][0] for kind in headline)
        compared = sum(condition.comparisons[kind][1] for kind in headline)
        right, total = right + won, total + compared
        results[name] = {
            "name": CONDITIONS.get(name, name),
            "tuples": condition.tuples,
            "tuples_with_unknown_words": condition.with_unknown,
            "accuracy": won / compared if compared else None,
            "comparisons": {
                kind: {
                    "accuracy": c[0] / c[1] if c[1] else None,
                    "accuracy_without_unknown_words": c[2] / c[3] if c[3] else None,
                    "pairs": c[1],
                }
                for kind, c in condition.comparisons.items()
            },
        }
    return {
        "conditions": results,
        "accuracy": right / total if total else None,
        "sentences_scored": len(first_of),
        "sentences": len(reading),
        "end_token": "." if "." in getattr(tokenizer, "index", {}) else "<eos>",
        "max_tuples": max_tuples,
        "scoring": "sum of log-probabilities from <eos>, words and end; the grammatical sentence must be more probable",
    }


def describe(result: dict[str, Any]) -> str:
    """``lm-zoo syneval``'s table: accuracy per condition, and how many tuples had words the model does not know."""
    lines = [f"{'condition':<52} {'acc':>6} {'known':>6} {'tuples':>7} {'unk':>6}"]
    for condition in result["conditions"].values():
        comparison = condition["comparisons"]["grammatical > ungrammatical"]
        known = comparison["accuracy_without_unknown_words"]
        lines.append(
            f"{condition['name']:<52} {condition['accuracy']:>6.3f} {'-' if known is None else f'{known:.3f}':>6} "
            f"{condition['tuples']:>7} {condition['tuples_with_unknown_words']:>6}"
        )
    lines.append(f"{'overall':<52} {result['accuracy']:>6.3f}")
    lines.append(
        "(acc: the grammatical sentence more probable, NPIs against both ungrammatical versions; known: the same on "
        "tuples without unknown words; unk: tuples with a word read as <unk>)"
    )
    return "\n".join(lines)
