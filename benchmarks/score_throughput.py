"""``lm-zoo score``'s throughput: sentences per second of a registered model on PTB's test sentences, one at a time
against batched, side by side in one run, on the same sentences and thread count; the batched scores must equal the
one-at-a-time ones (padding changes no score). Writes a new results file (``--out``, or
``benchmarks/results/score_throughput-<time>.json``; never the committed ``score_throughput.json``).

    LM_ZOO_DATA=../shared/data python benchmarks/score_throughput.py --model ptb-lstm-small --sentences 500
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpoints  # noqa: E402
from benchmarks import output  # noqa: E402
from datamodules.corpora import data_root  # noqa: E402
from evaluation.sentences import score_sentences  # noqa: E402

NAME = "score_throughput"  # benchmarks/results/score_throughput.json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ptb-lstm-small")
    parser.add_argument("--sentences", type=int, default=500, help="the first N lines of PTB's test split")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=2)
    output.add_arguments(parser, NAME, resumable=False)  # one measurement: nothing to continue
    args = parser.parse_args(argv)
    path = output.output_path(args, NAME)
    torch.set_num_threads(args.threads)
    model, tokenizer = checkpoints.from_pretrained(args.model)
    lines = (data_root() / "ptb" / "ptb.test.txt").read_text().splitlines()[: args.sentences]
    sentences = [" ".join(line.split()) for line in lines]
    score_sentences(model, tokenizer, sentences[:8], batch_size=8)  # warm-up: first-call allocations
    rows, reference = [], None
    for batch_size in args.batch_sizes:
        start = time.perf_counter()
        scores = score_sentences(model, tokenizer, sentences, batch_size=batch_size)
        seconds = time.perf_counter() - start
        logprobs = [s.logprob for s in scores]
        reference = reference or logprobs
        largest_difference = max(abs(a - b) for a, b in zip(logprobs, reference, strict=True))
        tokens = sum(s.tokens for s in scores)
        rows.append(
            {
                "batch_size": batch_size,
                "seconds": round(seconds, 3),
                "sentences_per_s": round(len(sentences) / seconds, 1),
                "tokens_per_s": round(tokens / seconds, 1),
                "largest_logprob_difference_from_batch_1": largest_difference,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": " ".join(["python", "benchmarks/score_throughput.py", *sys.argv[1:]]),
        "model": args.model,
        "sentences": len(sentences),
        "tokens": sum(s.tokens for s in scores),
        "threads": args.threads,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "rows": rows,
        "speedup_of_largest_batch": round(rows[-1]["sentences_per_s"] / rows[0]["sentences_per_s"], 2),
    }
    output.write(path, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
