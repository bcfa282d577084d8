"""What Lightning's per-step SIGTERM broadcast costs a multi-process run, which lm-zoo's fit no longer makes.

Lightning 2.6's training epoch loop, at every step of a run of several processes, makes a tensor of rank 0's
``received_sigterm`` flag, broadcasts it from rank 0 and reads it back on the host (``_broadcast_sigterm_tensor``).
lm-zoo's fit handles SIGTERM itself and agrees on any rank's signal in the step's divergence gather, so it skips that
broadcast (``lightning_modules.lightning_private.skip_lightnings_sigterm_broadcast``). This times the broadcast as
Lightning makes it, on ``--ranks`` processes of this machine with gloo (on GPUs it is NCCL's, and its read-back a host
synchronisation a step), beside the same loop without it::

    python benchmarks/sigterm_broadcast.py --steps 2000 --rounds 5

Each rank's microseconds per step, the median over rounds, go to a results file (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks import output  # noqa: E402

NAME = "sigterm_broadcast"


def lightnings_broadcast() -> None:
    """Lightning 2.6's ``_TrainingEpochLoop._broadcast_sigterm_tensor`` on the CPU, without its rare stop branch."""
    sigterm_tensor = torch.tensor([0])
    dist.broadcast(sigterm_tensor, src=0)
    if sigterm_tensor.item() == 1:
        raise RuntimeError("no rank was signalled")


def rank_main(rank: int, world_size: int, store_path: str, steps: int, rounds: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    work = torch.randn(64, 64)
    timings: dict[str, list[float]] = {"with the broadcast": [], "without": []}
    for _ in range(rounds):
        for side in timings:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                work = torch.tanh(work @ work) * 0.5  # a small step's own work, the same on both sides
                if side == "with the broadcast":
                    lightnings_broadcast()
            timings[side].append((time.perf_counter() - start) / steps * 1e6)
    dist.barrier()
    Path(out).with_suffix(f".rank{rank}").write_text(json.dumps(timings))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000, help="steps per side and round")
    parser.add_argument("--rounds", type=int, default=5)
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "timings")
        mp.spawn(rank_main, args=(args.ranks, store, args.steps, args.rounds, out), nprocs=args.ranks, join=True)
        ranks = [json.loads(Path(out).with_suffix(f".rank{rank}").read_text()) for rank in range(args.ranks)]
    median = {side: statistics.median(v for rank in ranks for v in rank[side]) for side in ranks[0]}
    result = {
        "command": " ".join(["python", "benchmarks/sigterm_broadcast.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": output.commit(),
        "torch": torch.__version__,
        "hardware": output.hardware(),
        "settings": {"ranks": args.ranks, "steps": args.steps, "rounds": args.rounds, "backend": "gloo"},
        "us_per_step": ranks,
        "median_us_per_step": median,
        "broadcast_us": median["with the broadcast"] - median["without"],
    }
    output.write(path, result)
    for side, value in median.items():
        print(f"{side}: {value:.1f} us a step (median over ranks and rounds)")
    print(f"the broadcast: {result['broadcast_us']:+.1f} us a step; wrote {path}")


if __name__ == "__main__":
    main()
