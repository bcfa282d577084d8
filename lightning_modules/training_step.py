"""A training step run by lm-zoo, not by Lightning's closure: the window's objective, its backward pass, the gradient
clipping and the optimizer's update in one function, which on a GPU is captured once as a CUDA graph and replayed.

Why: on a GPU the step of a PTB-sized LSTM is a few milliseconds of kernels, and the host spent longer issuing them than
the GPU spent running them. Measured on one H200 at 40985b8 (``benchmarks/results/fit_overhead_cuda*.json``),
``lm-zoo fit`` ran at 0.60x a plain PyTorch loop at 2 x 200, batch 20, and 0.69x at 2 x 650, batch 64: Lightning's
loop and hooks cost 2.3-2.5 ms a step, lm-zoo's network 0.8-1.6 ms more than ``nn.LSTM``. Replaying a whole step
leaves the host one launch per step and Lightning's loop around it. Run as one function, uncaptured (the CPU's path),
the step still skips Lightning's closure, its precision plugin's wrapping and six hook dispatches.

How it fits Lightning (automatic optimization, unchanged elsewhere): ``StatefulTraining`` overrides the
``optimizer_step`` hook, which Lightning calls once a step with the closure it would have run; :meth:`TrainingStep.step`
runs the step instead and hands the loop the closure's result (:func:`hand_result_to_loop`), so that Lightning's step
counters, schedulers, logging and checkpoints go on as before. What the closure and its hooks did is done here: the
gradients zeroed, the divergence guard's gradient figure (``DivergenceGuard.observe_gradients``: the norm the
clipping computes or the gradients' sum), the clipping (``gradient_clip_val``, by norm).

Several windows a step (the data's ``windows_per_step``, :func:`datamodules.stream_data.group_windows`; Keras calls
it ``steps_per_execution``): Lightning hands the step a list of consecutive windows, and :meth:`TrainingStep.step`
trains each in turn with an update of its own, captured, replayed or uncaptured as a window of its own would be, the
state carried through them. Lightning's per-step work (its loop, every callback's hooks, the loader's fetch, the
logging) is then paid once for them all: on a small model, or on a GPU whose replayed step is shorter than that work,
it is what a step costs. Lightning's counters count these steps. Its closure trains one window a step, so a fit it
must run refuses several (:func:`plan`).

The captured graph follows PyTorch's "whole-network capture" (``torch.cuda.graph``):

* the first :data:`WARMUP_STEPS` steps run eagerly on the capture's side stream (cuBLAS and cuDNN workspaces, the
  optimizer's state), with the per-window graphs of ``zoo.window`` off;
* one graph per signature: the window's shapes, the optimizer's settings (a new learning rate is captured anew: SGD
  bakes it into its kernels), the parameters' storage and the module's mode; at most :data:`MAX_GRAPHS` (AWD-LSTM's
  variable window lengths rounded to a few values by the data's ``bptt_multiple``); a schedule that changes the rate at
  every step makes the run stop capturing;
* the window is copied into the graph's own input tensors (``copy_``); the carried state lives in tensors of the
  graph's own, which each replay reads and overwrites, zeroed where an epoch starts;
* the gradients are the graph's (``zero_grad(set_to_none=True)`` before the capture, none between replays: each
  replay's backward writes them afresh);
* dropout masks come from the CUDA generator, which capture registers so that each replay draws anew, and NCE's shared
  generator is registered with the graph too;
* Adam-style optimizers run with ``capturable=True`` (their step count a device tensor); SGD needs nothing;
* what Lightning keeps of a step (``self.log``, ``train_nll``, the divergence guard's figures) is done after the
  replay, from the graph's output tensors (``StatefulTraining.record_training_step``, the step's output).

Where lm-zoo cannot run the step (:func:`plan`), Lightning's closure runs it and the start-up line says why: several
processes (DDP reduces the gradients through its own forward), accumulated batches, mixed precision, sparse gradients,
clipping by value, a callback that acts inside the step (``on_before_backward`` and the like), or
``LM_ZOO_TRAINING_STEP=lightning`` (:mod:`zoo.settings`; ``LM_ZOO_KERNELS=plain`` too). Where it runs but cannot
capture (the CPU, a window with resets, an optimizer with host-side state, ``LM_ZOO_TRAINING_STEP=direct``), the same
function runs uncaptured. The tests hold each path equal to Lightning's closure (losses, weights, carried state), and
on a GPU the captured step to the uncaptured one over 50 steps.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from lightning_modules.divergence import divergence_guard, gradients_sum
from lightning_modules.lightning_private import hand_result_to_loop
from zoo import settings
from zoo.errors import ConfigError
from zoo.state import State

#: Eager steps before the first capture, on the capture's stream: libraries' lazy workspaces and the optimizer's state.
WARMUP_STEPS = 3
#: Captured steps kept at once, each with a memory pool of its own (a window's activations and gradients): the window
#: shapes of a run whose lengths are rounded to a few values (``bptt_multiple``), with room to spare. A new shape past
#: it runs uncaptured (one warning); graphs of an earlier learning rate are dropped first, as they never come back.
MAX_GRAPHS = 16
#: Consecutive steps whose optimizer settings changed, after which the run stops capturing (a per-step schedule).
RECAPTURE_LIMIT = 3
#: The hooks Lightning calls inside a step, which lm-zoo's step does not call.
IN_STEP_HOOKS = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")
#: The module's own hooks inside a step that lm-zoo's step does in its stead, where lm-zoo's modules define them.
MODULE_HOOKS = (*IN_STEP_HOOKS, "backward", "optimizer_zero_grad", "configure_gradient_clipping")
#: An optimizer's param-group entries that are not settings its captured update reads from the host.
UNREAD_SETTINGS = ("params", "capturable")
LM_ZOO_MODULES = ("lightning_modules.stateful", "lightning_modules.language_model", "lightning_modules.music")


@dataclass
class TrainingObjective:
    """What a training window computes, before anything is recorded of it (:meth:`StatefulTraining.training_objective
    <lightning_modules.stateful.StatefulTraining.training_objective>`).

    Attributes:
        objective: what the backward pass differentiates: the loss plus any regularisers.
        loss: mean nats per predicted unit (the head's own objective for a sampled head), which ``train_loss`` logs and
            the divergence guard reads.
        count: ``()`` the units predicted (a device tensor: counting them on the host would wait for the device).
        window: the window's size, a host number: the weight of the logged per-step figures in their epoch means.
        figures: further per-step figures to log beside ``train_loss`` (``train_ar``, a cell's statistics, ...).
        reports_nats: whether ``loss`` is nats of the data (not for NCE): only then does it enter ``train_nll``.
    """

    objective: Tensor
    loss: Tensor
    count: Tensor
    window: int
    figures: dict[str, Tensor] = field(default_factory=dict)
    reports_nats: bool = True


@dataclass(frozen=True)
class StepPlan:
    """Who runs a fit's training steps, and why: ``graph`` (lm-zoo, captured), ``direct`` (lm-zoo, uncaptured) or
    ``lightning`` (Lightning's closure)."""

    path: str
    reason: str = ""

    def describe(self) -> str:
        """The start-up line's words for it."""
        said = {
            "graph": "lm-zoo's, captured as one CUDA graph per window shape and replayed",
            "direct": "lm-zoo's, one function (forward, backward, clipping, update)",
            "lightning": "Lightning's closure",
        }[self.path]
        return f"training step: {said}" + (f" ({self.reason})" if self.reason else "")


def plan(trainer: Any, module: LightningModule) -> StepPlan:
    """The one place that decides who runs a fit's training steps (:class:`StepPlan`), from the run's settings.

    Args:
        trainer: the fit's Trainer, its optimizers set up.
        module: the :class:`~lightning_modules.stateful.StatefulTraining` module being fitted.
    """
    chosen = settings.current()
    if chosen.plain_kernels or chosen.training_step == "lightning":
        why = "LM_ZOO_KERNELS=plain" if chosen.plain_kernels else "LM_ZOO_TRAINING_STEP=lightning"
        return _lightnings(trainer, why)
    refusal = _lightning_needed(trainer, module)
    if refusal is not None:
        return _lightnings(trainer, refusal)
    if chosen.training_step == "direct":
        return StepPlan("direct", "LM_ZOO_TRAINING_STEP=direct")
    if module.device.type != "cuda":
        return StepPlan("direct", "CUDA graphs need a GPU")
    optimizer = trainer.optimizers[0]
    if not capturable_optimizer(optimizer):
        return StepPlan("direct", f"{type(optimizer).__name__} keeps host-side state between steps: not captured")
    return StepPlan("graph")


def _lightnings(trainer: Any, reason: str) -> StepPlan:
    """Lightning's closure runs the steps, for ``reason``: one window a step, which is all the closure trains on.

    Raises:
        ConfigError: the data gives several windows a step (its ``windows_per_step``).
    """
    grouped = windows_per_step(trainer)
    if grouped > 1:
        raise ConfigError(
            f"windows_per_step {grouped} needs lm-zoo's own training step, which this fit cannot use ({reason}): "
            "set --data.init_args.windows_per_step 1"
        )
    return StepPlan("lightning", reason)


def windows_per_step(trainer: Any) -> int:
    """The windows each training step of ``trainer``'s fit trains on: its data module's ``windows_per_step``, else
    1."""
    return getattr(getattr(trainer, "datamodule", None), "windows_per_step", 1)


def _lightning_needed(trainer: Any, module: LightningModule) -> str | None:
    """Why Lightning's closure must run this fit's steps, or ``None``."""
    if not module.automatic_optimization:
        return "manual optimization"
    if len(trainer.optimizers) != 1:
        return f"{len(trainer.optimizers)} optimizers"
    if trainer.world_size > 1:
        return f"{trainer.world_size} processes: DDP reduces the gradients through its own forward"
    if trainer.accumulate_grad_batches != 1:
        return f"accumulate_grad_batches {trainer.accumulate_grad_batches}"
    if type(trainer.precision_plugin) is not Precision:
        return f"precision {trainer.precision}"
    algorithm = trainer.gradient_clip_algorithm
    if trainer.gradient_clip_val and algorithm not in (None, "norm"):
        return f"gradient_clip_algorithm {getattr(algorithm, 'value', algorithm)}"
    if module.hparams.get("sparse_gradients", False):  # sparse_gradients' own clipping rule (sparse_gradients.py)
        return "sparse gradients"
    for callback in trainer.callbacks:
        hook = next((h for h in IN_STEP_HOOKS if getattr(type(callback), h) is not getattr(Callback, h)), None)
        if hook is not None:
            return f"the callback {type(callback).__name__} acts in {hook}"
    for name in MODULE_HOOKS:
        method = getattr(type(module), name)
        if method is not getattr(LightningModule, name) and method.__module__ not in LM_ZOO_MODULES:
            return f"{type(module).__name__} overrides {name}"
    return None


def capturable_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a captured step can hold ``optimizer``'s update: SGD keeps all its state on the device, and an optimizer
    with a ``capturable`` option (Adam, AdamW, ...) does with it on (:func:`make_capturable`)."""
    return isinstance(optimizer, torch.optim.SGD) or "capturable" in optimizer.defaults


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Switch on ``capturable`` where the optimizer has it: its step count moves to the device (a float32 tensor, as
    the optimizer makes it when capturable), so that the update reads nothing from the host. The same update."""
    if "capturable" not in optimizer.defaults or device.type == "cpu":  # torch has no capturable update on a CPU
        return
    for group in optimizer.param_groups:
        group["capturable"] = True
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, Tensor) and step.device != device:
            state["step"] = step.to(device=device, dtype=torch.float32)


@dataclass
class _Captured:
    """One captured step: its graph, the tensors it reads (the window's copy, the carried state) and those it writes
    (the objective's tensors, the divergence check's figure)."""

    graph: Any
    batch: tuple[Tensor | None, ...]
    state: State
    # What the step computes, put here by the captured function: on a GPU once, at capture, as tensors each replay
    # overwrites; the CPU stand-in of the tests runs the function at each replay and puts its new tensors here.
    outputs: dict[str, Any]

    @property
    def result(self) -> TrainingObjective:
        return self.outputs["result"]

    @property
    def check(self) -> Tensor | None:
        return self.outputs["check"]


class CUDAGraphs:
    """How :class:`TrainingStep` captures on a GPU: ``torch.cuda.CUDAGraph`` captured on a side stream of its own,
    which also runs the warm-up's eager steps (PyTorch's rule for whole-network capture). The tests' stand-in on the
    CPU has the same three methods (:mod:`tests.test_training_step`)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def warm_up(self, step: Callable[[], Any]) -> Any:
        """Run an eager step on the capture's stream, ordered after the work queued before it and before the next."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            result = step()
        torch.cuda.current_stream().wait_stream(self.stream)
        return result

    def capture(self, body: Callable[[], None], generators: tuple[torch.Generator, ...] = ()) -> Any:
        """``body`` captured as a graph (its kernels recorded, not run); ``generators`` advance at each replay."""
        graph = torch.cuda.CUDAGraph()
        for generator in generators:
            graph.register_generator_state(generator)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(graph, stream=self.stream):
            body()
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph


class TrainingStep:
    """Runs a fit's training steps in lm-zoo's one function, captured where :func:`plan` says ``graph``.

    Args:
        module: the :class:`~lightning_modules.stateful.StatefulTraining` being fitted.
        trainer: its Trainer.
        step_plan: :func:`plan`'s decision (``graph`` or ``direct``).
    """

    def __init__(self, module: Any, trainer: Any, step_plan: StepPlan) -> None:
        self.module, self.plan = module, step_plan
        self.optimizer: torch.optim.Optimizer = trainer.optimizers[0]
        self.clip = trainer.gradient_clip_val or None
        self.guard = divergence_guard(trainer)  # takes each step's gradient figure
        self.windows_per_step = windows_per_step(trainer)
        self.captures = step_plan.path == "graph"
        self.backend: Any = None  # how to capture (CUDAGraphs), made when first needed
        self.graphs: dict[tuple, _Captured] = {}
        self.failed: dict[tuple, str] = {}
        self.eager_steps = 0  # steps run uncaptured so far (the warm-up counts them)
        self.replays = 0
        self.uncaptured_windows = 0  # windows a capturing run met that no graph can replay (resets)
        self.past_limit: set[tuple] = set()  # signatures met once MAX_GRAPHS were held: they run uncaptured
        self.capture_seconds: list[float] = []
        # Why each graph was captured: a new window shape, or a shape already held under another learning rate,
        # parameter storage or mode. The start-up lines say it, so that a run holding more graphs than its shapes
        # shows what else changed (one GPU run held 16 where its recipe's windows take fewer shapes).
        self.captured_for: Counter[str] = Counter()
        self._batch: Any = None
        self._batch_idx = 0
        self._last_settings: tuple | None = None
        self._changes = 0
        self._template: State | None = None  # the carried state's tensors after the last uncaptured step

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of the module (a weight average's, a script's) has no runner: its graphs replay on the original."""
        return None

    def __reduce__(self) -> tuple:
        return (_no_runner, ())

    # ------------------------------------------------------------------------------------------------ the step
    def next_batch(self, batch: Any, batch_idx: int) -> None:
        """The window the next :meth:`step` trains on, or a ``list`` of windows (the data's ``windows_per_step``):
        Lightning's ``on_train_batch_start`` hands it over."""
        self._batch, self._batch_idx = batch, batch_idx

    def step(self, closure: Any) -> None:
        """One training step on what :meth:`next_batch` gave, its result handed to Lightning's loop: a window, or each
        window of a list in turn with an update of its own, the carried state flowing through them as from step to
        step. The step logs its last window's figures (Lightning shows the last value logged); the divergence guard
        checks its worst window's loss and a gradient figure that is NaN or infinite iff some window's is."""
        windows = self._batch if isinstance(self._batch, list) else [self._batch]
        logs = self.module.logs_this_training_step(self._batch_idx)
        worst: Tensor | None = None
        figure: Tensor | None = None
        for index, window in enumerate(windows):
            result, check = self._window_step(window, logs and index == len(windows) - 1)
            loss = result.loss.detach()
            if index == 0 and len(windows) > 1:  # a graph's outputs, which the next window's replay overwrites
                loss, check = loss.clone(), None if check is None else check.clone()
            worst = loss if worst is None else torch.maximum(worst, loss)  # NaN if either is
            if check is not None:
                figure = check if figure is None else figure + check  # NaN or infinite if either is
        self._report(figure)
        hand_result_to_loop(closure, self.module.step_output(result, worst))

    def _window_step(self, batch: Any, logs: bool) -> tuple[TrainingObjective, Tensor | None]:
        """One window's update, captured, replayed or run eagerly; with the divergence guard's gradient figure."""
        captured = self._graph_for(batch) if self.captures else None
        if captured is None and self.captures and self.eager_steps < WARMUP_STEPS:
            return self._warm_up(batch, logs)
        if captured is None:
            return self._eager(batch, logs)
        self._replay(captured, batch)
        result = replace(captured.result, figures=captured.result.figures if logs else {})
        self.module.record_training_step(result, logs)
        return result, captured.check

    def _eager(self, batch: Any, logs: bool) -> tuple[TrainingObjective, Tensor | None]:
        """The step as plain code, as Lightning's closure and hooks run it: the gradients zeroed, the objective and what
        it records (as Lightning's training step, before the backward pass), the backward pass, the divergence check's
        figure (the norm the clipping computes, or the gradients' sum), the clipping, the update."""
        self.optimizer.zero_grad(set_to_none=True)
        result = self.module.training_objective(batch, figures=logs)
        self.module.record_training_step(result, logs)
        result.objective.backward()
        check = self._clip_and_check()
        self.optimizer.step()
        self.eager_steps += 1
        if self.module.training_state is not None:
            self._template = self.module.training_state
        return result, check

    def _warm_up(self, batch: Any, logs: bool) -> tuple[TrainingObjective, Tensor | None]:
        """An eager step before the first capture, on the capture's stream, without the per-window graphs (their
        captures would be wasted: inside the step's graph a window runs as plain kernels)."""
        with settings.overridden(window_graphs=False):
            return self._graphs().warm_up(lambda: self._eager(batch, logs))

    def _graphs(self) -> Any:
        if self.backend is None:
            self.backend = CUDAGraphs()
        return self.backend

    def _report(self, figure: Tensor | None) -> None:
        if self.guard is not None:
            self.guard.observe_gradients(figure)

    def _clip_and_check(self) -> Tensor | None:
        """Clip by norm where the run clips, returning the norm (NaN or infinite iff some gradient is), else the
        gradients' sum, NaN or infinite under the same condition: the divergence guard's figure."""
        parameters = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.clip:
            return torch.nn.utils.clip_grad_norm_(parameters, self.clip)
        return gradients_sum(parameters)

    # ---------------------------------------------------------------------------------------- capture and replay
    def _signature(self, batch: Any) -> tuple | None:
        """What a captured step is valid for: the window's shapes, the optimizer's settings, the parameters' storage
        and the module's mode; ``None`` where this window runs uncaptured."""
        if not self.module.capturable_window(batch) or not all(f is None or isinstance(f, Tensor) for f in batch):
            self.uncaptured_windows += 1
            return None
        # What the update reads from the host at capture (a tensor setting is read at each replay; "capturable" is
        # this runner's own switch, made at the first capture).
        hyper = tuple(
            tuple(sorted((k, v) for k, v in group.items() if k not in UNREAD_SETTINGS and not isinstance(v, Tensor)))
            for group in self.optimizer.param_groups
        )
        self._changes = self._changes + 1 if self._last_settings not in (None, hyper) else 0
        self._last_settings = hyper
        if self._changes >= RECAPTURE_LIMIT:
            self._stop_capturing("the optimizer's settings (its learning rate) change at every step")
            return None
        shapes = tuple(None if f is None else (tuple(f.shape), f.dtype) for f in batch)
        storage = tuple(p.data_ptr() for p in self.module.parameters())
        return shapes, hyper, storage, self.module.training

    def _graph_for(self, batch: Any) -> _Captured | None:
        """The graph to replay for ``batch``, captured now if its signature is new, or ``None`` (run it eagerly: the
        warm-up, a window no graph can replay, a signature whose capture failed)."""
        key = self._signature(batch)
        if key is None:
            return None
        captured = self.graphs.get(key)
        if captured is not None:
            return captured
        if key in self.failed or self.eager_steps < WARMUP_STEPS:
            return None
        if len(self.graphs) >= MAX_GRAPHS:
            for old in [old for old in self.graphs if old[1] != key[1]]:  # another learning rate's: never replayed
                del self.graphs[old]
        if len(self.graphs) >= MAX_GRAPHS:
            if not self.past_limit:
                warnings.warn(
                    f"lm-zoo: a training window of a new shape after {MAX_GRAPHS} captured ones runs uncaptured, as "
                    "will any further new shape: round variable window lengths (the data's bptt_multiple)",
                    stacklevel=3,
                )
            self.past_limit.add(key)
            return None
        captured = self._capture(key, batch)
        if captured is not None:
            self.captured_for[self._new_in(key)] += 1
            self.graphs[key] = captured
        return captured

    def _new_in(self, key: tuple) -> str:
        """What ``key`` brings that no held graph has: its window shape, or, for a shape held already, which other
        part of the signature (:meth:`_signature`) differs from that graph's."""
        held = [old for old in self.graphs if old[0] == key[0]]
        if not held:
            return "a new window shape"
        parts = ("the optimizer's settings", "the parameters' storage", "the module's mode")
        return " and ".join(part for part, old, new in zip(parts, held[-1][1:], key[1:], strict=True) if old != new)

    def _capture(self, key: tuple, batch: Any) -> _Captured | None:
        """Capture the step over a copy of ``batch`` (which runs nothing: the caller replays it for this window)."""
        module, start = self.module, time.perf_counter()
        static_batch = tuple(None if f is None else f.detach().clone() for f in batch)
        static_state = self._static_state()
        make_capturable(self.optimizer, module.device)
        self.optimizer.zero_grad(set_to_none=True)  # the capture's backward makes the gradients, in its memory pool
        outputs: dict[str, Any] = {}

        def body() -> None:
            module.training_state = static_state
            # No gradient at capture (so nothing to zero then); where the function is run again instead of replayed
            # (the tests' stand-in), this step's gradients must not add to the last one's.
            self.optimizer.zero_grad(set_to_none=False)
            result = module.training_objective(type(batch)(*static_batch), figures=True)
            result.objective.backward()
            outputs["check"] = self._clip_and_check()
            self.optimizer.step()
            for held, new in zip(static_state, module.training_state, strict=True):
                held.copy_(new)
            outputs["result"] = result

        generator = getattr(module, "shared_generator", None)
        generators = (generator,) if generator is not None and generator.device.type != "cpu" else ()
        try:
            graph = self._graphs().capture(body, generators)
        except Exception as error:  # noqa: BLE001 - whatever capture refuses, the uncaptured step computes the same
            self.failed[key] = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"lm-zoo: a training step could not be captured as a CUDA graph ({self.failed[key]}); steps of its "
                "shape run uncaptured",
                stacklevel=2,
            )
            module.training_state = static_state
            self.optimizer.zero_grad(set_to_none=True)
            return None
        module.training_state = static_state
        self.capture_seconds.append(time.perf_counter() - start)
        return _Captured(graph, static_batch, static_state, outputs)

    def _static_state(self) -> State:
        """Tensors of the graph's own for the carried state, holding its values now (zeros where it is ``None``)."""
        state = self.module.training_state
        if state is None:  # an epoch's first window: zeros shaped as the warm-up's state
            assert self._template is not None, "a step is captured after uncaptured ones, which leave a state"
            return tuple(torch.zeros_like(s) for s in self._template)
        return tuple(s.detach().clone() for s in state)

    def _replay(self, captured: _Captured, batch: Any) -> None:
        for held, given in zip(captured.batch, batch, strict=True):
            if held is not None:
                held.copy_(given, non_blocking=True)
        state = self.module.training_state
        if state is None:  # an epoch started: zeros, as None means
            for held in captured.state:
                held.zero_()
        elif state is not captured.state:  # another graph's, an uncaptured step's, a resumed run's
            for held, given in zip(captured.state, state, strict=True):
                held.copy_(given)
        captured.graph.replay()
        self.module.training_state = captured.state
        self.replays += 1

    def _stop_capturing(self, reason: str) -> None:
        self.captures = False
        self.graphs.clear()
        self.plan = StepPlan("direct", f"not captured: {reason}")
        warnings.warn(f"lm-zoo: training steps run uncaptured from here: {reason}", stacklevel=3)

    def summary(self) -> str:
        """The start-up line's words: who runs the steps, and what capturing cost so far."""
        line = self.plan.describe()
        if self.windows_per_step > 1:
            line += f"; {self.windows_per_step} windows a step, an update each"
        if self.capture_seconds:
            line += f"; {len(self.capture_seconds)} captured in {sum(self.capture_seconds):.2f} s"
            line += f" ({', '.join(f'{count} for {why}' for why, count in self.captured_for.items())})"
        if self.failed:
            line += f"; {len(self.failed)} could not be and run uncaptured (warned above)"
        if self.captures and self.uncaptured_windows:
            line += f"; {self.uncaptured_windows} window(s) with resets ran uncaptured"
        if self.past_limit:
            line += f"; {len(self.past_limit)} window shape(s) past the limit of {MAX_GRAPHS} ran uncaptured"
        return line


def _no_runner() -> None:
    """What a pickled :class:`TrainingStep` comes back as: none (a graph replays on the memory it was captured on)."""
    return None
