"""Validation perplexity of every zoo architecture after the same short training budget on real PTB.

Each architecture is built at the same width and depth (tied word vectors starting U(-0.1, 0.1), the cells at their
own default initialisation), trained for ``--steps`` windows of PTB (batch 20, BPTT 35,
Adam with beta1 = 0 as in Melis et al., gradient norm clipped to 1) from the same seed, and scored on the whole
validation split with the full softmax (eval batch 20, BPTT 50) before and after. This is a smoke comparison of
learning speed at a tiny budget, not a reproduction of any paper's number. Example::

    LM_ZOO_DATA=../shared/data python benchmarks/short_budget.py --steps 300 --hidden 128
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import zoo  # noqa: E402
from datamodules.data_modules import TextDataModule  # noqa: E402
from evaluation.perplexity import evaluate  # noqa: E402
from lightning_modules.language_model import LanguageModel  # noqa: E402


def ptb(data_root: str | None = None) -> TextDataModule:
    """PTB with this script's batch sizes."""
    return TextDataModule("ptb", batch_size=20, bptt=35, eval_batch_size=20, eval_bptt=50, data_root=data_root)


def train_briefly(
    architecture: str,
    datamodule: TextDataModule,
    steps: int,
    hidden_size: int = 32,
    num_layers: int = 1,
    lr: float = 3e-3,
    seed: int = 0,
    cell_options: dict[str, Any] | None = None,
    eval_tokens: int | None = None,
) -> dict[str, Any]:
    """Train a fresh model for ``steps`` windows and report validation perplexity before and after.

    ``eval_tokens``: score only the validation windows up to the one holding this many tokens (the same windows
    before and after); ``None``: the whole split.

    Returns:
        ``architecture, parameters, steps, ppl_before, ppl_after, seconds`` (training time only).
    """
    torch.manual_seed(seed)
    model = LanguageModel(
        vocab_size=datamodule.vocab_size,
        architecture=architecture,
        embedding_size=hidden_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        tie_weights=True,
        embedding_init_range=0.1,  # N(0, 1) word vectors (nn.Embedding's default) give huge initial logits when tied
        cell_options=cell_options,
    )
    before = evaluate(model.model, datamodule, "valid", max_tokens=eval_tokens).ppl
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.0, 0.999))
    model.train()
    model.on_train_epoch_start()  # a fresh carried state
    start = time.perf_counter()
    with warnings.catch_warnings():
        # training_step's self.log has no Trainer to log to here; the loss it returns is the one `fit` optimises.
        warnings.filterwarnings("ignore", message=".*self.trainer.* reference is not registered")
        for step, batch in enumerate(datamodule.stream("train")):
            if step == steps:
                break
            loss = model.training_step(batch, step)["loss"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    seconds = time.perf_counter() - start
    after = evaluate(model.model, datamodule, "valid", max_tokens=eval_tokens).ppl
    return {
        "architecture": architecture,
        "parameters": sum(p.numel() for p in model.model.rnn.parameters()),
        "steps": steps,
        "ppl_before": before,
        "ppl_after": after,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=None, help="zoo architectures (default: all)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hidden", type=int, default=128, help="embedding and hidden size")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--data-root", default=None)
    args = parser.parse_args(argv)
    datamodule = ptb(args.data_root)
    print(f"# PTB, {args.steps} steps of batch 20 x BPTT 35, {args.layers} x {args.hidden}, tied, Adam lr {args.lr}")
    print("| architecture | stack parameters | valid ppl before | valid ppl after | train seconds |")
    print("|---|---:|---:|---:|---:|")
    for name in args.arch or zoo.names():
        r = train_briefly(name, datamodule, args.steps, args.hidden, args.layers, args.lr)
        print(f"| {name} | {r['parameters']:,} | {r['ppl_before']:.0f} | {r['ppl_after']:.1f} | {r['seconds']:.1f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
