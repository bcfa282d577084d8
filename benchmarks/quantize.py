"""float32 against int8 (``--quantize int8`` and ``int8-head``: PyTorch's dynamic quantization of the whole network, and
of its output layer alone) for shipped word models, side by side in one process on the same thread count: scoring
tokens/s (``lm-zoo evaluate --batch-size 1`` over the test split, whose perplexity each side reports) and sampling
tokens/s (batch 1, seeded). The sides alternate over ``--rounds`` rounds and each figure is the median of its rounds:
one pass each, float first, moved the small model's ratio between 1.35x and 1.86x from run to run. Writes a new
results file (``--out``, or ``benchmarks/results/quantize_int8-<time>.json``)::

    LM_ZOO_DATA=../shared/data python benchmarks/quantize.py
    LM_ZOO_DATA=../shared/data python benchmarks/quantize.py --models ptb-lstm-small --sample-tokens 500

``--register`` also writes each model's ``int8`` test figure into the registry (its ``int8_results``, which ``make
verify-pretrained`` re-measures), as a rebuilt bundle (``python -m release build``) leaves them out.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpoints  # noqa: E402
from benchmarks import output  # noqa: E402
from checkpoints import registry  # noqa: E402
from evaluation.perplexity import evaluate  # noqa: E402
from zoo.quantization import MODES, quantize_int8  # noqa: E402

NAME = "quantize_int8"  # benchmarks/results/quantize_int8.json
MODELS = ["ptb-lstm-small", "ptb-lstm-medium", "wikitext-2-lstm"]


def _scoring(model: torch.nn.Module, loaded: Any) -> dict[str, float]:
    """The test split at eval batch 1 and the run's eval BPTT, as ``lm-zoo evaluate --batch-size 1`` scores it."""
    start = time.perf_counter()
    result = evaluate(model, loaded.datamodule(None, None), "test", 1, None, "cpu")
    seconds = time.perf_counter() - start
    tokens = result.tokens
    return {
        "ppl": result.ppl,
        "bptt": result.bptt,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def _sampling(model: torch.nn.Module, start_id: int, tokens: int, seed: int) -> dict[str, float]:
    """``tokens`` ids sampled at batch 1 from a line start, one step at a time (no stop id: a fixed length)."""
    generator = torch.Generator().manual_seed(seed)
    begin = time.perf_counter()
    with torch.no_grad():
        sampled = model.generate(torch.tensor([[start_id]]), tokens, generator=generator)
    seconds = time.perf_counter() - begin
    return {"tokens": len(sampled[0]), "seconds": seconds, "tokens_per_s": len(sampled[0]) / seconds}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    """The rounds of one side and task as one: their median tokens/s (the perplexity is the same every round)."""
    middle = statistics.median(run["tokens_per_s"] for run in runs)
    return {**runs[0], "seconds": runs[0]["tokens"] / middle, "tokens_per_s": middle}


def _register(name: str, scoring: dict[str, float]) -> None:
    """``name``'s int8 test figure, as measured here at eval batch 1, into its registry entry."""
    figure = {"ppl": scoring["ppl"], "eval_batch_size": 1, "bptt": scoring["bptt"], "tokens": scoring["tokens"]}
    registry.write_entry(replace(registry.load_registry()[name], int8_results={"test": figure}))
    print(f"{name}: int8 test perplexity {scoring['ppl']:.4f} written to {registry.registry_path()}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--sample-tokens", type=int, default=2000, help="tokens sampled per side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds; figures are their medians")
    parser.add_argument("--register", action="store_true", help="write each int8 test figure into the registry")
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        loaded = checkpoints.load(name)
        sides = {
            "float32": loaded.model.eval(),
            "int8": quantize_int8(loaded.model),
            "int8-head": quantize_int8(loaded.model, recurrent=False),
        }
        rounds: dict[str, dict[str, list[dict[str, float]]]] = {side: {"scoring": [], "sampling": []} for side in sides}
        for round_index in range(args.rounds):  # the sides alternate, so that a slow spell of the machine hits both
            for side, model in sides.items():
                scoring = _scoring(model, loaded)
                rounds[side]["scoring"].append(scoring)
                print(
                    f"{name} {side} round {round_index + 1}: scoring {scoring['tokens_per_s']:,.0f} tokens/s, "
                    f"ppl {scoring['ppl']:.4f}",
                    flush=True,
                )
            for side, model in sides.items():
                sampling = _sampling(model, loaded.tokenizer.eos_id, args.sample_tokens, seed=1)
                rounds[side]["sampling"].append(sampling)
                print(
                    f"{name} {side} round {round_index + 1}: sampling {sampling['tokens_per_s']:,.0f} tokens/s",
                    flush=True,
                )
        row: dict[str, Any] = {"model": name}
        for side, measured in rounds.items():
            row[side] = {task: _median(runs) for task, runs in measured.items()}
            row[side]["rounds"] = measured
        for side in MODES:  # each quantized side against float32
            measured, base = row[side], row["float32"]
            measured["scoring_speedup"] = measured["scoring"]["tokens_per_s"] / base["scoring"]["tokens_per_s"]
            measured["sampling_speedup"] = measured["sampling"]["tokens_per_s"] / base["sampling"]["tokens_per_s"]
            measured["ppl_change"] = measured["scoring"]["ppl"] / base["scoring"]["ppl"] - 1
        rows.append(row)
        if args.register:
            _register(name, row["int8"]["scoring"])
    output.write(
        path,
        {
            "command": "python benchmarks/quantize.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "threads": args.threads,
            "rounds": args.rounds,
            "torch": torch.__version__,
            "quantized_engine": torch.backends.quantized.engine,
            "machine": f"{platform.machine()}, {args.threads} torch threads",
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
