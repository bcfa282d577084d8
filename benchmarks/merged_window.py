"""A training window of a fused stack as one multi-layer kernel call against one call a layer, side by side in one
process (``zoo.paths``: on the CPU, nothing between the layers, the stack runs ``merged``).

Each side is ``fit_overhead.py``'s "lm-zoo's network in the plain loop" (``configs/ptb/lstm-small.yaml``'s 2-layer
LSTM at ``--width`` units on PTB, SGD, the clip): the same loop, the same seed, once as lm-zoo runs it and once with
the merged path turned off for the run (``zoo.paths._merged_runs`` answering no), so that each layer runs its own
fused call. The sides alternate ``--rounds`` times, each going first every other round; the median of each is kept,
with every round and the paths each side's windows took::

    LM_ZOO_DATA=../shared/data python benchmarks/merged_window.py                 # 2 x 8 over PTB's characters
    LM_ZOO_DATA=../shared/data python benchmarks/merged_window.py --width 200 --corpus ptb --steps 100

Writes a new results file (``--out``, or ``benchmarks/results/merged_window-<time>.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import output  # noqa: E402
from benchmarks.fit_overhead import CORPUS_FILES, plain_loop  # noqa: E402

NAME = "merged_window"
SIDES = ("one call", "one call a layer")


@contextmanager
def side(name: str, seen: Counter) -> Any:
    """Run the block as side ``name``, counting the path each training window's stack takes into ``seen``."""
    from zoo import paths

    window_path = paths.window_path

    def counted(stack: Any, x: Any, *, resets: bool) -> Any:
        chosen = window_path(stack, x, resets=resets)
        seen[chosen.stack] += 1
        return chosen

    merged = mock.patch.object(paths, "_merged_runs", lambda stack, x: False) if name == SIDES[1] else None
    with mock.patch.object(paths, "window_path", counted):
        if merged is None:
            yield
        else:
            with merged:
                yield


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=8, help="units per layer (default 8: the host's cost)")
    parser.add_argument("--corpus", choices=sorted(CORPUS_FILES), default="ptb-char")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--steps", type=int, default=500, help="timed windows per side and round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-root", type=Path, default=Path(os.environ.get("LM_ZOO_DATA", "~/.cache/lm-zoo/data")))
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    out = output.output_path(args, NAME)
    args.data_root = args.data_root.expanduser()
    if not (args.data_root / "ptb" / CORPUS_FILES[args.corpus]).is_file():
        output.fail(f"no PTB under {args.data_root}: set LM_ZOO_DATA or --data-root")

    import torch

    torch.set_num_threads(args.threads)
    seconds: dict[str, list[float]] = {name: [] for name in SIDES}
    seen: dict[str, Counter] = {name: Counter() for name in SIDES}
    for round_index in range(args.rounds):
        for name in SIDES if round_index % 2 == 0 else SIDES[::-1]:  # each side first every other round
            with side(name, seen[name]):
                seconds[name].append(
                    plain_loop(
                        args.data_root,
                        args.batch,
                        args.bptt,
                        args.steps,
                        args.warmup,
                        width=args.width,
                        corpus=args.corpus,
                        network="lm-zoo",
                    )  # fmt: skip
                )
    medians = {name: statistics.median(values) * 1e3 for name, values in seconds.items()}
    ratio = medians[SIDES[1]] / medians[SIDES[0]]
    for name in SIDES:
        rounds = ", ".join(f"{s * 1e3:.3f}" for s in seconds[name])
        print(f"  {name:18s} {medians[name]:.3f} ms a window (rounds {rounds}); stack paths {dict(seen[name])}")
    print(f"  one call a layer / one call: {ratio:.2f}x the time a window")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "data_root")}
    output.write(
        out,
        {
            "command": "python benchmarks/merged_window.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "settings": settings,
            "provenance": output.provenance("cpu"),
            "hardware": output.hardware(),
            "ms_per_window": {name: [s * 1e3 for s in values] for name, values in seconds.items()},
            "median_ms_per_window": medians,
            "per_layer_over_one_call": ratio,
            "stack_paths": {name: dict(counts) for name, counts in seen.items()},
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
