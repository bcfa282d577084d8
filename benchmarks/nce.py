"""NCE against the full softmax at Google Billion Word's vocabulary (V = 793,471), measured side by side in one run.

Three measurements, each printed with its ratio:

1. **Noise sampler.** Draws of ``bptt x k`` noise words (one training window's worth, shared by the batch) from a
   Zipf(1) unigram distribution over V words: Walker's alias table (``zoo.nce.alias_table``) against
   ``torch.multinomial``, and the one-off cost of building the table.
2. **Training step.** Forward, backward, gradient-norm clipping and the SGD update (no momentum: the 4 x 2048 recipe)
   of a 2-layer LSTM stack of width H and the output layer over V words, on ``(batch, bptt, H)`` random input vectors
   (what the embedding would give; the ``(V, H)`` embedding table itself is left out: it costs every head the same
   and would double the parameter memory): the full softmax's cross-entropy against NCE's loss with k noise words
   per step, with the output layer's gradient dense ``(V, H)`` (``nce``) and row-sparse (``nce/sparse``: the model's
   ``sparse_gradients``, only the target and noise rows). Peak memory is what the step allocates above the
   parameters, printed twice: for the step as trained, and for the same step with the output layer frozen, i.e. the
   activations and temporaries: the accounting of the Torch blog's memory figure ("not counting parameters and their
   gradients"). Each (head, H) runs in its own process: on CPU the peak is the resident-set high-water mark (reset
   through ``/proc/self/clear_refs`` just before the step), on CUDA ``torch.cuda.max_memory_allocated``.
   ``--heads ... adaptive`` adds the adaptive softmax (Grave et al. 2017, ``zoo.heads.AdaptiveSoftmaxHead``), e.g.
   at WikiText-2's vocabulary: ``--only step --vocab 33278 --hidden 650 --batch 20 --bptt 35 --heads softmax
   adaptive``.
3. **Evaluation.** The chunked full softmax (``SoftmaxHead.token_nll``) of an untrained 2 x H LSTM over the GBW
   sample's test shard (``news.en.heldout-00013``) through ``GBWDataModule``'s multi-sequence windows (state reset at
   every sentence), vocabulary from shards 10-11 (count >= 3) padded with never-seen ids up to ``--eval-vocab``
   words, at a useful batch size and at batch 1 as in the blog's 3-hour test pass. Same tokens and window length,
   each batch size in its own process.

The paper-size step is batch 128 x bptt 50. On a CPU the full softmax at H = 2048 cannot hold that
(6400 x 793k logits are 20 GB, twice over with their gradient, next to 13 GB of output weights and gradients), so use
``--batch``/``--bptt`` to scale the step down there; the output says which sizes ran. A configuration that would not
fit in the memory available is skipped with a line saying so. Examples::

    python benchmarks/nce.py --device cuda                                    # the paper's sizes
    python benchmarks/nce.py --batch 8 --bptt 20 --eval-tokens 4000          # a CPU
    python benchmarks/nce.py --only sampler                                   # one part
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import zoo  # noqa: E402
from datamodules.gbw import GBWDataModule  # noqa: E402
from datamodules.windows import IGNORE_INDEX  # noqa: E402
from lightning_modules.sparse_gradients import clip_grad_norm  # noqa: E402
from zoo.heads import AdaptiveSoftmaxHead, SoftmaxHead  # noqa: E402
from zoo.language_model import RecurrentLM  # noqa: E402
from zoo.nce import NCEHead, UnigramNoise  # noqa: E402

GBW_VOCAB = 793_471
SAMPLE = Path(os.environ.get("LM_ZOO_DATA", Path.home() / ".cache" / "lm-zoo" / "data")) / "gbw-sample"
GIB = 2**30


def zipf_counts(vocab_size: int) -> torch.Tensor:
    """Counts ∝ 1/rank: the shape of a word unigram distribution (GBW's is close to it)."""
    return 1e9 / torch.arange(1, vocab_size + 1, dtype=torch.float64)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ memory probes
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class PeakMemory:
    """Bytes allocated above the level at entry, at the highest point inside the ``with`` block.

    CUDA: the caching allocator's own counters. CPU: torch's allocations are plain ``malloc``/``mmap``, invisible to
    ``tracemalloc``, so this reads the kernel's resident-set high-water mark (VmHWM), reset at entry by writing 5 to
    ``/proc/self/clear_refs``; pages that glibc kept from earlier frees make it read low, never high.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = _status_kib("VmHWM") * 1024 - self.base


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------------------------------- 1. sampler
def sampler_benchmark(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    draws = args.bptt_sampler * args.k
    print(
        f"\n== noise sampler: {draws:,} draws (bptt {args.bptt_sampler} x k {args.k}) from Zipf over V = "
        f"{args.vocab:,}, {args.device}"
    )
    counts = zipf_counts(args.vocab)
    noise = {}
    for sampler in ("alias", "multinomial"):
        start = time.perf_counter()
        noise[sampler] = UnigramNoise(args.vocab, sampler=sampler).to(device)
        noise[sampler].set_counts(counts)
        sync(device)
        print(f"  set-up {sampler:<11} {time.perf_counter() - start:8.3f} s  (table built on the CPU, once)")
    # Interleaved, so that both see the same load; the minimum is the cost without preemption on a shared machine.
    times: dict[str, list[float]] = {"alias": [], "multinomial": []}
    for sampler in times:
        noise[sampler].sample((args.bptt_sampler, args.k))  # warm-up
    for _ in range(args.repeats):
        for sampler, seconds in times.items():
            sync(device)
            start = time.perf_counter()
            noise[sampler].sample((args.bptt_sampler, args.k))
            sync(device)
            seconds.append(time.perf_counter() - start)
    for sampler, seconds in times.items():
        print(
            f"  draw   {sampler:<11} {statistics.median(seconds) * 1e3:8.3f} ms per window (median), "
            f"{min(seconds) * 1e3:.3f} ms (min)"
        )
    ratio_median = statistics.median(times["multinomial"]) / statistics.median(times["alias"])
    ratio_min = min(times["multinomial"]) / min(times["alias"])
    print(f"  multinomial / alias: {ratio_median:.1f}x (medians), {ratio_min:.1f}x (minima)")


# ---------------------------------------------------------------------------------------------- 2. training step
def step_worker(config: dict[str, Any]) -> dict[str, Any]:
    """One (head, hidden) configuration: peak memory of a step, of a step without the output layer's gradient, then
    the median time of full steps. ``head`` is ``softmax``, ``nce``, ``sampled_softmax`` (``/sparse`` appended for
    the row-sparse output gradient) or ``adaptive`` (Grave et al.'s adaptive softmax, default cutoffs)."""
    device = torch.device(config["device"])
    vocab, hidden, batch, bptt = config["vocab"], config["hidden"], config["batch"], config["bptt"]
    torch.manual_seed(0)
    rnn = zoo.build("lstm", hidden, hidden, config["layers"]).to(device)
    objective, _, sparse = config["head"].partition("/")
    if objective == "softmax":
        head: SoftmaxHead | AdaptiveSoftmaxHead = SoftmaxHead(hidden, vocab).to(device)
    elif objective == "adaptive":
        head = AdaptiveSoftmaxHead(hidden, vocab).to(device)
    else:
        head = NCEHead(
            hidden, vocab, config["k"], objective, sampler=config["sampler"], sparse_gradient=sparse == "sparse"
        ).to(device)
        head.set_noise_distribution(zipf_counts(vocab))
    words = UnigramNoise(vocab).to(device)
    words.set_counts(zipf_counts(vocab))
    inputs = 0.1 * torch.randn(batch, bptt, hidden, device=device)  # (B, T, H) what the embedding would give
    targets = words.sample((batch, bptt))  # (B, T) Zipf-distributed, like text
    parameters = list(rnn.parameters()) + list(head.parameters())
    optimizer = torch.optim.SGD(parameters, lr=1e-3)  # the update's cost, not its size, is what is measured

    def clear_gradients() -> None:
        for p in parameters:
            p.grad = None  # Lightning's zero_grad(set_to_none=True): the step allocates the gradients itself

    def step() -> None:
        clear_gradients()
        features, _ = rnn(inputs)  # (B, T, H)
        total, count = head.training_loss(features, targets)  # each head's objective, as the LanguageModel's step
        (total / count).backward()
        clip_grad_norm(parameters, config["clip"])  # the model's clipping, which sparse gradients need
        optimizer.step()

    step()  # warm-up: lazily loaded kernels and thread pools stay resident and are no part of the step's cost
    clear_gradients()
    with PeakMemory(device) as memory:
        step()
    # The same step with the output layer frozen: no (V, H) gradient, dense for both heads, exists at any moment, so
    # the peak is the activations and temporaries (plus the LSTM's small gradients): the blog's accounting, which
    # leaves out parameters and their gradients. (Subtracting the gradient's size from the first peak would be wrong:
    # the full softmax peaks in its backward before that gradient is allocated.)
    clear_gradients()
    head.requires_grad_(False)
    with PeakMemory(device) as without_output_gradient:
        step()
    head.requires_grad_(True)
    seconds = timed(step, device, config["steps"])
    return {
        "seconds": seconds,  # the warm-up and measured steps above are not timed
        "peak": memory.peak,
        "peak_without_output_gradient": without_output_gradient.peak,
        "parameters": sum(p.numel() * p.element_size() for p in parameters),
    }


def run_worker(kind: str, config: dict[str, Any], threads: int | None) -> dict[str, Any] | str:
    """Run a worker in a fresh process (its own memory high-water mark); a string says why it did not finish."""
    # glibc keeps freed blocks under its (adaptive, up to 32 MiB) mmap threshold for reuse, so they would not show in
    # the high-water mark of the measured step; a fixed 1 MiB threshold returns every sizeable block to the kernel.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            kind,
            json.dumps(config),
            *(["--threads", str(threads)] if threads else []),
        ],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"failed: {tail}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_memory_estimate(head: str, vocab: int, hidden: int, batch: int, bptt: int, k: int) -> int:
    """A rough upper bound of a step's bytes, to skip what cannot fit: output weights and gradient, LSTM, logits."""
    weights = 2 * 4 * vocab * hidden + 2 * 4 * 2 * 4 * hidden * 2 * hidden
    activations = 3 * 4 * batch * bptt * vocab if head == "softmax" else 4 * 4 * bptt * k * hidden
    return weights + activations + 40 * 4 * batch * bptt * hidden


def step_benchmark(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    print(
        f"\n== training step: 2-layer LSTM + output layer over V = {args.vocab:,}, batch {args.batch} x bptt "
        f"{args.bptt}, k = {args.k} ({args.sampler}), {args.device}"
    )
    if (args.batch, args.bptt) != (128, 50):
        print("   (the paper's recipes use batch 128 x bptt 50; this run is scaled down to fit the machine)")
    print(f"   {'H':>5} {'head':<16} {'step':>9} {'peak':>10} {'w/o out grad':>13} {'parameters':>11}")
    for hidden in args.hidden:
        results: dict[str, dict[str, Any]] = {}
        for head in args.heads:
            need = step_memory_estimate(head, args.vocab, hidden, args.batch, args.bptt, args.k)
            if need > 0.9 * available_bytes(device):
                print(
                    f"   {hidden:>5} {head:<16} skipped: needs ~{need / GIB:.1f} GiB, "
                    f"{available_bytes(device) / GIB:.1f} GiB available (lower --batch/--bptt)"
                )
                continue
            config = dict(vars(args), hidden=hidden, head=head)
            config = {
                key: config[key]
                for key in (
                    "device",
                    "vocab",
                    "hidden",
                    "batch",
                    "bptt",
                    "layers",
                    "k",
                    "sampler",
                    "head",
                    "steps",
                    "clip",
                )
            }
            result = run_worker("step", config, args.threads)
            if isinstance(result, str):
                print(f"   {hidden:>5} {head:<16} {result}")
                continue
            results[head] = result
            print(
                f"   {hidden:>5} {head:<16} {result['seconds'] * 1e3:7.1f}ms {result['peak'] / GIB:8.3f}G "
                f"{result['peak_without_output_gradient'] / GIB:13.3f}G {result['parameters'] / GIB:9.3f}G"
            )
        if "softmax" in results:
            base = results["softmax"]
            for head, result in results.items():
                if head == "softmax":
                    continue
                print(
                    f"   {hidden:>5} {head} / softmax: step {result['seconds'] / base['seconds']:.3f}x, "
                    f"peak {result['peak'] / base['peak']:.3f}x, peak without the output gradient "
                    f"{result['peak_without_output_gradient'] / base['peak_without_output_gradient']:.3f}x"
                )


# ------------------------------------------------------------------------------------------------- 3. evaluation
def eval_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Score the test shard (or its first ``eval_tokens`` predicted tokens) at one batch size, as ``evaluate`` does:
    ``RecurrentLM.token_nll`` over the GBW data module's multi-sequence windows, state carried, reset per sentence."""
    device = torch.device(config["device"])
    data = GBWDataModule(
        config["data"],
        train_files=config["vocab_files"],
        valid_files=config["test_file"],
        test_files=config["test_file"],
        min_count=config["min_count"],
    )
    vocab = max(data.vocab_size, config["eval_vocab"])  # ids past the sample's vocabulary never occur
    torch.manual_seed(0)
    hidden = config["hidden"]
    model = RecurrentLM(vocab, "lstm", hidden, hidden, 2, init_range=0.1).to(device).eval()
    model.decoder.chunk_logits = config["chunk_logits"]
    stream = data.stream("test", config["batch"], config["bptt"])
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    with torch.no_grad(), PeakMemory(device) as memory:
        sync(device)
        start = time.perf_counter()
        state = None
        for batch in stream:
            targets = batch.targets.to(device)
            reset = None if batch.reset is None else batch.reset.to(device)
            nll, state = model.token_nll(batch.inputs.to(device), targets, state, reset)
            total += nll.double().sum()
            tokens += int((targets != IGNORE_INDEX).sum())
            if tokens >= config["eval_tokens"]:
                break
        sync(device)
        seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "tokens": tokens,
        "peak": memory.peak,
        "vocab": vocab,
        "sample_vocab": data.vocab_size,
        "loss": float(total) / tokens,
    }


def eval_benchmark(args: argparse.Namespace) -> None:
    test_file = "news.en.heldout-00013-of-00050"
    vocab_files = "news.en.heldout-0001[0-1]-of-00050"
    if not (args.data / test_file).exists():
        print(f"\n== evaluation: skipped, no {args.data / test_file} (set LM_ZOO_DATA or --data)")
        return
    limit = "the whole shard" if args.eval_tokens is None else f"its first {args.eval_tokens:,} predicted tokens"
    print(
        f"\n== evaluation: chunked full softmax (<= {args.chunk_logits:,} logits at once), untrained 2 x "
        f"{args.eval_hidden} LSTM, {test_file}, {limit}, bptt {args.eval_bptt}, vocabulary of shards 10-11 with "
        f"count >= {args.min_count}, {args.device}"
    )
    results = {}
    for batch in (args.eval_batch, 1):
        config = {
            "device": args.device,
            "data": str(args.data),
            "test_file": test_file,
            "vocab_files": vocab_files,
            "min_count": args.min_count,
            "eval_tokens": args.eval_tokens or 10**12,
            "eval_vocab": args.eval_vocab,
            "hidden": args.eval_hidden,
            "batch": batch,
            "bptt": args.eval_bptt,
            "chunk_logits": args.chunk_logits,
        }
        result = run_worker("eval", config, args.threads)
        if isinstance(result, str):
            print(f"   batch {batch:>4}: {result}")
            continue
        results[batch] = result
        unchunked = batch * args.eval_bptt * result["vocab"] * 4
        print(
            f"   batch {batch:>4}: {result['seconds']:8.2f} s for {result['tokens']:,} tokens "
            f"({result['tokens'] / result['seconds']:8.0f} tokens/s), V = {result['vocab']:,} "
            f"({result['sample_vocab']:,} from the sample), peak {result['peak'] / GIB:.3f} GiB "
            f"(unchunked logits alone: {unchunked / GIB:.2f} GiB)"
        )
    if len(results) == 2:
        fast, slow = results[args.eval_batch], results[1]
        per_token = (slow["seconds"] / slow["tokens"]) / (fast["seconds"] / fast["tokens"])
        print(f"   batch 1 / batch {args.eval_batch} time per token: {per_token:.1f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--vocab", type=int, default=GBW_VOCAB, help="V (default: GBW's 793,471)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[250, 2048], help="LSTM widths H of the step")
    parser.add_argument("--layers", type=int, default=2, help="LSTM layers of the step")
    parser.add_argument("--batch", type=int, default=128, help="step batch size (paper: 128)")
    parser.add_argument("--bptt", type=int, default=50, help="step window length (paper: 50)")
    parser.add_argument("--k", type=int, default=400, help="noise words per step (paper: 400)")
    parser.add_argument("--sampler", default="alias", choices=["alias", "multinomial"], help="NCE's noise sampler")
    parser.add_argument(
        "--heads",
        nargs="+",
        default=["softmax", "nce", "nce/sparse"],
        choices=["softmax", "nce", "nce/sparse", "sampled_softmax", "sampled_softmax/sparse", "adaptive"],
        help="objectives to time (softmax first); /sparse: row-sparse output-layer gradient",
    )
    parser.add_argument("--clip", type=float, default=0.2, help="gradient-norm clip of the step (recipe: 10 / 50)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (median)")
    parser.add_argument("--repeats", type=int, default=50, help="timed sampler draws (median)")
    parser.add_argument("--bptt-sampler", type=int, default=50, help="steps per window of the sampler timing")
    parser.add_argument("--data", type=Path, default=SAMPLE, help="the GBW sample directory")
    parser.add_argument("--eval-batch", type=int, default=128, help="the useful evaluation batch size")
    parser.add_argument("--eval-bptt", type=int, default=50, help="evaluation window length")
    parser.add_argument("--eval-hidden", type=int, default=250, help="LSTM width of the evaluated model")
    parser.add_argument(
        "--eval-vocab",
        type=int,
        default=GBW_VOCAB,
        help="output layer size: the sample's vocabulary padded with unseen ids (0: unpadded)",
    )
    parser.add_argument("--eval-tokens", type=int, default=None, help="score only this many tokens of the shard")
    parser.add_argument("--min-count", type=int, default=3, help="vocabulary cutoff on shards 10-11 (GBW's: 3)")
    parser.add_argument("--chunk-logits", type=int, default=2**24, help="the chunked softmax's budget, in logits")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 on a loaded machine, where multi-threaded ops wait "
        "on each other's preempted threads",
    )
    parser.add_argument("--only", choices=["sampler", "step", "eval"], help="run one part")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        kind, config = args.worker
        result = (step_worker if kind == "step" else eval_worker)(json.loads(config))
        print(json.dumps(result))
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}; noisy if the machine "
        "is shared: compare the ratios, which are measured side by side"
    )
    if args.only in (None, "sampler"):
        sampler_benchmark(args)
    if args.only in (None, "step"):
        step_benchmark(args)
    if args.only in (None, "eval"):
        eval_benchmark(args)


if __name__ == "__main__":
    main()
