"""``lm-zoo fit`` against the plain training loop the peers run, on the same model and data, side by side.

The baseline is pytorch/examples' ``word_language_model/main.py`` loop, written out here (nothing vendored): PTB's
training text batchified into ``--batch`` columns, windows of ``--bptt`` steps, an embedding, ``nn.LSTM`` and a linear
decoder, the hidden state detached between windows, the mean cross-entropy, ``clip_grad_norm_`` and a plain SGD step.
``lm-zoo fit`` runs the same network (``configs/ptb/lstm-small.yaml``: 2 x 200, no dropout, SGD, the same clip) at the
same batch and BPTT, twice: as installed (with ``zoo.allocator``'s malloc settings, which ``lm-zoo`` applies at
start-up) and with ``LM_ZOO_MALLOC=default`` (glibc's defaults, as the plain loop runs). Each side runs in a fresh
process (its own peak RSS), the three alternated ``--rounds`` times, and tokens/s are taken over the steps after
``--warmup`` (process start, data loading and the first steps excluded):

    python benchmarks/fit_overhead.py                      # 2 threads, batch 20, BPTT 35, 400 timed steps, 3 rounds
    python benchmarks/fit_overhead.py --batch 64 --steps 200

It prints each side's median tokens/s and peak RSS and their ratios to the plain loop's. Run it on a quiet machine:
the sides share nothing but the cores, and a concurrent job changes any of them.
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
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def plain_loop(data_root: Path, batch: int, bptt: int, steps: int, warmup: int) -> float:
    """pytorch/examples' training loop on PTB: seconds per step over ``steps`` steps after ``warmup``."""
    import torch
    from torch import nn

    words = (data_root / "ptb" / "ptb.train.txt").read_text().replace("\n", " <eos> ").split()
    vocab = {word: i for i, word in enumerate(dict.fromkeys(words))}
    ids = torch.tensor([vocab[word] for word in words])
    columns = ids[: ids.numel() // batch * batch].view(batch, -1).t().contiguous()  # (N, B), the examples' batchify

    class RNNModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Embedding(len(vocab), 200)
            self.rnn = nn.LSTM(200, 200, 2)
            self.decoder = nn.Linear(200, len(vocab))
            for weight in (self.encoder.weight, self.decoder.weight):
                nn.init.uniform_(weight, -0.1, 0.1)
            nn.init.zeros_(self.decoder.bias)

        def forward(self, x: torch.Tensor, hidden: tuple) -> tuple:
            output, hidden = self.rnn(self.encoder(x), hidden)
            return self.decoder(output), hidden

    torch.manual_seed(1)
    model, criterion, lr = RNNModel().train(), nn.CrossEntropyLoss(), 20.0
    hidden = tuple(torch.zeros(2, batch, 200) for _ in range(2))
    start = None
    for step, i in enumerate(range(0, (warmup + steps) * bptt, bptt)):
        if step == warmup:
            start = time.perf_counter()
        i %= columns.size(0) - 1 - bptt
        data, targets = columns[i : i + bptt], columns[i + 1 : i + 1 + bptt].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output.view(-1, len(vocab)), targets)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
    return (time.perf_counter() - start) / steps


class StepTimer(L.Callback):
    """Added to ``lm-zoo fit`` by ``--trainer.callbacks+=benchmarks.fit_overhead.StepTimer``: writes the seconds per
    training step after ``warmup`` steps, with the process's peak RSS, to ``$FIT_OVERHEAD_OUT``, then stops the run.

    Args:
        warmup: steps before the timing starts.
        steps: timed steps.
    """

    def __init__(self, warmup: int = 20, steps: int = 400) -> None:
        self.warmup, self.steps = warmup, steps
        self.start: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.warmup + self.steps and self.start is not None:
            write_result((time.perf_counter() - self.start) / self.steps)
            trainer.should_stop = True


def write_result(seconds_per_step: float) -> None:
    """The child's measurement and its own peak RSS (bytes), for the parent."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kB
    Path(os.environ["FIT_OVERHEAD_OUT"]).write_text(json.dumps({"seconds_per_step": seconds_per_step, "peak": peak}))


FIT = "lm-zoo fit"
FIT_GLIBC_DEFAULTS = "lm-zoo fit, glibc's malloc defaults"


def run_side(side: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One side in a fresh process: seconds per step and the process's peak RSS (bytes)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "FIT_OVERHEAD_OUT": str(out), "PYTHONPATH": str(ROOT)}
    if side == FIT_GLIBC_DEFAULTS:
        env["LM_ZOO_MALLOC"] = "default"
    if side == "plain":
        command = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    else:
        run_dir = tempfile.mkdtemp(dir=out.parent)  # one per run: LightningCLI refuses to overwrite its config.yaml
        command = [
            str(Path(sys.executable).with_name("lm-zoo")), "fit", "--config", str(ROOT / "configs/ptb/lstm-small.yaml"),
            f"--data.init_args.batch_size={args.batch}", f"--data.init_args.bptt={args.bptt}",
            f"--data.init_args.data_root={args.data_root}", "--trainer.max_epochs=100", "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={run_dir}",
            "--trainer.callbacks+=benchmarks.fit_overhead.StepTimer",
            f"--trainer.callbacks.init_args.warmup={args.warmup}", f"--trainer.callbacks.init_args.steps={args.steps}",
        ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return {"tokens_per_s": args.batch * args.bptt / result["seconds_per_step"], "peak": result["peak"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--steps", type=int, default=400, help="timed training steps per side and round")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timing starts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-root", type=Path, default=Path(os.environ.get("LM_ZOO_DATA", "~/.cache/lm-zoo/data")))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.data_root = args.data_root.expanduser()
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        write_result(plain_loop(args.data_root, args.batch, args.bptt, args.steps, args.warmup))
        return
    results: dict[str, list[dict[str, float]]] = {"plain": [], FIT_GLIBC_DEFAULTS: [], FIT: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for side in results:  # alternated, so that a change in the machine's load touches both
                results[side].append(run_side(side, args, Path(tmp) / "result.json"))
    print(f"== 2 x 200 LSTM on PTB, batch {args.batch}, BPTT {args.bptt}, {args.threads} threads, {args.steps} steps")
    speed = {side: statistics.median(r["tokens_per_s"] for r in runs) for side, runs in results.items()}
    peak = {side: statistics.median(r["peak"] for r in runs) for side, runs in results.items()}
    for side, runs in results.items():
        each = ", ".join(f"{r['tokens_per_s']:.0f}" for r in runs)
        print(f"  {side:<36} {speed[side]:8.0f} tokens/s (median of {each}), peak RSS {peak[side] / 2**20:.0f} MiB")
    for side in (FIT_GLIBC_DEFAULTS, FIT):
        ratios = f"{speed[side] / speed['plain']:.2f}x tokens/s, {peak[side] / peak['plain']:.2f}x peak RSS"
        print(f"  {side} / plain: {ratios}")


if __name__ == "__main__":
    main()
