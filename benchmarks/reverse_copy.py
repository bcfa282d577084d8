"""Melis et al. 2020, Figure 4 at CPU scale: cross-entropy against sequence length on the reverse-copy task (§4.3),
the LSTM against the Mogrifier at the same parameter count.

What is the paper's:
- the task: tokens drawn i.i.d. and uniformly, a marker, the tokens reversed; cross-entropy on the reversed part
  (``datamodules/reverse_copy.py``);
- both models at one parameter budget, the hidden size solved from it per architecture;
- no dropout; the learning rate tuned per model (the paper also tuned the l2 penalty and the embedding size, and the
  Mogrifier's r and k);
- the measure: test cross-entropy per answer token (nats) against the length.

What is scaled down to fit a 2-core CPU, and the results file says so:
- 100 symbols instead of 1,000, lengths from 10 instead of 50-200, ``--train-examples`` (20,000) instead of 500,000
  and ``--epochs`` passes over them, about 0.36M parameters instead of 10M;
- one stack reads source and answer (the paper: an encoder and a decoder that starts from the encoder's last state);
- ``--trials`` learning rates per cell through ``lm-zoo tune`` (the first is the config's, 0.003), best by validation;
  r = 5 and k = 16 fixed (configs/synthetic/reverse-copy-mogrifier.yaml).

Each (length, architecture) cell is an ``lm-zoo tune`` study under ``--workdir`` (default: runs/reverse-copy/ and
the results file's name) with ``--trials`` trials in all. Results go to a new file (``--out``, or
``benchmarks/results/reverse_copy-<time>.json``; see benchmarks/output.py) as each cell ends, each cell with the trials
its study holds, and every cell is trained afresh; ``--resume`` continues a file instead, skipping the cells whose
study already has ``--trials`` trials (a cell with fewer is topped up when its study is still under ``--workdir``, else
searched afresh). ``--plot`` draws the figure (default: beside the results file)::

    python benchmarks/reverse_copy.py --lengths 10 20 30 40 --trials 2 --epochs 6
    python benchmarks/reverse_copy.py --table-only       # the table and the plot of the committed results (or --out)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import output  # noqa: E402
from benchmarks.tuned_runs import ROOT, check_fresh, relative, tune_cell  # noqa: E402
from zoo import units_for_budget  # noqa: E402

CONFIGS = {
    "LSTM": ROOT / "configs" / "synthetic" / "reverse-copy-lstm.yaml",
    "Mogrifier": ROOT / "configs" / "synthetic" / "reverse-copy-mogrifier.yaml",
}
COLOURS = {"LSTM": (31, 119, 180), "Mogrifier": (214, 39, 40)}
NAME = "reverse_copy"  # benchmarks/results/reverse_copy.json
LEARNING_RATES = {"low": 1e-3, "high": 1e-2}  # log-uniform; the paper's ranges are not in its text


def parameters(model: dict[str, Any], num_symbols: int, hidden_size: int) -> int:
    """Parameters of the config's network at ``hidden_size`` units, for a task over ``num_symbols``."""
    from datamodules.reverse_copy import reverse_copy_tokenizer
    from zoo import RecurrentLM

    vocab_size = reverse_copy_tokenizer(num_symbols).vocab_size
    settings = {k: v for k, v in model.items() if k in ("architecture", "embedding_size", "num_layers", "cell_options")}
    return RecurrentLM(vocab_size=vocab_size, hidden_size=hidden_size, **settings).num_parameters()


def cell_config(name: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    """The full ``lm-zoo fit`` config of one cell: the architecture's recipe at this length, sized to the budget."""
    from commands.tune import full_config
    from lightning_modules.tuning import set_key

    config = full_config(CONFIGS[name])
    model = config["model"]["init_args"]
    hidden = units_for_budget(lambda units: parameters(model, args.num_symbols, units), args.params)
    settings = {
        "data.init_args.num_symbols": args.num_symbols,
        "data.init_args.min_length": length,
        "data.init_args.max_length": length,
        "data.init_args.train_examples": args.train_examples,
        "data.init_args.eval_examples": args.eval_examples,
        "model.init_args.hidden_size": hidden,
        "trainer.max_epochs": args.epochs,
        "trainer.default_root_dir": str(args.workdir / f"{length}-{name}"),
        "trainer.enable_progress_bar": False,
    }
    for key, value in settings.items():
        set_key(config, key, value)
    return config


def test_cross_entropy(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's test cross-entropy per answer token (every example from a zero state)."""
    from checkpoints import load
    from evaluation.perplexity import evaluate

    loaded = load(str(checkpoint))
    return evaluate(loaded.model, loaded.datamodule(), "test")


def run_cell(name: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    """Tune one (length, architecture) cell and score its best trial on the test split."""
    config = cell_config(name, length, args)
    space = {"optimizer.init_args.lr": {"type": "loguniform", **LEARNING_RATES}}
    cell = args.workdir / f"{length}-{name}"
    best, checkpoint, seconds, counts = tune_cell(cell, f"{length}-{name}", config, space, args.trials, args.jobs)
    result = test_cross_entropy(checkpoint)
    model = config["model"]["init_args"]
    return {
        "architecture": name,
        "length": length,
        "hidden_size": model["hidden_size"],
        "embedding_size": model["embedding_size"],
        "cell_options": model.get("cell_options") or {},
        "parameters": parameters(model, args.num_symbols, model["hidden_size"]),
        **settings(args),
        "trials": args.trials,  # asked for; what the study holds:
        **counts,
        "best_trial": best.number,
        "best_params": best.params,
        "valid_loss": best.value,
        "test_loss": result.loss,
        "test_tokens": result.tokens,
        "tune_seconds": round(seconds, 1),
        "checkpoint": relative(checkpoint),
    }


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a cell's figure depends on besides its length and architecture (``--resume`` holds a file to them)."""
    return {
        "params_budget": args.params,
        "num_symbols": args.num_symbols,
        "train_examples": args.train_examples,
        "eval_examples": args.eval_examples,
        "epochs": args.epochs,
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: test cross-entropy (nats per answer token) per length, LSTM and Mogrifier, and their difference."""
    lengths = sorted({r["length"] for r in results.values()})
    lines = ["| length | " + " | ".join(CONFIGS) + " | Mogrifier - LSTM |", "|---" * (len(CONFIGS) + 2) + "|"]
    for length in lengths:
        cells = [results.get(f"{length}/{name}") for name in CONFIGS]
        figures = ["-" if r is None else f"{r['test_loss']:.4f}" for r in cells]
        gap = "-" if None in cells else f"{cells[1]['test_loss'] - cells[0]['test_loss']:+.4f}"  # type: ignore[index]
        lines.append(f"| {length} | " + " | ".join(figures) + f" | {gap} |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], out: Path) -> Path:
    """Figure 4's shape: test cross-entropy against length, one line per architecture."""
    from release.curves import render_panels

    series = [
        (
            sorted((r["length"], r["test_loss"]) for r in results.values() if r["architecture"] == name),
            COLOURS[name],
            name,
        )
        for name in CONFIGS
    ]
    title = "reverse copy (Melis et al. 2020 Fig. 4 at CPU scale): test cross-entropy per answer token"
    return render_panels([("cross-entropy (nats)", "sequence length", series)], out, title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[10, 20, 30, 40])
    parser.add_argument("--architectures", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--num-symbols", type=int, default=100, help="vocabulary of the examples (paper: 1000)")
    parser.add_argument("--params", type=int, default=363_000, help="parameter budget per model (paper: 10M)")
    parser.add_argument("--train-examples", type=int, default=20_000, help="paper: 500,000")
    parser.add_argument("--eval-examples", type=int, default=1_000, help="validation and test each; paper: 10,000")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--trials", type=int, default=1, help="learning rates per cell (the first: the config's)")
    parser.add_argument("--jobs", type=int, default=1, help="trials side by side (lm-zoo tune --jobs)")
    parser.add_argument(
        "--workdir", type=Path, help="the cells' studies (default: runs/reverse-copy/<the results file's name>)"
    )
    output.add_arguments(parser, NAME)
    parser.add_argument("--plot", type=Path, help="the figure (default: the results file's name with .png)")
    parser.add_argument("--table-only", action="store_true", help="print the table of --out, plot it, stop")
    args = parser.parse_args(argv)

    path = output.table_path(args, NAME) if args.table_only else output.output_path(args, NAME)
    results: dict[str, dict[str, Any]] = output.read(path)
    if not args.table_only:
        args.workdir = args.workdir or ROOT / "runs" / "reverse-copy" / path.stem
        if not args.resume:
            check_fresh([args.workdir / f"{length}-{name}" for length in args.lengths for name in args.architectures])
        for length in args.lengths:
            for name in args.architectures:
                key = f"{length}/{name}"
                if key in results:  # --resume
                    output.check_same(f"cell {key}", results[key], settings(args), path)
                    if results[key].get("trials_run", 0) >= args.trials:
                        continue
                results[key] = r = run_cell(name, length, args)
                print(
                    f"{key}: test {r['test_loss']:.4f} nats, valid {r['valid_loss']:.4f}, {r['hidden_size']} units, "
                    f"{r['parameters']:,} parameters, {r['trials_run']} trials, {r['tune_seconds']:.0f} s",
                    flush=True,
                )
                output.write(path, results)
        print(f"results: {path}")
    print(table(results))
    if results:
        print(f"plot: {plot(results, args.plot or path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
