"""``lm-zoo evaluate`` and ``generate`` against plain PyTorch loops over the same weights, side by side in one run.

Evaluation, whole process (start-up, loading, reading the corpus and scoring, as a user waits for it): ``lm-zoo
evaluate NAME --split test --batch-size 1`` against pytorch/examples' ``evaluate`` loop written out here (nothing
vendored) over the same ``model.safetensors`` and ``vocab.txt``: PTB's test words with ``<eos>`` per line, one column,
windows of BPTT steps with the state carried, ``nn.Embedding`` -> ``nn.LSTM`` -> ``nn.Linear``, the summed
cross-entropy. Both print their perplexity, which must agree. The sides alternate ``--rounds`` times.

Generation, in one process: ``RecurrentLM.generate`` against a loop of ``nn.LSTM`` steps and ``torch.multinomial``
over the same weights, ``--tokens`` ids at batch 1 from a line start, alternated ``--rounds`` times.

Writes a new results file (``--out``, or ``benchmarks/results/inference_overhead-<time>.json``)::

    LM_ZOO_DATA=../shared/data python benchmarks/inference_overhead.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import output  # noqa: E402

NAME = "inference_overhead"  # benchmarks/results/inference_overhead.json


class PlainLSTM(nn.Module):
    """pytorch/examples' ``RNNModel`` for an untied LSTM, loaded from a bundled export's files by hand."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))["model"]
        if config["architecture"] != "lstm" or config["head"] != "softmax" or config["tie_weights"]:
            raise SystemExit(f"{directory}: the plain loop is an untied LSTM with a softmax head")
        weights = load_file(directory / "model.safetensors")
        layers = config["num_layers"]
        self.encoder = nn.Embedding(config["vocab_size"], config["embedding_size"])
        self.rnn = nn.LSTM(config["embedding_size"], config["hidden_size"], layers, batch_first=True)
        self.decoder = nn.Linear(config["hidden_size"], config["vocab_size"])
        rnn = {}
        for i in range(layers):  # lm-zoo keeps one single-layer nn.LSTM per layer: rename to nn.LSTM's l{i}
            for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                rnn[f"{p}_l{i}"] = weights[f"rnn.layers.{i}.rnn.{p}_l0"].float()
        self.rnn.load_state_dict(rnn)
        self.encoder.load_state_dict({"weight": weights["embedding.weight"].float()})
        self.decoder.load_state_dict(
            {"weight": weights["decoder.weight"].float(), "bias": weights["decoder.bias"].float()}
        )
        self.eval()

    def forward(self, ids: torch.Tensor, hidden: Any = None) -> tuple[torch.Tensor, Any]:
        out, hidden = self.rnn(self.encoder(ids), hidden)  # (B, T, H)
        return self.decoder(out), hidden  # (B, T, V)


def plain_evaluate(directory: Path, test_file: Path, bptt: int) -> dict[str, float]:
    """The plain evaluation loop over PTB's test split: perplexity and tokens."""
    vocab = {line.split("\t")[0]: i for i, line in enumerate((directory / "vocab.txt").read_text().splitlines())}
    unk, eos = vocab["<unk>"], vocab["<eos>"]
    ids = [vocab.get(w, unk) for line in test_file.read_text().splitlines() for w in [*line.split(), "<eos>"]]
    data = torch.tensor([eos, *ids]).unsqueeze(0)  # (1, N + 1): the first target follows an <eos>, as lm-zoo's
    model, total, hidden = PlainLSTM(directory), 0.0, None
    with torch.no_grad():
        for i in range(0, data.size(1) - 1, bptt):
            inputs, targets = data[:, i : i + bptt], data[:, i + 1 : i + 1 + bptt]
            inputs = inputs[:, : targets.size(1)]
            logits, hidden = model(inputs, hidden)
            total += nn.functional.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
            ).item()
    tokens = data.size(1) - 1
    return {"ppl": math.exp(total / tokens), "tokens": tokens}


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    return seconds, json.loads(done.stdout.strip().splitlines()[-1])


def compare_evaluation(name: str, bptt: int, rounds: int, threads: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    lm_zoo = str(Path(sys.executable).with_name("lm-zoo"))  # the installed command, as a user runs it
    sides = {
        "plain loop": [sys.executable, __file__, "--worker", name, "--bptt", str(bptt)],
        "lm-zoo evaluate": [lm_zoo, "evaluate", name, "--split", "test", "--batch-size", "1", "--bptt", str(bptt),
                            "--device", "cpu", "--json"],
    }  # fmt: skip
    times: dict[str, list[float]] = {side: [] for side in sides}
    ppl: dict[str, float] = {}
    for _ in range(rounds):
        for side, command in sides.items():
            seconds, result = _timed(command, env)
            times[side].append(seconds)
            ppl[side] = result["ppl"]
            print(f"  evaluation, {side}: {seconds:.2f} s, ppl {result['ppl']:.4f}", flush=True)
    median = {side: statistics.median(values) for side, values in times.items()}
    return {"seconds": times, "median_seconds": median, "ppl": ppl,
            "time_ratio": median["lm-zoo evaluate"] / median["plain loop"]}  # fmt: skip


def compare_generation(name: str, tokens: int, rounds: int) -> dict[str, Any]:
    import checkpoints

    model, tokenizer = checkpoints.from_pretrained(name)
    plain = PlainLSTM(ROOT / "pretrained" / name)
    start = torch.tensor([[tokenizer.eos_id]])

    def plain_generate() -> int:
        generator, ids, hidden, sampled = torch.Generator().manual_seed(1), start, None, 0
        with torch.no_grad():
            for _ in range(tokens):
                logits, hidden = plain(ids, hidden)
                ids = torch.multinomial(torch.softmax(logits[:, -1], -1), 1, generator=generator)  # (1, 1)
                sampled += 1
        return sampled

    def zoo_generate() -> int:
        with torch.no_grad():
            return len(model.generate(start, tokens, generator=torch.Generator().manual_seed(1))[0])

    rates: dict[str, list[float]] = {"plain loop": [], "RecurrentLM.generate": []}
    for _ in range(rounds):
        for side, run in (("plain loop", plain_generate), ("RecurrentLM.generate", zoo_generate)):
            begin = time.perf_counter()
            sampled = run()
            rates[side].append(sampled / (time.perf_counter() - begin))
            print(f"  generation, {side}: {rates[side][-1]:,.0f} tokens/s", flush=True)
    median = {side: statistics.median(values) for side, values in rates.items()}
    return {"tokens": tokens, "tokens_per_s": rates, "median_tokens_per_s": median,
            "speed_ratio": median["RecurrentLM.generate"] / median["plain loop"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ptb-lstm-small")
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2000, help="ids sampled per generation round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # run the plain evaluation of this model and print it
    output.add_arguments(parser, NAME, resumable=False)
    args = parser.parse_args(argv)
    data = Path(os.environ.get("LM_ZOO_DATA", ROOT.parent / "shared" / "data"))
    if args.worker:
        print(json.dumps(plain_evaluate(ROOT / "pretrained" / args.worker, data / "ptb" / "ptb.test.txt", args.bptt)))
        return
    path = output.output_path(args, NAME)
    torch.set_num_threads(args.threads)
    evaluation = compare_evaluation(args.model, args.bptt, args.rounds, args.threads)
    generation = compare_generation(args.model, args.tokens, args.rounds)
    result = {
        "command": "python benchmarks/inference_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {args.threads} torch threads",
        "load_average_after": list(os.getloadavg()),
        "evaluation": evaluation,
        "generation": generation,
    }
    output.write(path, result)
    print(f"evaluation: lm-zoo / plain loop time {evaluation['time_ratio']:.2f}x; "
          f"generation: lm-zoo / plain loop tokens/s {generation['speed_ratio']:.2f}x; wrote {path}")  # fmt: skip


if __name__ == "__main__":
    main()
