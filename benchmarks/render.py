"""Render the tables of README.md and docs/ from the stored results, so that no figure there is typed by hand.

A rendered block in a Markdown file sits between two markers naming its renderer::

    <!-- rendered: reverse-copy (python benchmarks/render.py; do not edit by hand) -->
    | length | ... |
    <!-- /rendered: reverse-copy -->

Each renderer reads one results file: a JSON under ``benchmarks/results/`` written by the command that measured it
(named in the table's caption), or ``checkpoints/registry.json`` for the shipped models. ``python benchmarks/render.py``
rewrites every block; ``--check`` only reports the stale ones (``tests/test_docs.py`` runs the same check, so a block
that drifts from its results file fails the suite).

Usage::

    python benchmarks/render.py            # rewrite every block in README.md and docs/*.md
    python benchmarks/render.py --check    # exit 1 and name the blocks that differ
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(
    r"<!-- rendered: (?P<name>[\w-]+)(?P<note>[^>]*)-->\n(?P<body>.*?)\n?<!-- /rendered: (?P=name) -->", re.S
)

MODES = ("bf16", "fp16")  # benchmarks/autocast_dtypes.py
# The architectures' column order in Jozefowicz et al. 2015's Tables 1 and 2.
JOZEFOWICZ_COLUMNS = ["Tanh", "LSTM", "LSTM-f", "LSTM-i", "LSTM-o", "LSTM-b", "GRU", "MUT1", "MUT2", "MUT3"]


def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _bold_best(values: list[float], text: list[str], best: Callable[[list[float]], float]) -> list[str]:
    """``text`` with the entry of the best value (``min`` or ``max``) in bold."""
    target = best(values)
    return [f"**{t}**" if v == target else t for v, t in zip(values, text, strict=True)]


def ratio_cell(medians: float, per_round: Sequence[float], unit: str = "×") -> str:
    """A measured ratio of two sides as every page states it: the ratio of the medians, then the range of the ratios
    within each round (whose two sides ran side by side). Where that range spans 1 the rounds do not tell the sides
    apart, and the cell says so first, so that no page states such a ratio as a gain or a loss.

    Args:
        medians: the ratio of the two sides' medians.
        per_round: the same ratio within each round.
        unit: what follows each figure (``×``, ``× the time``).
    """
    low, high = min(per_round), max(per_round)
    text = f"{medians:.2f}{unit} (rounds {low:.2f}-{high:.2f})"
    return f"no difference measured: {text}" if low <= 1 <= high else text


def _paired(top: Sequence[float], bottom: Sequence[float]) -> list[float]:
    """Round by round ratios ``top[i] / bottom[i]`` of two sides measured in alternated rounds."""
    return [a / b for a, b in zip(top, bottom, strict=True)]


def _trials_note(trials: dict[str, int]) -> str:
    """One line saying how many trials each cell holds: every cell the same, or the counts that differ."""
    counts = sorted(set(trials.values()))
    if len(counts) == 1:
        return f"Trials per cell: {counts[0]} (every cell)."
    listed = ", ".join(f"{cell} {n}" for cell, n in trials.items())
    return f"Trials per cell: {listed}."


def _cell_trials(cell: dict) -> int:
    """The trials a cell's study finished (``trials_run``, recorded since the count was made exact), else requested."""
    return int(cell.get("trials_run", cell["trials"]))


def reverse_copy() -> str:
    """Melis et al. 2020 Figure 4 at CPU scale (``benchmarks/reverse_copy.py``): test loss per length and model."""
    cells = _load("reverse_copy.json")
    lengths = sorted({cell["length"] for cell in cells.values()})
    lstm, mog = cells[f"{lengths[0]}/LSTM"], cells[f"{lengths[0]}/Mogrifier"]
    lines = [
        _row(
            [
                "length",
                f"LSTM (1 × {lstm['hidden_size']}, {lstm['parameters']:,} parameters)",
                f"Mogrifier (1 × {mog['hidden_size']}, {mog['parameters']:,} parameters)",
                "Mogrifier − LSTM",
            ]
        ),
        "|---:|---:|---:|---:|",
    ]
    for length in lengths:
        a, b = cells[f"{length}/LSTM"]["test_loss"], cells[f"{length}/Mogrifier"]["test_loss"]
        lines.append(_row([length, f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}".replace("-", "−")]))
    lines += ["", _trials_note({key: _cell_trials(cell) for key, cell in cells.items()})]
    return "\n".join(lines)


def _against_paper(
    cells: dict[str, dict], group: str, metric: str, digits: int, best: Callable, difference: bool = False
) -> list[str]:
    """A Jozefowicz et al. 2015 table: a column per architecture, and per ``group`` (a row or task of the paper's
    table) lm-zoo's ``metric`` (the best in bold), the paper's, and with ``difference`` lm-zoo's minus the paper's."""
    groups = list(dict.fromkeys(cell[group] for cell in cells.values()))
    lines = [_row(["", *JOZEFOWICZ_COLUMNS]), "|---" * (len(JOZEFOWICZ_COLUMNS) + 1) + "|"]
    for name in groups:
        ours = [cells[f"{name}/{arch}"][metric] for arch in JOZEFOWICZ_COLUMNS]
        paper = [cells[f"{name}/{arch}"]["paper"] for arch in JOZEFOWICZ_COLUMNS]
        lines.append(_row([f"{name} (lm-zoo)", *_bold_best(ours, [f"{v:.{digits}f}" for v in ours], best)]))
        lines.append(_row([f"{name} (paper)", *[f"{v:.{digits}f}" for v in paper]]))
        if difference:
            gaps = [f"{o - p:+.{digits}f}" for o, p in zip(ours, paper, strict=True)]
            lines.append(_row([f"{name}: lm-zoo − paper", *gaps]))
    return lines


def music_table() -> str:
    """Jozefowicz et al. 2015 Table 2 at CPU scale (``benchmarks/music_table.py``): test NLL per frame."""
    cells = _load("music_table.json")
    rows = list(dict.fromkeys(cell["row"] for cell in cells.values()))
    lines = _against_paper(cells, "row", "test_nll", 3, min, difference=True)
    minutes = {row: sum(c["tune_seconds"] for c in cells.values() if c["row"] == row) / 60 for row in rows}
    spent = ", ".join(f"{row} {m:.1f}" for row, m in minutes.items())
    lines += [
        "",
        _trials_note({key: _cell_trials(cell) for key, cell in cells.items()}),
        f"Tuning time per row, summed over its cells (minutes): {spent}.",
    ]
    return "\n".join(lines)


def search_table1() -> str:
    """Jozefowicz et al. 2015 Table 1 at CPU scale (``benchmarks/search_table1.py``): best next-step accuracy."""
    cells = _load("search_table1.json")
    lines = _against_paper(cells, "task", "accuracy", 4, max)
    settings = sorted({cell["settings"] for cell in cells.values()})
    minutes = sum(cell["seconds"] for cell in cells.values()) / 60
    lines += [
        "",
        f"Settings per cell: {', '.join(map(str, settings))}; training time summed over the cells: {minutes:.0f} min.",
    ]
    return "\n".join(lines)


def score_throughput() -> str:
    """``benchmarks/score_throughput.py``: sentences scored per second by ``lm-zoo score`` at each batch size."""
    result = _load("score_throughput.json")
    lines = [
        f"`{result['command']}` ({result['machine']}; {result['sentences']:,} sentences, {result['tokens']:,} tokens):",
        "",
        "| batch size | sentences/s | tokens/s | largest log-probability difference from batch 1 |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            _row(
                [
                    row["batch_size"],
                    f"{row['sentences_per_s']:,.0f}",
                    f"{row['tokens_per_s']:,.0f}",
                    f"{row['largest_logprob_difference_from_batch_1']:.1e}",
                ]
            )
        )
    return "\n".join(lines)


PHRASES = ["NP", "VP", "PP", "ADJP", "SBAR"]  # the phrase types Shen et al. 2019 report recall for


def pct(fraction: float) -> str:
    """A fraction as a percentage to one decimal, as the papers give them."""
    return f"{100 * fraction:.1f}"


def parse() -> str:
    """``lm-zoo parse ptb-on-lstm --json``: sentence-level F1 per layer and recall per phrase type, with baselines."""
    result = _load("parse_ptb-on-lstm.json")
    lines = [
        f"`lm-zoo parse {result['source']} --json > benchmarks/results/parse_ptb-on-lstm.json`: F1 and recall in %.",
        "",
        _row(["tree", f"WSJ10 ({result['wsj10_sentences']:,})", f"all lengths ({result['sentences']:,})", *PHRASES]),
        "|---|---:|---:|" + "---:|" * len(PHRASES),
    ]
    layers = result["layers"]
    best = max(layer["f1_wsj10"] for layer in layers)
    for layer in layers:
        f1 = [pct(layer["f1_wsj10"]), pct(layer["f1_all"])]
        if layer["f1_wsj10"] == best:
            f1 = [f"**{value}**" for value in f1]
        recall = [pct(layer["recall"][phrase]) for phrase in PHRASES]
        lines.append(_row([f"`{result['source']}` layer {layer['layer']}", *f1, *recall]))
    for name, baseline in sorted(result["baselines"].items(), key=lambda item: -item[1]["f1_wsj10"]):
        label = name.replace("_", "-") + (f" (seed {result['random_seed']})" if name == "random" else "")
        lines.append(_row([label, pct(baseline["f1_wsj10"]), pct(baseline["f1_all"]), *[""] * len(PHRASES)]))
    counts = ", ".join(f"{phrase} {result['phrase_counts'][phrase]:,}" for phrase in PHRASES)
    lines += ["", f"Gold phrases of two words or more in the sample: {counts}."]
    return "\n".join(lines)


SYNEVAL_MODELS = ["ptb-on-lstm", "ptb-lstm-3x400"]  # the ON-LSTM and its LSTM twin: same size, recipe, epochs


def syneval() -> str:
    """``lm-zoo syneval NAME --json``, for the ON-LSTM and its LSTM twin: accuracy per condition, in %."""
    results = {name: _load(f"syneval_{name}.json") for name in SYNEVAL_MODELS}
    first = results[SYNEVAL_MODELS[0]]
    names = [f"`{name}`" for name in SYNEVAL_MODELS]
    lines = [
        "Commands: "
        + ", ".join(
            f"`lm-zoo syneval {name} --json > benchmarks/results/syneval_{name}.json`" for name in SYNEVAL_MODELS
        )
        + f"; {first['sentences']:,} sentences per model, {first['sentences_scored']:,} distinct once unknown words "
        "read as `<unk>`. Accuracy in %:",
        "",
        _row(
            [
                "condition",
                "tuples",
                "with an unknown word",
                *[f"{n} all" for n in names],
                *[f"{n} without unknown words" for n in names],
            ]
        ),
        "|---|---:|---:|" + "---:|" * (2 * len(names)),
    ]
    for key, condition in first["conditions"].items():
        rows = [results[name]["conditions"][key] for name in SYNEVAL_MODELS]
        known = [row["comparisons"]["grammatical > ungrammatical"]["accuracy_without_unknown_words"] for row in rows]
        lines.append(
            _row(
                [
                    condition["name"],
                    f"{condition['tuples']:,}",
                    f"{condition['tuples_with_unknown_words']:,}",
                    *[pct(row["accuracy"]) for row in rows],
                    *["—" if value is None else pct(value) for value in known],
                ]
            )
        )
    overall = [f"**{pct(results[name]['accuracy'])}**" for name in SYNEVAL_MODELS]
    lines.append(_row(["**overall**", "", "", *overall, *[""] * len(names)]))
    return "\n".join(lines)


# What the papers report for the recipe each shipped model scales down: citations, not measurements of ours.
PAPER_FIGURES = {
    "ptb-lstm-small": "Zaremba et al. 2014, small: valid 120.7, test 114.5",
    "ptb-lstm-medium": "Zaremba et al. 2014, medium (untied, 39 epochs): valid 86.2, test 82.7",
    "ptb-mogrifier-cpu": "Melis et al. 2020 Table 1, 24M parameters, tuned: test 51.0",
    "ptb-lstm-melis-cpu": "Melis et al. 2020 Table 1, LSTM at 24M parameters, tuned: test 54.6",
    "ptb-on-lstm": "Shen et al. 2019, 3 x 1150 for 1,000 epochs: test 56.17",
    "nottingham-gru": "Jozefowicz et al. 2015 Table 2, GRU on Nottingham: 3.410 NLL per frame",
}


def _registry_figure(result: dict) -> str:
    for metric, unit, digits in (("nll_per_step", "NLL/frame", 4), ("bpc", "bpc", 4), ("ppl", "ppl", 2)):
        if metric in result:
            return f"{result[metric]:.{digits}f} {unit}"
    raise KeyError(f"a result with no known metric: {sorted(result)}")


def models_vs_papers() -> str:
    """The shipped models (``checkpoints/registry.json``) beside what their papers report for the full recipe."""
    registry = json.loads((ROOT / "checkpoints" / "registry.json").read_text(encoding="utf-8"))["models"]
    lines = [
        "| model | valid | test | eval batch, BPTT | training (wall, tokens/s) | the paper's recipe reports |",
        "|---|---:|---:|---|---|---|",
    ]
    for name, entry in registry.items():
        valid, test, run = entry["results"]["valid"], entry["results"]["test"], entry["training"]
        lines.append(
            _row(
                [
                    f"[`{name}`](../pretrained/{name}/README.md)",
                    _registry_figure(valid),
                    _registry_figure(test),
                    f"{test['eval_batch_size']}, {test['bptt']}",
                    # A model carried on over several runs gives each run's minutes (its earlier runs stored with it).
                    " + ".join(f"{r['wall_time_s'] / 60:.0f}" for r in [*run.get("earlier_runs", []), run])
                    + f" min, {run['tokens_per_s']:,.0f}",
                    PAPER_FIGURES.get(name, "—"),
                ]
            )
        )
    return "\n".join(lines)


def mogrifier_pair() -> str:
    """The shipped PTB pair that puts Melis et al. 2020's claim to CPU scale: the same recipe, Mogrifier and LSTM."""
    registry = json.loads((ROOT / "checkpoints" / "registry.json").read_text(encoding="utf-8"))["models"]
    lines = [
        "| model | command | parameters | wall time, tokens/s | valid / test ppl | eval batch, BPTT |",
        "|---|---|---:|---|---:|---|",
    ]
    for name in ("ptb-mogrifier-cpu", "ptb-lstm-melis-cpu"):
        entry = registry[name]
        valid, test, run = entry["results"]["valid"], entry["results"]["test"], entry["training"]
        lines.append(
            _row(
                [
                    f"`{name}`",
                    f"`{run['command']}`",
                    f"{entry['num_parameters']:,}",
                    f"{run['wall_time_s'] / 60:.1f} min, {run['tokens_per_s']:,.0f}",
                    f"{valid['ppl']:.2f} / {test['ppl']:.2f}",
                    f"{test['eval_batch_size']}, {test['bptt']}",
                ]
            )
        )
    return "\n".join(lines)


def corpora() -> str:
    """Every dataset lm-zoo downloads or reads, with the canonical URL and sha256 that its code checks."""
    from datamodules.corpora import CORPORA
    from datamodules.gbw import GBW_SHA256, GBW_URL, HELDOUT_DIR, TRAIN_DIR
    from datamodules.piano_rolls import MUSIC_DATASETS
    from evaluation.parsing import TREEBANK_SHA256, TREEBANK_URL
    from evaluation.syneval import ARCHIVES, TEMPLATES_SOURCE

    lines = ["| name | file under `$LM_ZOO_DATA` | level | downloaded from | sha256 |", "|---|---|---|---|---|"]
    specs = [*CORPORA.values(), *MUSIC_DATASETS.values()]
    for spec in specs:
        level = getattr(spec, "level", "piano roll")
        for remote in spec.files:
            source = f"{remote.url}" + (f" (member `{remote.member}`)" if remote.member else "")
            digest = f"`{remote.sha256}`" if remote.sha256 else "none published: only presence is checked"
            lines.append(_row([f"`{spec.name}`", f"`{spec.directory}/{remote.name}`", level, source, digest]))
    lines.append(
        _row(
            [
                "`gbw`",
                f"`gbw/{TRAIN_DIR}/`, `gbw/{HELDOUT_DIR}/`",
                "word",
                f"{GBW_URL} (not downloaded: unpack it there)",
                f"`{GBW_SHA256}` (the archive)",
            ]
        )
    )
    lines.append(
        _row(
            [
                "`gbw-sample`",
                "`gbw-sample/news.en.heldout-000{10,11,12,13}-of-00050`",
                "word",
                "held-out shards 10-13 of the same archive (train, train, valid, test)",
                "the archive's",
            ]
        )
    )
    lines.append(
        _row(
            [
                "treebank (for `lm-zoo parse`)",
                "`treebank/treebank.zip`",
                "parse trees",
                f"{TREEBANK_URL} (not downloaded: put it there)",
                f"`{TREEBANK_SHA256}`",
            ]
        )
    )
    for digest, archive in ARCHIVES.items():
        lines.append(
            _row(
                [
                    "templates (for `lm-zoo syneval`)",
                    f"`syneval/{archive}`",
                    "sentence tuples",
                    f"{TEMPLATES_SOURCE}, repacked unchanged as tar.xz (or pass its pickle directory)",
                    f"`{digest}`",
                ]
            )
        )
    return "\n".join(lines)


def fit_overhead(name: str = "fit_overhead.json") -> str:
    """``benchmarks/fit_overhead.py``: ``lm-zoo fit`` against a plain PyTorch loop, with and without lm-zoo's malloc
    settings on each side, so that the like-for-like ratios stand beside the as-installed one; each side's time a step
    and what each ratio's top side costs more a step (files written before those sides or columns show what they
    hold)."""
    result = _load(name)
    settings = result["settings"]
    load = [round(max(*entry["before"][:1], *entry["after"][:1]), 1) for entry in result["load_average"]]
    text = {"ptb": "PTB", "ptb-char": "PTB's characters"}[settings.get("corpus", "ptb")]
    tokens_per_step = settings["batch"] * settings["bptt"]
    step_ms = {side: tokens_per_step / tokens * 1e3 for side, tokens in result["median_tokens_per_s"].items()}
    windows = settings.get("windows_per_step")  # files measured before the side with several windows a step lack it
    several = any(side.endswith("several windows a step") for side in step_ms)
    grouped = f"; {windows} windows a step on the side with several, its ms a step per window" if several else ""
    lines = [
        f"`{'`, then `'.join(result['commands'])}` (the 2 x {settings.get('width', 200)} LSTM on {text} at batch "
        f"{settings['batch']}, BPTT {settings['bptt']}, {settings['steps']} timed steps per round, "
        f"{len(result['rounds'])} rounds, {settings['threads']} threads, torch {settings['torch']}{grouped}; highest "
        f"1-minute load average around the rounds: {max(load)}):",
        "",
        "| side | tokens/s (median) | ms a step | peak RSS |",
        "|---|---:|---:|---:|",
    ]
    for side, tokens in result["median_tokens_per_s"].items():
        rss = result["median_peak_rss_bytes"][side] / 2**20
        lines.append(_row([side, f"{tokens:,.0f}", f"{step_ms[side]:.3f}", f"{rss:,.0f} MiB"]))
    lines += [
        "",
        "| ratio | what it measures | tokens/s (of the medians) | within each round: median (range) | ms a step more "
        "| peak RSS |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for ratio in result["ratios"]:
        top, bottom = ratio["sides"].split(" / ")
        # The two sides of a round ran minutes apart; the medians' ratio also compares sides of different rounds.
        paired = [r[top]["tokens_per_s"] / r[bottom]["tokens_per_s"] for r in result["rounds"]]
        within = ratio_cell(statistics.median(paired), paired, unit="")
        more = f"{step_ms[top] - step_ms[bottom]:+.3f}"
        medians = f"{ratio['tokens_per_s']:.2f}"
        lines.append(_row([ratio["sides"], ratio["what"], medians, within, more, f"{ratio['peak_rss']:.2f}"]))
    return "\n".join(lines)


def fit_overhead_cuda(name: str) -> str:
    """``benchmarks/fit_overhead.py --device cuda``: the same sides on one GPU, with what measured them."""
    return "\n".join([fit_overhead(name), "", gpu_provenance(name)])


def generate_speed_cuda() -> str:
    """``benchmarks/generate_speed.py --device cuda``: tokens/s of ``generate`` (the captured device path and the plain
    path) against a plain ``nn.LSTM`` sampling loop, the median of the rounds with their range."""
    name = "generate_speed_cuda.json"
    result = _load(name)
    settings = result["settings"]
    plain = result["median_tokens_per_s"]["plain nn.LSTM loop"]
    lines = [
        f"`{result['command']}` ({settings['layers']} x {settings['width']} units, a {settings['vocab']:,}-word "
        f"softmax, {settings['tokens']:,} tokens at batch {result['batch']}, {settings['rounds']} rounds):",
        "",
        "| side | tokens/s (median, rounds' range) | x the plain loop |",
        "|---|---:|---:|",
    ]
    for side, rounds in result["tokens_per_s"].items():
        median = result["median_tokens_per_s"][side]
        lines.append(_row([side, f"{median:,.0f} ({min(rounds):,.0f}-{max(rounds):,.0f})", f"{median / plain:.2f}"]))
    return "\n".join([*lines, "", gpu_provenance(name)])


def side_by_side() -> str:
    """``benchmarks/side_by_side.py``: two fits started together on one machine, each one's speed against one alone,
    with lm-zoo's thread sharing and with the threads fixed at the cores."""
    result = _load("side_by_side.json")
    settings = result["settings"]
    lines = [
        f"`{result['command']}` ({result['cores']} cores, the 2 x {settings['width']} LSTM on PTB's characters, "
        f"{settings['steps']:,} timed steps a fit, {settings['fixed_steps']:,} for the pair with fixed threads; "
        f"{len(result['rounds'])} round(s)):",
        "",
        "| fits | steps/s (median; each fit of a pair) | the slower fit against one alone |",
        "|---|---:|---:|",
    ]
    alone = result["median_alone_steps_per_s"]
    for side in result["rounds"][0]:
        values = [r[side] for r in result["rounds"]]
        if isinstance(values[0], list):
            pairs = "; ".join(", ".join(f"{v:,.0f}" for v in pair) for pair in values)
            share = result["slower_of_the_pair_over_alone"][side]
            lines.append(_row([side, pairs, f"{share:.2f}x"]))
        else:
            lines.append(_row([side, f"{statistics.median(values):,.0f}", ""]))
    lines += ["", f"Measured at commit `{result['commit']}` on {result['hardware']['cpu']}; one alone: {alone:,.0f}."]
    return "\n".join(lines)


def fit_profile(rows: int = 10) -> str:
    """``benchmarks/fit_overhead.py --profile`` before and after the changes it guided: where a step of each
    like-for-like side goes, by cProfile's own time per step."""
    runs = {
        label: _load(name) for label, name in (("before", "fit_profile_before.json"), ("after", "fit_profile.json"))
    }
    lines = []
    for label, result in runs.items():
        sides = result["sides"]
        speeds = ", ".join(f"{side} {measured['tokens_per_s']:,.0f}" for side, measured in sides.items())
        lines += [
            f"{label.capitalize()}: `{result['commands'][-1]}` at {result['commit']}; tokens/s while profiled: "
            f"{speeds}.",
            "",
        ]
    lines += ["| lm-zoo fit, own time per step (ms) | before | after |", "|---|---:|---:|"]
    before, after = (
        {e["function"]: e["ms_per_step"] for e in r["sides"]["lm-zoo fit"]["profile"]} for r in runs.values()
    )
    python = "all Python functions (their own time)"
    ranked = [f for f in before if f != python][:rows]
    ranked += [f for f in after if f != python and f not in ranked][: max(0, rows + 3 - len(ranked))]
    for function in [*ranked, python]:
        cells = [f"{table[function]:.3f}" if function in table else "" for table in (before, after)]
        lines.append(_row([f"`{function}`" if function != python else function, *cells]))
    plain = [r["sides"]["plain loop, lm-zoo's malloc settings"]["profile"][-1]["ms_per_step"] for r in runs.values()]
    lines.append(_row(["the plain loop's Python functions, for comparison", *(f"{v:.3f}" for v in plain)]))
    return "\n".join(lines)


def quantize_int8() -> str:
    """``benchmarks/quantize.py``: float32 against ``--quantize int8`` and ``int8-head``, scoring and sampling at batch
    1, in one run."""
    result = _load("quantize_int8.json")
    lines = [
        f"`{result['command'].strip()}` ({result['machine']}, torch {result['torch']}, quantized engine "
        f"{result['quantized_engine']}; medians of {result.get('rounds', 1)} alternated rounds): scoring is the test "
        "split at eval batch 1; sampling is one stream.",
        "",
        "| model | `--quantize` | test ppl (change) | scoring tokens/s (× float32) | sampling tokens/s (× float32) |",
        "|---|---|---:|---:|---:|",
    ]
    registry = json.loads((ROOT / "checkpoints" / "registry.json").read_text(encoding="utf-8"))["models"]
    for row in result["rows"]:
        # A row measured on weights the registry no longer ships (a model published again since) says so.
        shipped = registry.get(row["model"], {}).get("results", {}).get("test", {})
        then = row["float32"]["scoring"]
        same = shipped.get("eval_batch_size") == 1 and abs(shipped.get("ppl", 0) - then["ppl"]) < 1e-6 * then["ppl"]
        model = f"`{row['model']}`" + ("" if same else " (an earlier revision than the one shipped)")
        for side in ("float32", "int8", "int8-head"):
            measured = row[side]
            change = f" ({100 * measured['ppl_change']:+.2f}%)" if "ppl_change" in measured else ""
            scoring, sampling = (
                f"; {_speedup(measured, row['float32'], what)}" if f"{what}_speedup" in measured else ""
                for what in ("scoring", "sampling")
            )
            lines.append(
                _row(
                    [
                        model,
                        "—" if side == "float32" else f"`{side}`",
                        f"{measured['scoring']['ppl']:.2f}{change}",
                        f"{measured['scoring']['tokens_per_s']:,.0f}{scoring}",
                        f"{measured['sampling']['tokens_per_s']:,.0f}{sampling}",
                    ]
                )
            )
    return "\n".join(lines)


def _speedup(measured: dict[str, Any], baseline: dict[str, Any], what: str) -> str:
    """A quantized side's ``what`` (scoring, sampling) speed-up over float32, with its rounds' range where the results
    file has the rounds (files written before ``--rounds`` hold one pass)."""
    rounds = [measured.get("rounds", {}).get(what), baseline.get("rounds", {}).get(what)]
    if not all(rounds):
        return f"{measured[f'{what}_speedup']:.2f}×"
    per_round = _paired([r["tokens_per_s"] for r in rounds[0]], [r["tokens_per_s"] for r in rounds[1]])
    return ratio_cell(measured[f"{what}_speedup"], per_round)


def allocator() -> str:
    """``benchmarks/allocator.py``: ``lm-zoo fit`` under glibc's defaults, the old mmap-threshold settings and lm-zoo's
    own, on PTB (logits under 32 MB) and WikiText-2 (over it)."""
    result = _load("allocator.json")
    settings = result["settings"]
    lines = [
        f"`{result['command']}` (2 x 200 LSTM, batch {settings['batch']} x {settings['bptt']}, {settings['threads']} "
        f"threads, {settings['steps']} timed steps per run; medians of {len(next(iter(result['rounds'].values())))} "
        "alternated rounds, each run a fresh process):",
        "",
        "| corpus | malloc settings | tokens/s | × glibc's defaults | peak RSS | system CPU per run |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for corpus, sides in result["medians"].items():
        base_side = next(iter(sides))
        base = sides[base_side]["tokens_per_s"]
        rounds = result["rounds"][corpus]
        for side, measured in sides.items():
            per_round = _paired(
                [r[side]["tokens_per_s"] for r in rounds], [r[base_side]["tokens_per_s"] for r in rounds]
            )
            lines.append(
                _row(
                    [
                        corpus,
                        side,
                        f"{measured['tokens_per_s']:,.0f}",
                        "1.00" if side == base_side else ratio_cell(measured["tokens_per_s"] / base, per_round, ""),
                        f"{measured['peak'] / 2**20:,.0f} MiB",
                        f"{measured['system_seconds']:.1f} s",
                    ]
                )
            )
    return "\n".join(lines)


def xml_nesting(file_name: str = "xml_nesting_synthetic-xml-lstm.json", generator: bool = True) -> str:
    """``benchmarks/xml_nesting.py``: a model's sampled closing tags by how far back their tag opened (and in all: the
    card's figure), and its bits per character of generated documents by what the character is; with ``generator``,
    what belongs to the task rather than the model after them: the paper's Table 1 figures for it, and how often
    truncated BPTT windows hold both a closing tag and the opening name it copies."""
    result = _load(file_name)
    lines = [
        f"`{result['command']}`: {result['samples']} samples of at most {result['max_tokens']} characters (seed "
        f"{result['seed']}, temperature {result['temperature']}), as the card counts them:",
        "",
        "| closing tag, characters since its tag opened | closing tags | closing the innermost open tag |",
        "|---|---:|---:|",
    ]
    for row in result["rows"]:
        share = f"{row['matched'] / row['closing_tags']:.1%}" if row["closing_tags"] else "—"
        lines.append(_row([row["span"], f"{row['closing_tags']:,}", f"{row['matched']:,} ({share})"]))
    closing, matched = sum(row["closing_tags"] for row in result["rows"]), sum(row["matched"] for row in result["rows"])
    lines.append(_row(["**in all**", f"{closing:,}", f"{matched:,} ({matched / closing:.1%})" if closing else "—"]))
    bits = result["bits"]
    lines += [
        "",
        f"Its bits on {result['documents']} fresh generator documents (seed {result['seed_documents']}), beside the "
        "generator's own (its exact next-character distribution: the fewest bits any model can spend), and the "
        "next-step accuracy of the paper's Table 1, the model's and the best possible (the generator's most likely "
        "character):",
        "",
        "| character | characters | bits each | the generator's | bits per character of the whole text | "
        "next-step accuracy | at best |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    everything = _all_roles(bits)
    for row in [*bits, everything]:
        lines.append(
            _row(
                [
                    row["role"],
                    f"{row['characters']:,}",
                    f"{row['bits_per_char']:.3f}",
                    f"{row['generator_bits_per_char']:.3f}",
                    f"{row['share']:.3f}",
                    f"{row['correct'] / row['characters']:.3f}",
                    f"{row['best_accuracy']:.3f}",
                ]
            )
        )
    if not generator:
        return "\n".join(lines)
    table1 = {
        cell["architecture"]: cell["paper"]
        for key, cell in _load("search_table1.json").items()
        if key.startswith("xml/")
    }
    low, high = min(table1, key=table1.__getitem__), max(table1, key=table1.__getitem__)
    lines += [
        "",
        f"The paper's Table 1 gives this task's next-step accuracy (in all) from {table1[low]:.4f} ({low}) to "
        f"{table1[high]:.4f} ({high}), {table1['LSTM-b']:.4f} for the LSTM with a forget-gate bias of 1 (the paper's "
        "figures, from `benchmarks/results/search_table1.json`; measured on the paper's own writing of the documents, "
        "which it prints without angle brackets, so the comparison is close, not exact).",
        "",
        "How often one training window holds both a closing tag of those documents and the opening name it copies "
        "(the chance over where the window boundaries fall; outside it, truncated BPTT cuts the gradient that would "
        "teach the model to keep the name that long):",
        "",
    ]
    windows = list(result["windows"][0]["within"])
    lines += [
        _row(["closing tag, characters since its tag opened", "closing tags", *(f"BPTT {w}" for w in windows)]),
        "|---|---:|" + "---:|" * len(windows),
    ]
    for row in result["windows"]:
        shares = ["—" if row["within"][w] is None else f"{row['within'][w]:.1%}" for w in windows]
        lines.append(_row([row["span"], f"{row['closing_tags']:,}", *shares]))
    return "\n".join(lines)


def _all_roles(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The **in all** row of :func:`xml_nesting`'s per-character table: each per-character figure weighted by the
    role's characters."""
    characters = sum(row["characters"] for row in rows)

    def mean(key: str) -> float:
        return sum(row[key] * row["characters"] for row in rows) / characters

    return {
        "role": "**in all**",
        "characters": characters,
        "bits_per_char": mean("bits_per_char"),
        "share": sum(row["share"] for row in rows),
        "generator_bits_per_char": mean("generator_bits_per_char"),
        "correct": sum(row["correct"] for row in rows),
        "best_accuracy": mean("best_accuracy"),
    }


def inference_overhead() -> str:
    """``benchmarks/inference_overhead.py``: ``lm-zoo evaluate`` (whole process) and ``RecurrentLM.generate`` against
    plain PyTorch loops over the same weights."""
    result = _load("inference_overhead.json")
    evaluation, generation = result["evaluation"], result["generation"]
    lines = [
        f"`{result['command'].strip()}` ({result['machine']}, torch {result['torch']}; `{result['model']}`):",
        "",
        "| what | plain loop | lm-zoo | lm-zoo / plain loop |",
        "|---|---:|---:|---:|",
    ]
    seconds, ppl = evaluation["median_seconds"], evaluation["ppl"]
    lines.append(
        _row(
            [
                "evaluation of the test split at batch 1, whole process (median seconds; perplexity)",
                f"{seconds['plain loop']:.2f} s; {ppl['plain loop']:.4f}",
                f"{seconds['lm-zoo evaluate']:.2f} s; {ppl['lm-zoo evaluate']:.4f}",
                ratio_cell(
                    evaluation["time_ratio"],
                    _paired(evaluation["seconds"]["lm-zoo evaluate"], evaluation["seconds"]["plain loop"]),
                    "× the time",
                ),
            ]
        )
    )
    rates = generation["median_tokens_per_s"]
    lines.append(
        _row(
            [
                f"sampling {generation['tokens']:,} tokens at batch 1 (median tokens/s)",
                f"{rates['plain loop']:,.0f}",
                f"{rates['RecurrentLM.generate']:,.0f}",
                ratio_cell(
                    generation["speed_ratio"],
                    _paired(
                        generation["tokens_per_s"]["RecurrentLM.generate"], generation["tokens_per_s"]["plain loop"]
                    ),
                    "× the speed",
                ),
            ]
        )
    )
    return "\n".join(lines)


def autocast_dtypes(results: str = "autocast_dtypes.json") -> str:
    """``benchmarks/autocast_dtypes.py``: the dtypes each architecture's layers computed their products in, per
    autocast mode and path, and the carried state's (``results``: the CPU's file, or ``autocast_dtypes_cuda.json``)."""
    result = _load(results)
    lines = [
        f"`{result['command'].strip()}` ({result['device']}, {result['machine']}, torch {result['torch']}): the dtypes "
        "the matrix products and fused kernels inside the layers ran in, on the fast path (no reset, no state "
        "dropout) / the per-step loop (state dropout and a reset mid-window); the carried state.",
        "",
        "| architecture | bf16 autocast | fp16 autocast | state |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        cells = [f"{row[mode]['fast path']['products']} / {row[mode]['per-step loop']['products']}" for mode in MODES]
        states = {path["state"] for mode in MODES for path in row[mode].values()}
        lines.append(_row([f"`{row['architecture']}`", *cells, " + ".join(sorted(states))]))
    if results in MEASURED_CODE:
        lines += ["", gpu_provenance(results)]
    return "\n".join(lines)


# The library code each CUDA results file measured: a commit that changes it after the file's own commit makes the
# result older than the code, and its page says so until the file is measured again.
MEASURED_CODE = {
    "cells_cuda.json": ("zoo",),
    "autocast_dtypes_cuda.json": ("zoo",),
    "host_syncs_cuda.json": ("zoo", "datamodules", "lightning_modules"),
    "fit_overhead_cuda.json": ("zoo", "datamodules", "lightning_modules", "checkpoints", "commands"),
    "fit_overhead_cuda_650.json": ("zoo", "datamodules", "lightning_modules", "checkpoints", "commands"),
    "generate_speed_cuda.json": ("zoo",),
}


def provenance_of(result: dict[str, Any]) -> dict[str, Any] | None:
    """What measured a CUDA result, wherever its script wrote it: a ``provenance`` entry of its own, one inside its
    ``settings`` (``fit_overhead.py``), or the same fields at the top level (``generate_speed.py``)."""
    found = result.get("provenance") or result.get("settings", {}).get("provenance")
    if found is None and {"commit", "device", "torch", "cuda"} <= result.keys():
        keys = ("commit", "device", "torch", "cuda", "cudnn", "packages")
        found = {key: result[key] for key in keys if key in result}
    return found


def _project_pins(root: Path = ROOT) -> dict[str, str]:
    """The versions the project asks for: pyproject's requirement of each core package, and the torch release the
    install pins (the Makefile's ``torch==X``, which the README gives too)."""
    from packaging.requirements import Requirement  # deferred: only the GPU results' pages need it

    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    pins = {}
    for line in re.findall(r'^\s*"([^"]+)"', block[1] if block else "", re.M):
        requirement = Requirement(line)
        pins[requirement.name.replace("-", "_").lower()] = str(requirement.specifier)
    torch_pin = re.search(r"torch==([\w.]+)", (root / "Makefile").read_text(encoding="utf-8"))
    if torch_pin:
        pins["torch"] = f"=={torch_pin[1]}"
    return pins


def _outside_pins(versions: dict[str, str | None]) -> list[str]:
    """``name version (the project: SPEC)`` for each recorded version its pin does not admit (a local build label
    such as ``+cu130`` aside)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    pins = _project_pins()
    outside = []
    for name, version in versions.items():
        spec = pins.get(name.replace("-", "_").lower())
        if version and spec and Version(version).public not in SpecifierSet(spec):
            outside.append(f"{name} {version} (the project: {spec})")
    return outside


def _changed_since(commit: str, paths: Sequence[str]) -> list[str] | None:
    """Which of ``paths`` a commit after ``commit`` changed (``[]``: none); ``None`` when this checkout's history does
    not hold ``commit``."""
    commit = commit.removesuffix("-dirty")
    known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    if known.returncode != 0:
        return None
    changed = subprocess.run(
        ["git", "diff", "--name-only", commit, "HEAD", "--", *paths], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    return [path for path in paths if any(name.startswith(f"{path}/") for name in changed)]


def gpu_provenance(name: str) -> str:
    """One paragraph under a CUDA result: what measured it (commit, device, torch and CUDA, the packages a training
    step goes through), whether those are outside the project's pins, and whether the code it measured has changed
    since (:data:`MEASURED_CODE`)."""
    provenance = provenance_of(_load(name))
    if provenance is None:
        return f"Which commit, torch and CUDA measured `{name}` is not recorded."
    packages = {key: value for key, value in provenance.get("packages", {}).items() if value}
    versions = ", ".join(f"{key} {value}" for key, value in packages.items())
    line = (
        f"Measured at commit `{provenance['commit']}` on {provenance['device']}: torch {provenance['torch']} (CUDA "
        f"{provenance['cuda']}, cuDNN {provenance['cudnn']}), {versions}"
    )
    recorded = f" (recorded {provenance['recorded']})" if provenance.get("recorded") else ""
    outside = _outside_pins({"torch": provenance["torch"], **packages})
    line += recorded + (f"; outside the project's pins: {', '.join(outside)}." if outside else ".")
    measured = MEASURED_CODE[name]
    changed = _changed_since(provenance["commit"], measured)
    if changed is None:
        line += " This checkout's history does not hold that commit, so whether the code changed since is unknown."
    elif changed:
        # Every measured path is named, not only those changed so far: the line stays as it is until measured again.
        where = ", ".join(f"`{path}/`" for path in measured)
        line += (
            f" **Older than the code it measured** ({where}), which has changed since; measure again with "
            "`bash benchmarks/gpu_session.sh` on a GPU."
        )
    return line


def host_syncs() -> str:
    """``benchmarks/host_syncs.py`` on the CPU (its counter of the calls that would wait for a GPU) beside the same
    fits on CUDA (CUDA's sync debug mode, which also sees the waits inside kernels): synchronisations per step."""
    on_cpu, on_cuda = _load("host_syncs.json"), _load("host_syncs_cuda.json")
    lines = [
        f"`{on_cpu['command']}` (torch {on_cpu['torch']}) and `{on_cuda['command']}` ({on_cuda['device']}, torch "
        f"{on_cuda['torch']}): synchronisations per step, each step of the fit in turn.",
        "",
        "| setting | training, counted on CPU | training, CUDA | validation, counted on CPU | validation, CUDA |",
        "|---|---|---|---|---|",
    ]
    cuda_rows = {row["setting"]: row for row in on_cuda["results"]}
    for row in on_cpu["results"]:
        other = cuda_rows.get(row["setting"])
        steps = [
            ", ".join(map(str, r[key])) if r else "not run"
            for key in ("train_per_step", "val_per_step")
            for r in (row, other)
        ]
        lines.append(_row([f"`{row['setting']}`", *steps]))
    lines += ["", gpu_provenance("host_syncs_cuda.json")]
    return "\n".join(lines)


def _cells_table(result: dict[str, Any], first_step: str) -> list[str]:
    """A ``benchmarks/cells.py`` result as its command, a sentence and a table: per model, tokens per second of a
    training step and the ratio to ``nn.LSTM`` of its depth per (batch, BPTT); ``first_step`` says what the first
    step's seconds hold, where they are recorded."""
    settings = list(dict.fromkeys((row["batch"], row["bptt"]) for row in result["results"]))
    timed_first = "first_step_s" in result["results"][0]
    lines = [
        f"`{result['command']}` ({result['device']}, torch {result['torch']}; {result['layers']} layers of "
        f"{result['hidden']} units): tokens per second of a training step (forward, backward, SGD update), and the "
        "ratio to `nn.LSTM` of the same depth" + (f"; the first step's seconds, {first_step}." if timed_first else "."),
        "",
        "| model | LSTM layers | "
        + " | ".join(
            f"batch {b} x BPTT {t}: tokens/s, x nn.LSTM" + (", first step" if timed_first else "") for b, t in settings
        )
        + " |",
        "|---|---:|" + "---:|" * len(settings),
    ]
    models = list(dict.fromkeys(row["model"] for row in result["results"]))
    by_key = {(row["model"], row["batch"], row["bptt"]): row for row in result["results"]}
    for model in models:
        rows = [by_key[(model, b, t)] for b, t in settings]
        cells = [
            f"{row['tokens_per_s']:,.0f}, {row['ratio_nn_lstm']:.2f}"
            + (f", {row['first_step_s']:.2f} s" if "first_step_s" in row else "")
            for row in rows
        ]
        lines.append(_row([f"`{model}`", rows[0]["lstm_layers"], *cells]))
    return lines


def cells_cuda() -> str:
    """``benchmarks/cells.py --device cuda``: each architecture's training throughput against cuDNN's ``nn.LSTM`` of
    its depth, per batch size."""
    result = _load("cells_cuda.json")
    lines = _cells_table(
        result,
        "which for a per-step cell include capturing its window as a CUDA graph (`(eager)`: the same cell with "
        "`LM_ZOO_WINDOW_GRAPHS=0`, the path before; `(loop)`: a fused layer's per-step path, captured)",
    )
    return "\n".join([*lines, "", gpu_provenance("cells_cuda.json")])


def cpu_provenance(result: dict[str, Any]) -> str:
    """One line under a CPU result: the commit, the machine, its threads and torch."""
    provenance = result.get("provenance") or {}
    return (
        f"Measured at commit `{provenance.get('commit', 'unrecorded')}` on {result['machine']} with "
        f"{result['threads']} threads, torch {result['torch']}."
    )


def cells_cpu() -> str:
    """``benchmarks/cells.py`` on the CPU: each architecture's training throughput against oneDNN's ``nn.LSTM`` of
    its depth, per batch size."""
    result = _load("cells.json")
    lines = _cells_table(result, "which hold its one-time costs (oneDNN's plans, first allocations)")
    return "\n".join([*lines, "", cpu_provenance(result)])


def mogrifier_loops() -> str:
    """``benchmarks/mogrifier_loops.py``: the Mogrifier's window loops in C++, as their Python twins, and as the twins
    compiled by inductor, per batch size."""
    result = _load("mogrifier_loops.json")
    settings = list(dict.fromkeys((row["batch"], row["bptt"]) for row in result["results"]))
    lines = [
        f"`{result['command']}` ({result['device']}, torch {result['torch']}; {result['layers']} layers of "
        f"{result['hidden']} units): ms per training step (forward, backward, SGD update), the ratios to `nn.LSTM` of "
        "the same depth and to the C++ loops, the first step's seconds (for inductor: compiling both loops), and the "
        "largest difference from the Python twins in the outputs and gradients of one small window.",
        "",
        "| model | "
        + " | ".join(f"batch {b} x BPTT {t}: ms, x nn.LSTM, x C++, first step" for b, t in settings)
        + " | largest difference |",
        "|---|" + "---:|" * (len(settings) + 1),
    ]
    by_key = {(row["model"], row["batch"], row["bptt"]): row for row in result["results"]}
    for model in dict.fromkeys(row["model"] for row in result["results"]):
        rows = [by_key[(model, b, t)] for b, t in settings]
        cells = [
            f"{row['step_ms']:,.0f}, {row['ratio_nn_lstm']:.2f}, "
            + ("-" if row["ratio_cpp"] is None else f"{row['ratio_cpp']:.2f}")
            + f", {row['first_step_s']:.1f} s"
            for row in rows
        ]
        difference = rows[0]["largest_difference"]
        lines.append(_row([f"`{model}`", *cells, "" if difference is None else f"{difference:.1e}"]))
    for name, error in result.get("failed", {}).items():
        lines += ["", f"The {name} loops failed on the small window: {error}"]
    return "\n".join([*lines, "", cpu_provenance(result)])


def search_run() -> str:
    """``lm-zoo search report --json`` of the search run whose store ``benchmarks/results/search_run.json`` reports:
    its rate, how far the mutants got, and the best cells against the LSTM and the GRU."""
    result = _load("search_run.json")
    proposed, memorised = result["architectures_proposed"], result["passed_memorisation"]
    share = f" ({pct(memorised / proposed)}%)" if proposed else ""
    lines = [
        f"`lm-zoo search report --json` ({result['workers']} workers, {result['searching_hours']:.2f} hours in which "
        f"an evaluation ran): {result['evaluations']:,} evaluations, {result['evaluations_per_hour']:,.0f} per hour; "
        f"{proposed:,} architectures proposed by mutation, {memorised:,} of them passed memorisation{share}, "
        f"{result['passed_every_task']:,} passed every task.",
        "",
    ]
    tasks = sorted({task for row in result["top"] for task in row["best"]} - {"memorise"})
    lines += [_row(["rank", "cell", "score", *tasks, "settings tried"]), "|---" * (len(tasks) + 4) + "|"]
    baselines = {"lstm": "LSTM", "gru_paper": "GRU"}
    shown = [row for row in result["top"] if row["rank"] <= 5 or row["name"] in baselines]
    for row in shown:
        cell = baselines.get(row["name"] or "", f"`{row['genome']}`")
        accuracies = [f"{row['best'][t]:.4f}" if t in row["best"] else "" for t in tasks]
        tried = sum(row["settings"].values())
        lines.append(_row([row["rank"], cell, f"{row['score']:.4f}", *accuracies, tried]))
    return "\n".join(lines)


RENDERERS: dict[str, Callable[[], str]] = {
    "search-run": search_run,
    "autocast-dtypes": autocast_dtypes,
    "autocast-dtypes-cuda": lambda: autocast_dtypes("autocast_dtypes_cuda.json"),
    "host-syncs": host_syncs,
    "cells-cuda": cells_cuda,
    "cells-cpu": cells_cpu,
    "mogrifier-loops": mogrifier_loops,
    "models-vs-papers": models_vs_papers,
    "mogrifier-pair": mogrifier_pair,
    "corpora": corpora,
    "reverse-copy": reverse_copy,
    "music-table": music_table,
    "search-table1": search_table1,
    "score-throughput": score_throughput,
    "parse": parse,
    "syneval": syneval,
    "fit-overhead": fit_overhead,
    "fit-overhead-tiny": lambda: fit_overhead("fit_overhead_tiny.json"),
    "fit-overhead-tiny-step": lambda: fit_overhead("fit_overhead_tiny_step.json"),
    "fit-overhead-tiny-windows": lambda: fit_overhead("fit_overhead_tiny_windows.json"),
    "side-by-side": side_by_side,
    "fit-overhead-cuda": lambda: fit_overhead_cuda("fit_overhead_cuda.json"),
    "fit-overhead-cuda-650": lambda: fit_overhead_cuda("fit_overhead_cuda_650.json"),
    "generate-speed-cuda": generate_speed_cuda,
    "fit-profile": fit_profile,
    "quantize-int8": quantize_int8,
    "inference-overhead": inference_overhead,
    "xml-nesting": xml_nesting,
    "xml-nesting-gpu": lambda: xml_nesting("xml_nesting_xml-lstm-gpu.json", generator=False),
    "xml-nesting-1024": lambda: xml_nesting("xml_nesting_xml-lstm-1024.json", generator=False),
    "xml-nesting-gpu-1024": lambda: xml_nesting("xml_nesting_xml-lstm-gpu-1024.json", generator=False),
    "allocator": allocator,
}


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown files whose blocks are rendered: the README and docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(text: str, path: Path | None = None) -> str:
    """``text`` with every rendered block replaced by what its renderer gives now.

    Raises:
        KeyError: a block names no known renderer.
    """

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise KeyError(f"{path or 'text'}: no renderer named {name!r} (known: {', '.join(RENDERERS)})")
        try:
            body = RENDERERS[name]()
        except FileNotFoundError as missing:  # the docs then say so instead of keeping a figure nothing backs
            body = f"No stored result yet: `{Path(missing.filename).relative_to(ROOT)}` is absent."
        return f"<!-- rendered: {name}{match['note']}-->\n{body}\n<!-- /rendered: {name} -->"

    return BLOCK.sub(replace, text)


def stale_blocks(root: Path = ROOT) -> list[str]:
    """``file: block`` for every rendered block that differs from what its results file gives now."""
    stale = []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            if render(match[0], path) != match[0]:
                stale.append(f"{path.relative_to(root)}: {match['name']}")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks and exit 1; change nothing")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_blocks()
        for block in stale:
            print(f"stale: {block} (run python benchmarks/render.py)")
        return 1 if stale else 0
    for path in documents():
        text = path.read_text(encoding="utf-8")
        rendered = render(text, path)
        if rendered != text:
            path.write_text(rendered, encoding="utf-8")
            print(f"rendered {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
