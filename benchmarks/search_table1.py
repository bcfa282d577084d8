"""Jozefowicz, Zaremba & Sutskever 2015, Table 1 at CPU scale: the best next-step accuracy of ten architectures on
the search's tasks (arithmetic, XML; PTB with ``--tasks``), each after a small random hyperparameter search.

What is the paper's: the architectures (Tanh, LSTM, LSTM-f / -i / -o, LSTM-b, GRU, MUT1-3; names as in
``benchmarks/music_table.py``), the tasks and the training of the search (``search/tasks.py``: the
§3.7 grid, the §3.6 search schedule, the best validation next-step accuracy; on arithmetic, the accuracy on the answers,
as §3.5 describes the task).

What is scaled down: the tasks as ``configs/search/jozefowicz.yaml`` sizes them (parameter budgets, corpus sizes,
epochs), and ``--settings`` random settings per cell (the paper: a search of hundreds). Every architecture is trained
with the same settings (drawn once from ``--seed``), so the table compares cells, not luck. Results go to a new file
(``--out``, or ``benchmarks/results/search_table1-<time>.json``; see benchmarks/output.py) as each cell ends, every run
of a cell recorded; ``--resume`` continues a file, skipping the runs it holds (a larger ``--settings`` draws the same
first settings, so it trains only the new ones)::

    LM_ZOO_DATA=../shared/data python benchmarks/search_table1.py --settings 6
    python benchmarks/search_table1.py --table-only      # the table of the committed results (or --out)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import output  # noqa: E402
from benchmarks.music_table import ARCHITECTURES  # noqa: E402
from benchmarks.tuned_runs import ROOT  # noqa: E402

NAME = "search_table1"  # benchmarks/results/search_table1.json
# Table 1 of the paper, in the order of ARCHITECTURES.
PAPER = {
    "arithmetic": [0.29493, 0.89228, 0.29292, 0.75109, 0.86747, 0.90163, 0.89565, 0.92135, 0.89735, 0.90728],
    "xml": [0.32050, 0.42470, 0.23356, 0.41371, 0.42117, 0.44434, 0.45963, 0.47483, 0.47324, 0.46478],
    "ptb": [0.08782, 0.08912, 0.08808, 0.08662, 0.08933, 0.08952, 0.09069, 0.08968, 0.09036, 0.09161],
}


def run_cell(task: Any, name: str, settings: list[Any], earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``name`` on ``task`` with every setting (after those of ``earlier``, the cell as a file holds it); the
    best validation accuracy and its setting."""
    from search.tasks import train_candidate

    architecture, options = ARCHITECTURES[name]
    start = time.monotonic()
    runs = list(earlier["runs"]) if earlier else []
    for index, setting in enumerate(settings[len(runs) :], start=len(runs)):
        outcome = train_candidate(architecture, options, task, setting, seed=index)
        runs.append({"setting": setting.key(), **outcome.record()})
    best = max(runs, key=lambda r: r["accuracy"])
    return {
        "task": task.name,
        "architecture": name,
        "zoo_architecture": architecture,
        "cell_options": options,
        "accuracy": best["accuracy"],
        "best_setting": best["setting"],
        "hidden_size": best["hidden_size"],
        "parameters": best["parameters"],
        "settings": len(runs),
        "runs": runs,
        "paper": PAPER[task.name][list(ARCHITECTURES).index(name)],
        "seconds": round(time.monotonic() - start + (earlier["seconds"] if earlier else 0.0), 1),
    }


def table(results: dict[str, dict[str, Any]], tasks: list[str]) -> str:
    """Markdown: per task, ours (best validation accuracy) and the paper's."""
    names = list(ARCHITECTURES)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for task in tasks:
        ours = [results.get(f"{task}/{name}") for name in names]
        lines.append(
            f"| {task} (lm-zoo) | " + " | ".join("-" if r is None else f"{r['accuracy']:.4f}" for r in ours) + " |"
        )
        lines.append(f"| {task} (paper) | " + " | ".join(f"{v:.4f}" for v in PAPER[task]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "search" / "jozefowicz.yaml")
    parser.add_argument("--tasks", nargs="+", default=["arithmetic", "xml"])
    parser.add_argument("--architectures", nargs="+", choices=list(ARCHITECTURES), default=list(ARCHITECTURES))
    parser.add_argument("--settings", type=int, default=6, help="random settings per cell (the same for every cell)")
    parser.add_argument("--seed", type=int, default=0)
    output.add_arguments(parser, NAME)
    parser.add_argument("--table-only", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args(argv)

    path = output.table_path(args, NAME) if args.table_only else output.output_path(args, NAME)
    results: dict[str, dict[str, Any]] = output.read(path)
    if not args.table_only:
        from search.evolution import load_config

        config = load_config(args.config)
        for name in args.tasks:
            task = config.task(name)
            rng = random.Random(args.seed)
            settings = [config.grid.draw(rng, task.num_params) for _ in range(args.settings)]
            for architecture in args.architectures:
                key = f"{name}/{architecture}"
                earlier = results.get(key)  # --resume
                if earlier is not None:
                    done = [run["setting"] for run in earlier["runs"]]
                    drawn = [setting.key() for setting in settings]
                    if done[: len(drawn)] != drawn[: len(done)]:
                        output.fail(
                            f"--resume: cell {key} of {path} was trained with other settings ({done[0]}, ...) than "
                            f"--seed {args.seed} and {args.config} draw: resume with its settings or start a new file"
                        )
                    if len(done) >= len(drawn):
                        continue
                results[key] = r = run_cell(task, architecture, settings, earlier)
                print(
                    f"{key}: {r['accuracy']:.4f} (paper {r['paper']:.4f}), {r['parameters']:,} parameters, "
                    f"{r['settings']} settings, {r['seconds']:.0f} s",
                    flush=True,
                )
                output.write(path, results)
        print(f"results: {path}")
    print(table(results, [t for t in PAPER if any(key.startswith(f"{t}/") for key in results)]))


if __name__ == "__main__":
    main()
