"""Two ``lm-zoo fit`` runs on one machine at once, against one alone: each one's speed beside the other, as a share of
its speed alone, with lm-zoo's thread sharing (``lightning_modules/cores.py``) and with the thread count fixed at the
machine's cores (``OMP_NUM_THREADS``, as every fit ran before it).

The fits are ``benchmarks/fit_overhead.py``'s small one (2 x ``--width`` units on PTB's characters by default), whose
steps are short, so that threads waiting for each other show at once. Each fit is timed over its steps after
``--warmup`` (``fit_overhead.StepTimer``); the two of a pair start together::

    python benchmarks/side_by_side.py                    # width 8, 1500 steps alone and shared, 60 fixed
    python benchmarks/side_by_side.py --rounds 3

Each fit's steps per second, the ratios and the command go to a results file (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks import output  # noqa: E402
from benchmarks.fit_overhead import child_pythonpath, timed_fit_command  # noqa: E402

NAME = "side_by_side"
SHARED, FIXED = "lm-zoo's thread sharing", "threads fixed at the cores"


def fits(args: argparse.Namespace, work: Path, copies: int, fixed: bool, steps: int) -> list[float]:
    """Steps per second of each of ``copies`` fits started together."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    env.pop("OMP_NUM_THREADS", None)
    if fixed:
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    processes, outs = [], []
    for copy in range(copies):
        out = work / f"fit{copy}.json"
        command = timed_fit_command(
            work, args.warmup, steps,
            f"--data.init_args.data_root={args.data_root}", "--data.init_args.corpus=ptb-char",
            f"--model.init_args.embedding_size={args.width}", f"--model.init_args.hidden_size={args.width}",
        )  # fmt: skip
        processes.append(
            subprocess.Popen(command, env={**env, "FIT_OVERHEAD_OUT": str(out)}, stderr=subprocess.PIPE, text=True)
        )
        outs.append(out)
    for process in processes:
        _, stderr = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"a fit failed:\n{stderr[-3000:]}")
    return [1 / json.loads(out.read_text())["seconds_per_step"] for out in outs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1500, help="timed steps of a fit alone and of a shared pair")
    parser.add_argument("--fixed-steps", type=int, default=60, help="timed steps of the pair with fixed threads")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--data-root", type=Path, default=Path(os.environ.get("LM_ZOO_DATA", "~/.cache/lm-zoo/data")))
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    args.data_root = args.data_root.expanduser()
    path = output.output_path(args, NAME)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            work = Path(tempfile.mkdtemp(dir=tmp))
            rounds.append(
                {
                    "alone": fits(args, work, 1, False, args.steps)[0],
                    "alone, " + FIXED: fits(args, work, 1, True, args.steps)[0],
                    "side by side, " + SHARED: fits(args, work, 2, False, args.steps),
                    "side by side, " + FIXED: fits(args, work, 2, True, args.fixed_steps),
                }
            )
    alone = statistics.median(r["alone"] for r in rounds)
    shares = {
        side: statistics.median(min(r[side]) / r["alone"] for r in rounds)
        for side in ("side by side, " + SHARED, "side by side, " + FIXED)
    }
    result = {
        "command": " ".join(["python", "benchmarks/side_by_side.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": output.commit(),
        "hardware": output.hardware(),
        "cores": len(os.sched_getaffinity(0)),
        "settings": {"width": args.width, "steps": args.steps, "fixed_steps": args.fixed_steps, "warmup": args.warmup},
        "rounds": rounds,
        "median_alone_steps_per_s": alone,
        "slower_of_the_pair_over_alone": shares,
    }
    output.write(path, result)
    for round_ in rounds:
        print(json.dumps({side: value for side, value in round_.items()}))
    for side, share in shares.items():
        print(f"{side}: the slower fit of the pair at {share:.2f}x its speed alone ({alone:.0f} steps/s alone)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
