"""``lm-zoo fit`` against the plain training loop the peers run, on the same model and data, side by side.

The baseline is pytorch/examples' ``word_language_model/main.py`` loop, written out here (nothing vendored): PTB's
training text batchified into ``--batch`` columns, windows of ``--bptt`` steps, an embedding, ``nn.LSTM`` and a linear
decoder, the hidden state detached between windows, the mean cross-entropy, ``clip_grad_norm_`` and a plain SGD step.
``lm-zoo fit`` runs the same network (``configs/ptb/lstm-small.yaml``: 2 x 200, no dropout, SGD, the same clip) at the
same batch and BPTT. The allocator is set on both sides alike, so that each ratio compares like with like:

- the plain loop with glibc's malloc defaults (as the peers run it), and with ``zoo.allocator``'s settings (the
  ``mallopt`` calls ``lm-zoo`` makes at start-up, made here at the worker's start);
- ``lm-zoo fit`` as installed (those settings, lm-zoo's own training step), with ``LM_ZOO_MALLOC=default`` (glibc's
  defaults), and with ``LM_ZOO_TRAINING_STEP=lightning`` (Lightning's closure running each step, as before
  ``lightning_modules/training_step.py``: what that step gives, measured side by side);
- ``lm-zoo fit`` with ``--data.init_args.windows_per_step`` (``--windows-per-step`` here, 8 by default): each
  Lightning step trains that many consecutive windows, one update each, so Lightning's per-step work (its loop, the
  callbacks, the loader's fetch) is paid once for them; its "ms a step" is per window, as every side's;
- lm-zoo's network (``zoo.RecurrentLM``, built from the same config) and ``torch.optim.SGD`` in the plain loop, with
  lm-zoo's settings: what separates the two like-for-like sides is then split in two, the network's own cost against
  ``nn.LSTM``'s and the training loop's around it (Lightning's loop, hooks and callbacks, and ``LanguageModel``'s
  bookkeeping: carried state, metrics, the divergence check).

``--width 8 --corpus ptb-char`` shrinks every side's network to 2 x 8 units over PTB's 50 characters, where a step's
arithmetic is a few hundred microseconds: the differences in milliseconds per step are then what each side's Python
costs, free of the memory-bound softmax whose speed moves from process to process by more than those costs.

Each side runs in a fresh process (its own peak RSS), the sides alternated ``--rounds`` times, and tokens/s are taken
over the steps after ``--warmup`` (process start, data loading and the first steps excluded)::

    python benchmarks/fit_overhead.py                      # 2 threads, batch 20, BPTT 35, 400 timed steps, 3 rounds
    python benchmarks/fit_overhead.py --batch 64 --steps 200
    python benchmarks/fit_overhead.py --profile --steps 200   # where each like-for-like side's step goes (cProfile)
    python benchmarks/fit_overhead.py --width 8 --corpus ptb-char --steps 1000   # the per-step cost of each loop
    python benchmarks/fit_overhead.py --device cuda --rounds 1 --steps 200        # on a GPU (three sides, below)

On a GPU (``--device cuda``) the sides are the plain loop, lm-zoo's network in it, the bare Trainer and ``lm-zoo fit``
with one window a step and several (the allocator settings are the host's and move nothing there), each step's time
taken between two synchronisations of the device,
and cuDNN's TF32 off in the plain loop as lm-zoo's default matmul precision has it (``highest``), so that both sides
compute in float32.

It prints each side's median tokens/s, milliseconds per step and peak RSS, lm-zoo's overhead at the same allocator
settings (the like-for-like ratios, and what each costs more a step), lm-zoo as shipped against the plain loop as the
peers run it, and what the allocator settings give each loop.
Every round, the medians, the ratios, the command, torch, the threads and the hardware go to a new results file
(``--out``, or ``benchmarks/results/fit_overhead-<time>.json``); ``--resume`` adds this run's rounds to a file measured
with the same settings. Run it on a quiet machine: the sides share nothing but the cores, and a concurrent job changes
any of them (the file records the load average before and after).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks import output  # noqa: E402

NAME = "fit_overhead"  # results: a new benchmarks/results/fit_overhead-<time>.json, or --out
PROFILE_NAME = "fit_profile"  # --profile's results: benchmarks/results/fit_profile-<time>.json, or --out
CORPUS_FILES = {"ptb": "ptb.train.txt", "ptb-char": "ptb.char.train.txt"}  # --corpus: its training text under ptb/
CONFIG = ROOT / "configs/ptb/lstm-small.yaml"  # lm-zoo's side: the network, optimizer and clipping


def lm_zoo_network(vocab_size: int, width: int) -> tuple[Any, float, float]:
    """The network ``lm-zoo fit`` trains from :data:`CONFIG` (``zoo.RecurrentLM``, its settings read from the YAML)
    at ``width`` units, with the config's learning rate and clipping value."""
    import yaml

    from zoo.language_model import LMConfig, RecurrentLM

    config = yaml.safe_load(CONFIG.read_text())
    network = {field.name for field in dataclasses.fields(LMConfig)}
    options = {k: v for k, v in config["model"]["init_args"].items() if k in network}
    options |= {"vocab_size": vocab_size, "embedding_size": width, "hidden_size": width}
    lr, clip = config["optimizer"]["init_args"]["lr"], config["trainer"]["gradient_clip_val"]
    return RecurrentLM(**options), lr, clip


def plain_loop(
    data_root: Path,
    batch: int,
    bptt: int,
    steps: int,
    warmup: int,
    profiler: cProfile.Profile | None = None,
    width: int = 200,
    corpus: str = "ptb",
    network: str = "plain",
    device: str = "cpu",
) -> float:
    """pytorch/examples' training loop on PTB: seconds per step over ``steps`` steps after ``warmup`` (``profiler``:
    enabled over those steps). ``network="lm-zoo"``: lm-zoo's network and ``torch.optim.SGD`` in the same loop."""
    import torch
    from torch import nn

    words = (data_root / "ptb" / CORPUS_FILES[corpus]).read_text().replace("\n", " <eos> ").split()
    vocab = {word: i for i, word in enumerate(dict.fromkeys(words))}
    ids = torch.tensor([vocab[word] for word in words])
    columns = ids[: ids.numel() // batch * batch].view(batch, -1).t().contiguous().to(device)  # (N, B), batchify
    torch.backends.cudnn.allow_tf32 = False  # float32 in cuDNN's LSTM too, as lm-zoo's default precision has it

    class RNNModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Embedding(len(vocab), width)
            self.rnn = nn.LSTM(width, width, 2)
            self.decoder = nn.Linear(width, len(vocab))
            for weight in (self.encoder.weight, self.decoder.weight):
                nn.init.uniform_(weight, -0.1, 0.1)
            nn.init.zeros_(self.decoder.bias)

        def forward(self, x: torch.Tensor, hidden: tuple) -> tuple:
            output, hidden = self.rnn(self.encoder(x), hidden)
            return self.decoder(output), hidden

    torch.manual_seed(1)
    if network == "lm-zoo":
        return _lm_zoo_network_loop(columns, len(vocab), width, bptt, steps, warmup, profiler)
    if network == "lightning":
        return _bare_lightning_loop(RNNModel().to(device), columns, len(vocab), bptt, steps, warmup, device)
    model, criterion, lr = RNNModel().to(device).train(), nn.CrossEntropyLoss(), 20.0
    hidden = tuple(torch.zeros(2, batch, width, device=device) for _ in range(2))
    timing: dict[str, float] = {}
    for i in timed_windows(columns.size(0), bptt, steps, warmup, profiler, timing):
        data, targets = columns[i : i + bptt], columns[i + 1 : i + 1 + bptt].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output.view(-1, len(vocab)), targets)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
    return timing["seconds"]


def synchronize() -> None:
    """Wait for the GPU, where there is one in use: a clock read on the host then covers the work queued before."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_windows(
    length: int, bptt: int, steps: int, warmup: int, profiler: cProfile.Profile | None, timing: dict[str, float]
) -> Iterator[int]:
    """The start of each training window in a stream of ``length`` tokens, ``warmup + steps`` of them, wrapping
    around; the seconds per step over the last ``steps`` go to ``timing["seconds"]`` (``profiler``: enabled over
    them). The plain loops' clock, one for both."""
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            synchronize()
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
        yield step * bptt % (length - 1 - bptt)
    synchronize()
    timing["seconds"] = (time.perf_counter() - start) / steps
    if profiler is not None:
        profiler.disable()


def _lm_zoo_network_loop(
    columns: Any, vocab_size: int, width: int, bptt: int, steps: int, warmup: int, profiler: cProfile.Profile | None
) -> float:
    """The plain loop over the same ``(N, B)`` columns with lm-zoo's network, its batch-first windows, its summed
    cross-entropy over the window's count and ``torch.optim.SGD``: ``LanguageModel.training_step`` without Lightning
    and without its bookkeeping (metrics, the divergence check)."""
    import torch
    import torch.nn.functional as F

    from zoo.state import detach_state

    model, lr, clip = lm_zoo_network(vocab_size, width)
    model.to(columns.device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    rows = columns.t().contiguous()  # (B, N): lm-zoo's batch-first streams
    state = None
    timing: dict[str, float] = {}
    for i in timed_windows(rows.size(1), bptt, steps, warmup, profiler, timing):
        inputs, targets = rows[:, i : i + bptt], rows[:, i + 1 : i + 1 + bptt]  # (B, T) each
        optimizer.zero_grad()
        features, state, _, _ = model.run(inputs, state, None)
        state = detach_state(state)
        total = F.cross_entropy(model.decoder(features).flatten(0, 1), targets.flatten(), reduction="sum")
        (total / targets.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return timing["seconds"]


def _bare_lightning_loop(
    model: Any, columns: Any, vocab_size: int, bptt: int, steps: int, warmup: int, device: str
) -> float:
    """The plain loop's network and step inside Lightning's Trainer, with nothing of lm-zoo's: a LightningModule of a
    dozen lines (automatic optimization, SGD, ``gradient_clip_val``, no logger, checkpoint or progress bar). What
    Lightning's own loop costs a step, the floor of any Lightning application's overhead over the plain loop."""
    import torch
    import torch.nn.functional as F

    starts = (step * bptt % (columns.size(0) - 1 - bptt) for step in range(warmup + steps + 1))  # the plain loop's
    windows = [(columns[i : i + bptt], columns[i + 1 : i + 1 + bptt]) for i in starts]  # views, no copies

    class Bare(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.network, self.hidden = model, None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            data, targets = batch
            hidden = None if self.hidden is None else tuple(h.detach() for h in self.hidden)
            output, self.hidden = self.network(data, hidden)
            return F.cross_entropy(output.view(-1, vocab_size), targets.reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=20.0)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(windows, batch_size=None)

    timer = StepTimer(warmup, steps)
    timer.write = False
    trainer = L.Trainer(
        max_steps=warmup + steps + 1, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.25, callbacks=[timer],
        accelerator="gpu" if device == "cuda" else "cpu", devices=1,
    )  # fmt: skip
    trainer.fit(Bare())
    return timer.seconds


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
        self.write, self.seconds = True, 0.0  # write: to $FIT_OVERHEAD_OUT (lm-zoo fit's side), else kept here
        self.profiler = cProfile.Profile() if os.environ.get(PROFILE_VARIABLE) else None

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.warmup:
            synchronize()
            self.start = time.perf_counter()
            if self.profiler is not None:
                self.profiler.enable()

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.warmup + self.steps and self.start is not None:
            synchronize()
            seconds = self.seconds = (time.perf_counter() - self.start) / self.steps
            if self.profiler is not None:
                self.profiler.disable()
            if self.write:
                profile = {} if self.profiler is None else {"profile": top_functions(self.profiler, self.steps)}
                write_result(seconds, **profile)
            trainer.should_stop = True


PROFILE_VARIABLE = "FIT_OVERHEAD_PROFILE"  # set by --profile for the worker processes
PROFILE_ROWS = 25


def top_functions(profiler: cProfile.Profile, steps: int, rows: int = PROFILE_ROWS) -> list[dict[str, object]]:
    """The functions that took the most time of their own (cProfile's tottime) over the profiled steps, per step.

    C functions (a torch op, ``run_backward``) count their whole call; a Python function only its own lines, so
    the overhead of a framework shows as many small entries, which the total of Python functions sums up."""
    table = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    entries = []
    for (file, line, name), (_, calls, own, _, _) in table.items():
        where = name if file == "~" else f"{_short_path(file)}:{line}({name})"
        entries.append({"function": where, "calls_per_step": calls / steps, "ms_per_step": own / steps * 1e3})
    entries.sort(key=lambda entry: -entry["ms_per_step"])
    python = sum(entry["ms_per_step"] for entry in entries if not entry["function"].startswith(("<", "{")))
    return [*entries[:rows], {"function": "all Python functions (their own time)", "ms_per_step": python}]


def _short_path(file: str) -> str:
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in file:
            return file.split(marker, 1)[1]
    return Path(file).name


def write_result(seconds_per_step: float, **extra: object) -> None:
    """The child's measurement and its own peak RSS (bytes), for the parent."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kB
    result = {"seconds_per_step": seconds_per_step, "peak": peak, **extra}
    Path(os.environ["FIT_OVERHEAD_OUT"]).write_text(json.dumps(result))


PLAIN = "plain loop"
PLAIN_LM_ZOO_MALLOC = "plain loop, lm-zoo's malloc settings"
NETWORK = "lm-zoo's network in the plain loop, lm-zoo's malloc settings"
FIT_GLIBC_DEFAULTS = "lm-zoo fit, glibc's malloc defaults"
FIT = "lm-zoo fit"
FIT_LIGHTNING_STEP = "lm-zoo fit, Lightning's closure running each step"  # LM_ZOO_TRAINING_STEP=lightning
FIT_WINDOWS = "lm-zoo fit, several windows a step"  # --data.init_args.windows_per_step, --windows-per-step here
BARE_LIGHTNING = "the plain loop's network and step in a bare Lightning Trainer"
SIDES = (PLAIN, PLAIN_LM_ZOO_MALLOC, NETWORK, BARE_LIGHTNING, FIT_GLIBC_DEFAULTS, FIT_LIGHTNING_STEP, FIT, FIT_WINDOWS)
# On a GPU: no allocator settings to compare, and a side fewer to fit gpu_session.sh's limits (Lightning's closure,
# which the CPU's table compares).
SIDES_CUDA = (PLAIN, NETWORK, BARE_LIGHTNING, FIT, FIT_WINDOWS)
# (numerator, denominator, what the ratio says), each a ratio of median tokens/s (and of median peak RSS).
RATIOS = (
    (FIT, PLAIN_LM_ZOO_MALLOC, "lm-zoo's overhead, both with lm-zoo's malloc settings (like for like)"),
    (FIT_GLIBC_DEFAULTS, PLAIN, "lm-zoo's overhead, both with glibc's malloc defaults (like for like)"),
    (NETWORK, PLAIN_LM_ZOO_MALLOC, "what lm-zoo's network and torch.optim.SGD cost against nn.LSTM and a bare update"),
    # On a GPU, where the plain loop runs at one allocator setting (SIDES_CUDA): the same question.
    (NETWORK, PLAIN, "what lm-zoo's network and torch.optim.SGD cost against nn.LSTM and a bare update"),
    (FIT, NETWORK, "what the training loop around the network costs: Lightning's, and LanguageModel's bookkeeping"),
    (FIT, PLAIN, "lm-zoo as installed against the plain loop as the peers run it"),
    (PLAIN_LM_ZOO_MALLOC, PLAIN, "what lm-zoo's malloc settings give the plain loop"),
    (FIT, FIT_GLIBC_DEFAULTS, "what lm-zoo's malloc settings give lm-zoo fit"),
    (FIT, FIT_LIGHTNING_STEP, "what lm-zoo's own training step gives lm-zoo fit (lightning_modules/training_step.py)"),
    (BARE_LIGHTNING, PLAIN, "what Lightning's own loop costs, with nothing of lm-zoo's"),
    (FIT, BARE_LIGHTNING, "lm-zoo fit against the same network in a bare Lightning Trainer"),
    (FIT_WINDOWS, PLAIN_LM_ZOO_MALLOC, "lm-zoo fit with several windows a step, like for like"),
    (FIT_WINDOWS, PLAIN, "lm-zoo fit with several windows a step against the plain loop as the peers run it"),
    (FIT_WINDOWS, FIT, "what several windows a step give lm-zoo fit (Lightning's per-step work paid once for them)"),
)


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a side's process: the checkout first, then the caller's own. Replacing the caller's once hid
    jsonargparse, which a GPU machine's Python found through ``PYTHONPATH``, from the ``lm-zoo fit`` side."""
    return os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))


def timed_fit_command(work: Path, warmup: int, steps: int, *overrides: str) -> list[str]:
    """``lm-zoo fit`` of ``configs/ptb/lstm-small.yaml`` with ``overrides``, timed by :class:`StepTimer` (which stops
    it), with no validation, logger, progress bar or model summary, in a new run directory under ``work`` (one per
    run: LightningCLI refuses to overwrite its config.yaml)."""
    beside = Path(sys.executable).with_name("lm-zoo")  # this environment's; else the PATH's (a checkout's shim)
    return [
        str(beside) if beside.exists() else shutil.which("lm-zoo") or "lm-zoo", "fit", "--config", str(CONFIG),
        *overrides, "--trainer.max_epochs=100", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tempfile.mkdtemp(dir=work)}",
        "--trainer.callbacks+=benchmarks.fit_overhead.StepTimer",
        f"--trainer.callbacks.init_args.warmup={warmup}", f"--trainer.callbacks.init_args.steps={steps}",
    ]  # fmt: skip


def run_side(side: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One side in a fresh process: tokens per second and the process's peak RSS (bytes)."""
    windows = args.windows_per_step if side == FIT_WINDOWS else 1  # training windows in one of its steps
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "FIT_OVERHEAD_OUT": str(out)}
    env["PYTHONPATH"] = child_pythonpath()
    if args.profile:
        env[PROFILE_VARIABLE] = "1"
    if side == FIT_GLIBC_DEFAULTS:
        env["LM_ZOO_MALLOC"] = "default"
    if side == FIT_LIGHTNING_STEP:
        env["LM_ZOO_TRAINING_STEP"] = "lightning"
    elif side == FIT:
        env.pop("LM_ZOO_TRAINING_STEP", None)  # lm-zoo's default: its own step, captured on a GPU
    if side in (PLAIN, PLAIN_LM_ZOO_MALLOC, NETWORK, BARE_LIGHTNING):
        command = [sys.executable, __file__, "--worker", f"--batch={args.batch}", f"--bptt={args.bptt}"]
        command += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--threads={args.threads}"]
        command += [f"--data-root={args.data_root}", f"--width={args.width}", f"--corpus={args.corpus}"]
        command += [f"--device={args.device}"]
        command += ["--lm-zoo-malloc"] if side not in (PLAIN, BARE_LIGHTNING) else []
        command += ["--lm-zoo-network"] if side == NETWORK else []
        command += ["--bare-lightning"] if side == BARE_LIGHTNING else []
    else:
        # A step of several windows: the timer counts steps, so as many windows are timed as on the other sides.
        command = timed_fit_command(
            out.parent,
            -(-args.warmup // windows),
            args.steps // windows,
            f"--data.init_args.windows_per_step={windows}",
            f"--data.init_args.batch_size={args.batch}",
            f"--data.init_args.bptt={args.bptt}",
            f"--data.init_args.data_root={args.data_root}",
            f"--data.init_args.corpus={args.corpus}",
            f"--model.init_args.embedding_size={args.width}",
            f"--model.init_args.hidden_size={args.width}",
            *(["--trainer.accelerator=gpu", "--trainer.devices=1"] if args.device == "cuda" else []),
        )
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if side in (PLAIN_LM_ZOO_MALLOC, NETWORK) and not result["malloc_applied"]:
        output.fail(
            "lm-zoo's malloc settings did not apply in this environment (MALLOC_* variables, glibc tunables, "
            "LM_ZOO_MALLOC=default or another C library: see zoo/allocator.py), so both lm-zoo fit sides would "
            "run glibc's; unset them to measure"
        )
    measured = {"tokens_per_s": args.batch * args.bptt * windows / result["seconds_per_step"], "peak": result["peak"]}
    return measured | ({"profile": result["profile"]} if "profile" in result else {})


def summarise(rounds: list[dict[str, dict[str, float]]], tokens_per_step: int) -> dict[str, object]:
    """The medians over ``rounds``, the ratios of :data:`RATIOS` and, for each, the difference in milliseconds per
    step (what the slower side's step costs more; negative where the top side is faster) and the ratio within each
    round (its two sides ran minutes apart: a machine that slows down over the run moves the medians' ratio, not
    these). Sides a file measured before they existed are left out."""
    sides = [side for side in SIDES if all(side in r for r in rounds)]
    speed = {side: statistics.median(r[side]["tokens_per_s"] for r in rounds) for side in sides}
    peak = {side: statistics.median(r[side]["peak"] for r in rounds) for side in sides}
    step_ms = {side: tokens_per_step / tokens * 1e3 for side, tokens in speed.items()}
    ratios = [
        {
            "sides": f"{top} / {bottom}",
            "what": what,
            "tokens_per_s": round(speed[top] / speed[bottom], 3),
            "peak_rss": round(peak[top] / peak[bottom], 3),
            "step_ms_more": round(step_ms[top] - step_ms[bottom], 3),
            "per_round": [round(r[top]["tokens_per_s"] / r[bottom]["tokens_per_s"], 3) for r in rounds],
        }
        for top, bottom, what in RATIOS
        if top in speed
        and bottom in speed
        and not (top == NETWORK and bottom == PLAIN and PLAIN_LM_ZOO_MALLOC in speed)
    ]
    return {"median_tokens_per_s": speed, "median_step_ms": step_ms, "median_peak_rss_bytes": peak, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--steps", type=int, default=400, help="timed training steps per side and round")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timing starts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--windows-per-step", type=int, default=8, help=f"the windows a step of the side {FIT_WINDOWS!r} trains on"
    )
    parser.add_argument("--width", type=int, default=200, help="every side's embedding and LSTM units")
    parser.add_argument("--corpus", choices=sorted(CORPUS_FILES), default="ptb", help="PTB words or characters")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every side trains")
    parser.add_argument("--data-root", type=Path, default=Path(os.environ.get("LM_ZOO_DATA", "~/.cache/lm-zoo/data")))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead: profile the like-for-like pair (both with lm-zoo's malloc settings) over the timed steps, once "
        f"each, and write each one's top {PROFILE_ROWS} functions by their own time",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lm-zoo-malloc", action="store_true", help=argparse.SUPPRESS)  # the worker's allocator
    parser.add_argument("--lm-zoo-network", action="store_true", help=argparse.SUPPRESS)  # the worker's network
    parser.add_argument("--bare-lightning", action="store_true", help=argparse.SUPPRESS)  # the worker's loop
    output.add_arguments(parser, NAME)
    args = parser.parse_args(argv)
    args.data_root = args.data_root.expanduser()
    if args.worker:
        import torch

        from zoo.allocator import keep_freed_memory

        applied = keep_freed_memory() if args.lm_zoo_malloc else False  # as lm-zoo's start-up does
        torch.set_num_threads(args.threads)
        profiler = cProfile.Profile() if os.environ.get(PROFILE_VARIABLE) else None
        network = "lm-zoo" if args.lm_zoo_network else "lightning" if args.bare_lightning else "plain"
        seconds = plain_loop(
            args.data_root, args.batch, args.bptt, args.steps, args.warmup, profiler, args.width, args.corpus, network,
            args.device,
        )  # fmt: skip
        extra = {} if profiler is None else {"profile": top_functions(profiler, args.steps)}
        write_result(seconds, malloc_applied=applied, **extra)
        return
    import torch

    if args.profile and args.resume:
        output.fail("--profile writes a new file: it cannot --resume one")
    name = PROFILE_NAME if args.profile else NAME
    path = output.output_path(args, name)
    settings = {"batch": args.batch, "bptt": args.bptt, "steps": args.steps, "warmup": args.warmup}
    settings |= {"width": args.width, "corpus": args.corpus, "windows_per_step": args.windows_per_step}
    if args.device == "cuda":  # older files, all measured on the CPU, have no device
        settings |= {"device": torch.cuda.get_device_name(), "provenance": output.provenance("cuda")}
    settings |= {"threads": args.threads, "torch": torch.__version__, "hardware": output.hardware()}
    stored = output.read(path) if args.resume else {}
    if stored:
        output.check_same("the measurement", stored.get("settings", {}), settings, path)
    commands = [
        *stored.get("commands", []),
        " ".join(["python", "benchmarks/fit_overhead.py", *(sys.argv[1:] if argv is None else argv)]),
    ]
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            sides = {side: run_side(side, args, Path(tmp) / "result.json") for side in (PLAIN_LM_ZOO_MALLOC, FIT)}
        output.write(path, {"commands": commands, "commit": output.commit(), "settings": settings, "sides": sides})
        for side, measured in sides.items():
            print(f"== {side}: {measured['tokens_per_s']:.0f} tokens/s profiled; own time per step:")
            for entry in measured["profile"]:
                print(f"  {entry['ms_per_step']:8.3f} ms  {entry['function']}")
        print(f"wrote {path}")
        return
    loads = [*stored.get("load_average", []), {"before": os.getloadavg()}]
    rounds: list[dict[str, dict[str, float]]] = list(stored.get("rounds", []))
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            # The sides alternated, so that a change in the machine's load touches all of them.
            sides = SIDES_CUDA if args.device == "cuda" else SIDES
            rounds.append({side: run_side(side, args, Path(tmp) / "result.json") for side in sides})
    loads[-1]["after"] = os.getloadavg()
    summary = summarise(rounds, args.batch * args.bptt)
    result = {"commands": commands, "settings": settings, "load_average": loads, "rounds": rounds, **summary}
    output.write(path, result)

    speed, peak = summary["median_tokens_per_s"], summary["median_peak_rss_bytes"]
    step_ms = summary["median_step_ms"]
    print(
        f"== 2 x {args.width} LSTM on {args.corpus}, batch {args.batch}, BPTT {args.bptt}, {args.threads} threads, "
        f"{args.steps} steps"
    )
    for side in speed:
        each = ", ".join(f"{r[side]['tokens_per_s']:.0f}" for r in rounds)
        print(
            f"  {side:<62} {speed[side]:8.0f} tokens/s (median of {each}), {step_ms[side]:.3f} ms a step, "
            f"peak RSS {peak[side] / 2**20:.0f} MiB"
        )
    for ratio in summary["ratios"]:
        each = ", ".join(f"{value:.2f}" for value in ratio["per_round"])
        print(
            f"  {ratio['sides']}: {ratio['tokens_per_s']:.2f}x tokens/s ({ratio['step_ms_more']:+.3f} ms a step; "
            f"round by round {each}), {ratio['peak_rss']:.2f}x peak RSS"
        )
        print(f"      ({ratio['what']})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
