"""How many GBW windows the fused RNN kernel runs, before and after packed sentence segments, and at what speed.

Multi-sequence batches (``datamodules.multisequence``) zero a column's state at every sentence start. A reset inside
a window used to send every layer to the per-step loop (cuDNN cannot zero a state mid-sequence); with ``B`` columns
and sentences of ~27 words, nearly every window has one. ``zoo.layers.FusedLayer._segments`` runs such windows through
the fused kernel as packed sentence segments instead. This script reads real training windows of the GBW sample and
prints:

1. the fraction of windows without a reset inside (the fused path before) and the fraction that take the fused path
   now (all, without state dropout), for each (batch, BPTT) setting;
2. one training step (forward, backward) of a 2-layer LSTM stack on those windows, per-step loop against packed
   segments, measured side by side (interleaved, median), on ``--device``. On CPU the packed kernel is PyTorch's
   native variable-length loop, not oneDNN's, so the packed path is on by default on CUDA only
   (``FusedLayer.packed_segments``); this says what it would cost or gain elsewhere.

    python benchmarks/gbw_fused.py                       # CPU, the sample's recipe (64 x 20) and the paper's (128 x 50)
    python benchmarks/gbw_fused.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import zoo  # noqa: E402
from datamodules import GBWDataModule  # noqa: E402
from zoo.layers import FusedLayer  # noqa: E402

SAMPLE_FILES = {
    "train_files": "news.en.heldout-0001[0-1]-of-00050",
    "valid_files": "news.en.heldout-00012-of-00050",
    "test_files": "news.en.heldout-00013-of-00050",
}


def windows(batch: int, bptt: int, count: int, data_root: str | None) -> list:
    data = GBWDataModule("gbw-sample", batch_size=batch, bptt=bptt, data_root=data_root, **SAMPLE_FILES)
    data.prepare_data()
    taken = []
    for window in data.stream("train"):
        taken.append(window)
        if len(taken) == count:
            break
    return taken


def step_seconds(stack: torch.nn.Module, embedding: torch.nn.Embedding, batches: list, device: str) -> float:
    """Median seconds of forward + backward over ``batches``, the state carried from window to window."""
    seconds, state = [], None
    for batch in batches:
        inputs, reset = batch.inputs.to(device), batch.reset.to(device)
        start = time.perf_counter()
        y, state = stack(embedding(inputs), state, reset)
        y.float().pow(2).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        state = tuple(s.detach() for s in state)
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--settings", nargs="+", default=["64x20", "128x50"], help="batch x BPTT")
    parser.add_argument("--windows", type=int, default=200, help="training windows read per setting")
    parser.add_argument("--timed", type=int, default=20, help="windows timed per path and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128, help="the sample recipe's width")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--data-root", default=os.environ.get("LM_ZOO_DATA"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"== GBW sample training windows, 2 x {args.hidden} LSTM, {args.device}, {torch.get_num_threads()} threads")
    for setting in args.settings:
        batch, bptt = map(int, setting.split("x"))
        taken = windows(batch, bptt, args.windows, args.data_root)
        free = sum(not bool(w.reset[:, 1:].any()) for w in taken)
        print(
            f"  {batch} x {bptt}: {len(taken)} windows; fused before: {free / len(taken):.1%} (no reset inside), "
            f"fused now: 100.0% ({len(taken) - free} of them as packed sentence segments)"
        )
        torch.manual_seed(0)
        stack = zoo.build("lstm", args.hidden, args.hidden, 2).to(args.device).train()
        embedding = torch.nn.Embedding(int(max(int(w.inputs.max()) for w in taken)) + 1, args.hidden).to(args.device)
        timed = taken[: args.timed]
        results: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for packed in (False, True):
                FusedLayer.packed_segments = packed
                results[packed].append(step_seconds(stack, embedding, timed, args.device))
        FusedLayer.packed_segments = None
        loop, packed = statistics.median(results[False]), statistics.median(results[True])
        print(
            f"    step: per-step loop {loop * 1e3:.1f} ms, packed segments {packed * 1e3:.1f} ms "
            f"(packed / loop {packed / loop:.2f}x)"
        )


if __name__ == "__main__":
    main()
