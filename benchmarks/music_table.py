"""Jozefowicz, Zaremba & Sutskever 2015, Table 2 at CPU scale: every architecture's NLL per time step on Nottingham
(with and without dropout) and Piano-midi, each after a small random hyperparameter search.

What is the paper's (§3.5-3.7):
- the ten architectures: Tanh (``rnn_tanh``), LSTM (``lstm`` with forget bias 0), LSTM-f / -i / -o (the LSTM without
  its forget, input or output gate; forget bias 0 where it has one), LSTM-b (``lstm`` with forget bias 1), GRU
  (``gru_paper``, the paper's form) and MUT1-3;
- each at about ``--params`` parameters (the paper's music sizes are 100K and 1M), the units found by binary search
  for the budget as in §3.7, one layer;
- minibatch 20 pieces unrolled 35 frames, the state carried within a piece (``configs/music/nottingham-lstm.yaml``);
- SGD, the hyperparameters drawn at random from the §3.7 grids: learning rate, gradient-norm clip, init scale
  (``Uniform(+-scale / sqrt(units))``), and for the N-dropout row the dropout rate;
- the measure: negative log-likelihood per frame on the test split, summed over the 88 notes (nats).

What is scaled down to fit a 2-core CPU, and says so in the table:
- ``--trials`` per cell (the paper: hundreds of settings per architecture); the first trial is the recipe's own
  values (lr 0.5, clip 5, scale 1 in the paper's units; dropout 0.3), the others random from the grids;
- learning rates from {0.3, 0.5, 1} of the paper's {0.1, 0.2, 0.3, 0.5, 1, 2, 5}: in constant-rate probes of the
  LSTM-b, 3 never got below 5.78 nats on validation in 15 epochs (1: 4.11), and 0.2 trailed 0.5 after 8 epochs
  (4.39 against 4.20); 2 and 5 were not tried (docs/music.md);
- ``--epochs`` with the music schedule shortened: x``--factor`` after ``--patience`` epochs without improvement
  (the paper: x0.8 after 10, for up to 800 epochs);
- one layer (the paper searched 1-4).

The trials run through ``lm-zoo tune`` (Optuna, one SQLite study per cell under ``--workdir``, by default
runs/music-table/ and the results file's name, with ``--trials`` trials in all, ``--jobs`` processes); the best trial
by validation NLL is scored on the test split. Results go to a new file (``--out``, or
``benchmarks/results/music_table-<time>.json``; see benchmarks/output.py) as each cell ends, each cell with the trials
its study holds, and every cell is trained afresh. ``--resume`` continues a file, so that the table can be filled over
several sessions: it skips the cells whose study already has ``--trials`` trials, and a larger ``--trials`` tops each
cell's study up (while it is still under ``--workdir``; else the cell is searched afresh). Example::

    LM_ZOO_DATA=../shared/data python benchmarks/music_table.py --rows N P N-dropout --trials 2 --epochs 15
    python benchmarks/music_table.py --table-only        # print the table of the committed results (or --out)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import output  # noqa: E402
from benchmarks.tuned_runs import ROOT, check_fresh, relative, tune_cell  # noqa: E402
from zoo import units_for_budget  # noqa: E402

BASE_CONFIG = ROOT / "configs" / "music" / "nottingham-lstm.yaml"
NAME = "music_table"  # benchmarks/results/music_table.json
BPTT = 35  # the paper sums the loss over the 35 unrolled steps; lm-zoo averages it: lr x 35, clip / 35

# Paper name -> (zoo architecture, cell options).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "Tanh": ("rnn_tanh", {}),
    "LSTM": ("lstm", {"forget_bias": 0.0}),
    "LSTM-f": ("lstm_no_forget", {}),
    "LSTM-i": ("lstm_no_input", {"forget_bias": 0.0}),
    "LSTM-o": ("lstm_no_output", {"forget_bias": 0.0}),
    "LSTM-b": ("lstm", {"forget_bias": 1.0}),
    "GRU": ("gru_paper", {}),
    "MUT1": ("mut1", {}),
    "MUT2": ("mut2", {}),
    "MUT3": ("mut3", {}),
}
# Table 2 row -> (dataset, with dropout).
ROWS = {"N": ("nottingham", False), "N-dropout": ("nottingham", True), "P": ("piano-midi", False)}
# Table 2 of the paper, in the order of ARCHITECTURES.
PAPER = {
    "N": [3.612, 3.492, 3.732, 3.426, 3.406, 3.419, 3.410, 3.254, 3.372, 3.337],
    "N-dropout": [3.267, 3.403, 3.420, 3.252, 3.253, 3.345, 3.427, 3.376, 3.429, 3.505],
    "P": [6.809, 6.866, 6.813, 6.856, 6.870, 6.820, 6.876, 6.792, 6.852, 6.840],
}
# §3.7's grids, in the paper's units.
LEARNING_RATES = (0.3, 0.5, 1.0)  # of {0.1, 0.2, 0.3, 0.5, 1, 2, 5}: see the module docstring
GRADIENT_NORMS = (1.0, 2.5, 5.0, 10.0, 20.0)
INIT_SCALES = (0.3, 0.7, 1.0, 1.4, 2.0, 2.8)
DROPOUTS = (0.1, 0.2, 0.3, 0.5)  # N-dropout: nonzero dropout; the paper's PTB grid without its 0
RECIPE = {"lr": 0.5, "clip": 5.0, "scale": 1.0, "dropout": 0.3}  # the first trial of every cell


def parameters(architecture: str, hidden_size: int, cell_options: dict[str, Any]) -> int:
    """Parameters of a one-layer piano-roll model."""
    from zoo.music import PianoRollLM

    return PianoRollLM(architecture, hidden_size, 1, cell_options=cell_options).num_parameters()


def cell_config(base: dict[str, Any], row: str, name: str, hidden: int, args: argparse.Namespace) -> dict[str, Any]:
    """The full ``lm-zoo fit`` config of one cell: the base recipe with this row's data and this architecture."""
    import copy

    from lightning_modules.tuning import set_key

    dataset, dropout = ROWS[row]
    architecture, options = ARCHITECTURES[name]
    config = copy.deepcopy(base)
    settings = {
        "data.init_args.dataset": dataset,
        "data.init_args.data_root": args.data_root,
        "model.init_args.architecture": architecture,
        "model.init_args.hidden_size": hidden,
        "model.init_args.num_layers": 1,
        "model.init_args.cell_options": dict(options),
        "model.init_args.dropout": RECIPE["dropout"] if dropout else 0.0,
        "model.init_args.init_range": RECIPE["scale"] / math.sqrt(hidden),
        "optimizer.init_args.lr": RECIPE["lr"] * BPTT,
        "trainer.gradient_clip_val": RECIPE["clip"] / BPTT,
        "trainer.max_epochs": args.epochs,
        "trainer.default_root_dir": str(args.workdir / f"{row}-{name}"),
        "trainer.enable_progress_bar": False,
    }
    for key, value in settings.items():
        set_key(config, key, value)
    schedule = {
        "class_path": "lightning_modules.DecayOnPlateau",
        "init_args": {"patience": args.patience, "factor": args.factor, "min_lr": 1e-3 * BPTT},
    }
    config["trainer"]["callbacks"] = [schedule]
    config["lr_scheduler"] = None
    return config


def cell_space(row: str, hidden: int) -> dict[str, dict[str, Any]]:
    """The §3.7 grids in lm-zoo's units (per-frame mean loss: lr x 35, clip / 35)."""
    space: dict[str, dict[str, Any]] = {
        "optimizer.init_args.lr": {"type": "categorical", "choices": [lr * BPTT for lr in LEARNING_RATES]},
        "trainer.gradient_clip_val": {"type": "categorical", "choices": [g / BPTT for g in GRADIENT_NORMS]},
        "model.init_args.init_range": {"type": "categorical", "choices": [s / math.sqrt(hidden) for s in INIT_SCALES]},
    }
    if ROWS[row][1]:
        space["model.init_args.dropout"] = {"type": "categorical", "choices": list(DROPOUTS)}
    return space


def test_nll(checkpoint: Path, data_root: str | None) -> dict[str, Any]:
    """The checkpoint's test NLL per frame (every piece from zero state)."""
    from checkpoints import load
    from evaluation.music import evaluate_music

    loaded = load(str(checkpoint))
    return evaluate_music(loaded.model, loaded.datamodule(data_root=data_root), "test")


def run_cell(row: str, name: str, base: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Tune one (row, architecture) cell with ``lm-zoo tune`` and score its best trial on the test split."""
    architecture, options = ARCHITECTURES[name]
    hidden = units_for_budget(lambda units: parameters(architecture, units, options), args.params)
    config, space = cell_config(base, row, name, hidden, args), cell_space(row, hidden)
    best, checkpoint, seconds, counts = tune_cell(
        args.workdir / f"{row}-{name}", f"{row}-{name}", config, space, args.trials, args.jobs
    )
    result = test_nll(checkpoint, args.data_root)
    paper = PAPER[row][list(ARCHITECTURES).index(name)]
    return {
        "row": row,
        "architecture": name,
        "zoo_architecture": architecture,
        "cell_options": options,
        "hidden_size": hidden,
        "parameters": parameters(architecture, hidden, options),
        "params_budget": args.params,
        "trials": args.trials,  # asked for; what the study holds:
        **counts,
        "epochs": args.epochs,
        "schedule": {"patience": args.patience, "factor": args.factor},
        "best_trial": best.number,
        "best_params": best.params,
        "valid_nll": best.value,
        "test_nll": result.nll_per_step,
        "test_frames": result.frames,
        "paper": paper,
        "difference": result.nll_per_step - paper,
        "tune_seconds": round(seconds, 1),
        "checkpoint": relative(checkpoint),
    }


def table(results: dict[str, dict[str, Any]], rows: list[str]) -> str:
    """Markdown: per row, ours (test NLL per frame of the best trial by validation), the paper's, the difference."""
    names = list(ARCHITECTURES)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in rows:
        ours = [results.get(f"{row}/{name}") for name in names]
        figures = ["-" if r is None else f"{r['test_nll']:.3f}" for r in ours]
        lines.append(f"| {row} (lm-zoo) | " + " | ".join(figures) + " |")
        lines.append(f"| {row} (paper) | " + " | ".join(f"{value:.3f}" for value in PAPER[row]) + " |")
        gaps = ["-" if r is None else f"{r['test_nll'] - r['paper']:+.3f}" for r in ours]
        lines.append(f"| {row}: lm-zoo - paper | " + " | ".join(gaps) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--architectures", nargs="+", choices=list(ARCHITECTURES), default=list(ARCHITECTURES))
    parser.add_argument("--params", type=int, default=100_000, help="parameter budget per model (paper: 100K or 1M)")
    parser.add_argument("--trials", type=int, default=2, help="hyperparameter settings per cell")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--patience", type=int, default=1, help="epochs without improvement before a decay")
    parser.add_argument("--factor", type=float, default=0.5, help="learning-rate decay factor")
    parser.add_argument("--jobs", type=int, default=2, help="trials side by side (lm-zoo tune --jobs)")
    parser.add_argument(
        "--workdir", type=Path, help="the cells' studies (default: runs/music-table/<the results file's name>)"
    )
    output.add_arguments(parser, NAME)
    parser.add_argument("--data-root", default=os.environ.get("LM_ZOO_DATA"))
    parser.add_argument("--table-only", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args(argv)

    path = output.table_path(args, NAME) if args.table_only else output.output_path(args, NAME)
    results: dict[str, dict[str, Any]] = output.read(path)
    if not args.table_only:
        from commands.tune import full_config

        args.workdir = args.workdir or ROOT / "runs" / "music-table" / path.stem
        if not args.resume:
            check_fresh([args.workdir / f"{row}-{name}" for row in args.rows for name in args.architectures])
        base = full_config(BASE_CONFIG)
        for row in args.rows:
            for name in args.architectures:
                key = f"{row}/{name}"
                if key in results:  # --resume
                    schedule = {"patience": args.patience, "factor": args.factor}
                    expected = {"params_budget": args.params, "epochs": args.epochs, "schedule": schedule}
                    output.check_same(f"cell {key}", results[key], expected, path)
                    if results[key].get("trials_run", 0) >= args.trials:
                        continue
                results[key] = run_cell(row, name, base, args)
                r = results[key]
                print(
                    f"{key}: test {r['test_nll']:.3f} (paper {r['paper']:.3f}), valid {r['valid_nll']:.3f}, "
                    f"{r['hidden_size']} units, {r['parameters']:,} parameters, {r['trials_run']} trials, "
                    f"{r['tune_seconds']:.0f} s",
                    flush=True,
                )
                output.write(path, results)
        print(f"results: {path}")
    print(table(results, [row for row in ROWS if any(key.startswith(f"{row}/") for key in results)]))


if __name__ == "__main__":
    main()
