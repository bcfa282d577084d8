"""Sampling speed at batch 1: ``RecurrentLM.generate`` against a plain ``nn.LSTM`` loop, side by side in one run.

The plain loop is what a user writes: ``nn.Embedding`` -> ``nn.LSTM`` -> ``nn.Linear``, ``torch.softmax`` and
``torch.multinomial`` on the device, the sampled id fed back without leaving it (pytorch/examples' ``generate.py``
copies the probabilities to the host every token; this loop does not, so it is the faster baseline). lm-zoo's side is
``generate`` as ``lm-zoo generate`` calls it, for each ``--arch``: on CUDA its captured sampling step
(:mod:`zoo.sampling`), and with ``--eager`` also its plain path (``LM_ZOO_WINDOW_GRAPHS=0``). Every network has the
plain loop's sizes (``--width``, ``--layers``, ``--vocab``) and random weights: the time of a token does not depend
on what the weights are. Each side samples ``--tokens`` ids from a start id, after one untimed run of 20 tokens; the
sides alternate ``--rounds`` times and the median counts.

Writes a new results file (``--out``, or ``benchmarks/results/generate_speed-<time>.json``)::

    python benchmarks/generate_speed.py --device cuda --arch lstm mogrifier on_lstm --eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import output  # noqa: E402

NAME = "generate_speed"  # benchmarks/results/generate_speed.json
PLAIN = "plain nn.LSTM loop"


class PlainLSTM(nn.Module):
    """pytorch/examples' ``RNNModel`` (LSTM, untied) at the benchmark's sizes."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, layers, batch_first=True)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        output, hidden = self.rnn(self.encoder(ids), hidden)  # (1, 1, H)
        return self.decoder(output), hidden


def plain_sampler(model: PlainLSTM, device: torch.device) -> Callable[[int], int]:
    def run(tokens: int) -> int:
        generator = torch.Generator(device).manual_seed(1)
        ids, hidden = torch.zeros(1, 1, dtype=torch.long, device=device), None
        with torch.no_grad():
            for _ in range(tokens):
                logits, hidden = model(ids, hidden)
                ids = torch.multinomial(torch.softmax(logits[:, -1], -1), 1, generator=generator)  # (1, 1)
        _ = ids.tolist()  # the last id on the host: every token has been computed
        return tokens

    return run


def zoo_sampler(model: nn.Module, device: torch.device, graphs: bool) -> Callable[[int], int]:
    from zoo import settings

    def run(tokens: int) -> int:
        start = torch.zeros(1, 1, dtype=torch.long, device=device)
        with settings.overridden(window_graphs=graphs):
            return len(model.generate(start, tokens, generator=torch.Generator().manual_seed(1))[0])

    return run


def timed(run: Callable[[int], int], tokens: int, device: torch.device) -> float:
    """Tokens per second of one run (the device's queue drained before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    sampled = run(tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sampled / (time.perf_counter() - begin)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import zoo

    device = torch.device(args.device)
    torch.manual_seed(0)
    sides: dict[str, Callable[[int], int]] = {
        PLAIN: plain_sampler(PlainLSTM(args.vocab, args.width, args.layers).to(device).eval(), device)
    }
    for arch in args.arch:
        model = zoo.RecurrentLM(args.vocab, arch, args.width, args.width, num_layers=args.layers).to(device).eval()
        sides[f"{arch} generate"] = zoo_sampler(model, device, graphs=True)
        if args.eager:
            sides[f"{arch} generate, plain path"] = zoo_sampler(model, device, graphs=False)
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for run in sides.values():
        run(20)  # untimed: capture, cuDNN's and cuBLAS's set-up
    for _ in range(args.rounds):
        for side, run in sides.items():
            rates[side].append(timed(run, args.tokens, device))
            print(f"  {side}: {rates[side][-1]:,.0f} tokens/s", flush=True)
    median = {side: statistics.median(values) for side, values in rates.items()}
    return {
        "tokens_per_s": rates,
        "median_tokens_per_s": median,
        "ratio_to_plain": {side: rate / median[PLAIN] for side, rate in median.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arch", nargs="+", default=["lstm", "mogrifier", "on_lstm"])
    parser.add_argument("--eager", action="store_true", help="also time generate's plain path (graphs off)")
    parser.add_argument("--width", type=int, default=650)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=1000, help="ids sampled per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        output.fail(f"--device {args.device}: this machine has no CUDA GPU")
    path = output.output_path(args, NAME)
    result = {
        "command": "python benchmarks/generate_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        **output.provenance(args.device),
        "settings": {k: getattr(args, k) for k in ("arch", "width", "layers", "vocab", "tokens", "rounds")},
        "batch": 1,
        **measure(args),
    }
    output.write(path, result)
    for side, ratio in result["ratio_to_plain"].items():
        print(f"{side}: {result['median_tokens_per_s'][side]:,.0f} tokens/s, {ratio:.2f}x the plain loop")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
