"""What the evaluation procedures cost, measured side by side on one model and one slice of PTB.

Each line times one procedure over the same ``--tokens`` of the PTB validation split and prints its cost relative
to the deterministic pass measured in the same run (so a busy machine slows both sides alike):

* the temperature search over kept features vs re-running the pass for every trial temperature;
* MC dropout with N replicas batched into one call per window vs N separate sampled passes (what the batching saves);
* dynamic evaluation (one stream, a gradient step per segment) vs a deterministic pass at the same batch size 1;
* the gradient statistics per training batch of 1024 streams.

The model is a checkpoint (``--checkpoint``) or, by default, a PTB-size 2 x 200 LSTM with random weights (the costs
do not depend on the weights). Example::

    LM_ZOO_DATA=../shared/data python benchmarks/evaluation_procedures.py --tokens 5000 --samples 50
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from datamodules.data_modules import TextDataModule  # noqa: E402
from datamodules.windows import StreamWindows  # noqa: E402
from evaluation.deterministic import deterministic_nll  # noqa: E402
from evaluation.dynamic import (  # noqa: E402
    DynamicEvaluation,
    adapting,
    dynamic_nll,
    mean_squared_gradients,
)
from evaluation.mc_dropout import MCDropout, mc_nll  # noqa: E402
from evaluation.temperature import (  # noqa: E402
    TEMPERATURE_TOLERANCE,
    FeatureCache,
    TemperatureSearch,
    collect_features,
    golden_section_search,
    total_nll,
)
from zoo.language_model import RecurrentLM  # noqa: E402


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a .ckpt or export (default: a random 2 x 200 LSTM with dropout 0.3)")
    parser.add_argument("--tokens", type=int, default=5000, help="validation tokens scored by each procedure")
    parser.add_argument("--batch-size", type=int, default=10, help="eval streams (deterministic, temperature, MC)")
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--samples", type=int, default=50, help="MC dropout samples N")
    parser.add_argument("--segment", type=int, default=10, help="dynamic evaluation's max_time_steps")
    parser.add_argument("--stat-batches", type=int, default=3, help="training batches of 1024 streams timed")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    datamodule = TextDataModule("ptb")
    if args.checkpoint:
        import checkpoints

        loaded = checkpoints.load(args.checkpoint)
        model = loaded.model
        datamodule.load_state_dict({"tokenizer": loaded.tokenizer.state_dict()})
    else:
        torch.manual_seed(0)
        model = RecurrentLM(datamodule.vocab_size, "lstm", embedding_size=200, hidden_size=200, dropout=0.3)
    model.eval().to(args.device)
    ids = torch.as_tensor(datamodule.encoded("valid")[: args.tokens].astype("int64"))
    eos = datamodule.tokenizer.eos_id

    def windows(batch_size: int, bptt: int) -> StreamWindows:
        return StreamWindows(ids, batch_size=batch_size, bptt=bptt, start_id=eos)

    stream = windows(args.batch_size, args.bptt)
    print(
        f"{args.tokens:,} PTB validation tokens, {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{torch.get_num_threads()} threads, {args.device}; eval batch {args.batch_size}, BPTT {args.bptt}"
    )
    base = min(timed(lambda: total_nll(deterministic_nll(model, stream))) for _ in range(2))
    print(f"deterministic pass                         {base:8.2f} s   1.00")

    def search(cache: FeatureCache | None, tolerance: float) -> TemperatureSearch:
        def loss(t: float) -> float:
            nats, count = cache.loss(t) if cache is not None else total_nll(deterministic_nll(model, stream, t))
            return nats / count

        return golden_section_search(loss, tolerance=tolerance)

    found: list[TemperatureSearch] = []
    cached = timed(lambda: found.append(search(collect_features(model, stream), TEMPERATURE_TOLERANCE)))
    trials = len(found[0].evaluations)
    print(f"temperature search, features kept          {cached:8.2f} s   {cached / base:5.2f} x  ({trials} trials)")
    # Re-running every trial costs a pass per trial: time a coarse search and scale it to the same number of trials.
    rerun = timed(lambda: found.append(search(None, 0.1)))
    rerun *= trials / len(found[1].evaluations)
    print(
        f"temperature search, pass re-run per trial  {rerun:8.2f} s   {rerun / base:5.2f} x  "
        f"(keeping features: {rerun / cached:.1f} x faster)"
    )

    mc = MCDropout(args.samples)
    batched = timed(lambda: total_nll(mc_nll(model, stream, mc)))
    one = MCDropout(1)
    separate = timed(lambda: [total_nll(mc_nll(model, stream, one, seed=n)) for n in range(min(args.samples, 5))])
    separate *= args.samples / min(args.samples, 5)
    print(f"MC dropout, {args.samples} replicas batched           {batched:8.2f} s   {batched / base:5.2f} x")
    print(
        f"MC dropout, {args.samples} separate passes            {separate:8.2f} s   {separate / base:5.2f} x  "
        f"(batched: {separate / batched:.1f} x faster)"
    )

    statistics_windows = datamodule.stream("train", batch_size=1024, bptt=args.segment)
    stats_time = timed(lambda: mean_squared_gradients(model, statistics_windows, args.stat_batches))
    statistics = mean_squared_gradients(model, windows(4, args.segment), 1)
    print(f"gradient statistics, per batch of 1024 x {args.segment}  {stats_time / args.stat_batches:8.2f} s")
    segments = windows(1, args.segment)
    frozen = timed(lambda: total_nll(deterministic_nll(model, segments)))
    with adapting(model, statistics, DynamicEvaluation(max_time_steps=args.segment)) as adaptation:
        dynamic = timed(lambda: total_nll(dynamic_nll(model, segments, adaptation)))
    print(f"batch 1, segments of {args.segment}: deterministic       {frozen:8.2f} s   {frozen / base:5.2f} x")
    print(
        f"batch 1, segments of {args.segment}: dynamic             {dynamic:8.2f} s   {dynamic / base:5.2f} x  "
        f"({dynamic / frozen:.1f} x its deterministic pass)"
    )


if __name__ == "__main__":
    main()
