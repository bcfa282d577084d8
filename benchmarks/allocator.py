"""``lm-zoo fit`` under three glibc ``malloc`` settings, side by side in one run: glibc's defaults, the mmap threshold
at its 32 MB ceiling with a 1 GB trim threshold (lm-zoo's settings until mmap was switched off), and lm-zoo's settings
as installed (``zoo.allocator``: no block served by ``mmap``, the same trim threshold).

Two workloads, the 2 x 200 LSTM of ``configs/ptb/lstm-small.yaml`` at batch 20 x 35 on PTB (10,000 words: 28 MB
logits, under the 32 MB ceiling) and the same network on WikiText-2 (33,278 words: 93 MB logits, over it). Each side
runs in a fresh process; tokens/s are taken over the training steps after ``--warmup`` (``fit_overhead.StepTimer``),
with the process's peak RSS and its system CPU time (page faults show there). The sides are alternated ``--rounds``
times. Writes a new results file (``--out``, or ``benchmarks/results/allocator-<time>.json``)::

    LM_ZOO_DATA=../shared/data python benchmarks/allocator.py
    LM_ZOO_DATA=../shared/data python benchmarks/allocator.py --corpora wikitext-2 --steps 100 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks import output  # noqa: E402
from benchmarks.fit_overhead import child_pythonpath, timed_fit_command  # noqa: E402

NAME = "allocator"
GLIBC = "glibc's defaults"
THRESHOLD = "mmap threshold 32 MB, trim 1 GB"
LM_ZOO = "lm-zoo's settings (no mmap, trim 1 GB)"
SIDES = {
    GLIBC: {"LM_ZOO_MALLOC": "default"},
    # A user's MALLOC_* variables win over lm-zoo's own (zoo.allocator), so these are what the process runs with.
    THRESHOLD: {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)},
    LM_ZOO: {},
}
CORPORA = ("ptb", "wikitext-2")
BATCH, BPTT = 20, 35


def run_side(corpus: str, side: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    """One ``lm-zoo fit`` in a fresh process: tokens/s, peak RSS (bytes) and system CPU seconds of the whole run."""
    out = work / "result.json"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "LM_ZOO_MALLOC", "GLIBC_TUNABLES"))}
    env = {**clean, **SIDES[side], "OMP_NUM_THREADS": str(args.threads), "FIT_OVERHEAD_OUT": str(out)}
    env["PYTHONPATH"] = child_pythonpath()
    command = timed_fit_command(
        work,
        args.warmup,
        args.steps,
        f"--data.init_args.corpus={corpus}",
        f"--data.init_args.batch_size={BATCH}",
        f"--data.init_args.bptt={BPTT}",
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        output.fail(f"{corpus}, {side}: lm-zoo fit failed: {last}")
    result = json.loads(out.read_text())
    return {
        "tokens_per_s": BATCH * BPTT / result["seconds_per_step"],
        "peak": result["peak"],
        "system_seconds": resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime - before,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpora", nargs="+", choices=CORPORA, default=list(CORPORA))
    parser.add_argument("--steps", type=int, default=200, help="timed training steps per side and round")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timing starts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {corpus: [] for corpus in args.corpora}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for corpus in args.corpora:  # the sides alternated, so that a change in the machine's load touches all
                rounds[corpus].append({side: run_side(corpus, side, args, Path(tmp)) for side in SIDES})
    medians = {
        corpus: {side: {key: statistics.median(r[side][key] for r in runs) for key in runs[0][side]} for side in SIDES}
        for corpus, runs in rounds.items()
    }
    command = " ".join(["python", "benchmarks/allocator.py", *(sys.argv[1:] if argv is None else argv)])
    settings = {"batch": BATCH, "bptt": BPTT, "steps": args.steps, "warmup": args.warmup, "threads": args.threads}
    output.write(
        path,
        {
            "command": command,
            "settings": settings,
            "hardware": output.hardware(),
            "sides": SIDES,
            "rounds": rounds,
            "medians": medians,
        },
    )
    for corpus, sides in medians.items():
        print(
            f"== {corpus}: 2 x 200 LSTM, batch {BATCH} x {BPTT}, {args.threads} threads, "
            f"medians of {args.rounds} rounds"
        )
        base = sides[GLIBC]["tokens_per_s"]
        for side, measured in sides.items():
            print(
                f"  {side:<40} {measured['tokens_per_s']:8,.0f} tokens/s ({measured['tokens_per_s'] / base:.2f}x), "
                f"peak RSS {measured['peak'] / 2**20:,.0f} MiB, system CPU {measured['system_seconds']:.1f} s"
            )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
