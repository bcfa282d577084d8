"""lm-zoo's own training step (lightning_modules/training_step.py) against Lightning's closure, the reference path:
the same weights, losses and carried state, step for step; the captured path's bookkeeping (the window copied in, the
state carried and zeroed, a new capture for a new learning rate) on a CPU stand-in for CUDA graphs; and the settings
under which Lightning's closure runs the step, said in the start-up line. The captured graph itself is held equal to
the uncaptured step in the GPU suite (tests/test_gpu.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch

from datamodules import TextDataModule
from lightning_modules import LanguageModel, WeightAveragingOnPlateau, ZarembaDecay
from lightning_modules import training_step as step_module
from lightning_modules.training_step import RECAPTURE_LIMIT, WARMUP_STEPS, StepPlan, TrainingStep
from tests.conftest import quiet_trainer, write_word_corpus
from zoo import settings
from zoo.errors import ConfigError, TrainingDivergedError


class ReplayByCall:
    """A CPU stand-in for :class:`~lightning_modules.training_step.CUDAGraphs`: a capture records the step's function
    and runs nothing, as a CUDA capture runs no kernel; a replay runs the function again. So the runner must copy each
    window into the captured one's tensors, carry the state through the captured state's tensors, and take what it
    records from what the replay wrote, as it must for a real graph (else the stand-in trains on stale windows)."""

    made: list[ReplayByCall] = []

    def __init__(self) -> None:
        self.captured: list[_Recorded] = []
        ReplayByCall.made.append(self)

    def warm_up(self, step: Callable[[], Any]) -> Any:
        return step()

    def capture(self, body: Callable[[], None], generators: tuple = ()) -> _Recorded:
        self.captured.append(_Recorded(body))
        return self.captured[-1]


class _Recorded:
    def __init__(self, body: Callable[[], None]) -> None:
        self.body, self.replays = body, 0

    def replay(self) -> None:
        self.replays += 1
        self.body()


def _fit(
    tmp_path: Path,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    steps: int = 12,
    epochs: int | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] = lambda p: torch.optim.SGD(p, lr=0.5),
    scheduler: Callable[[Any], Any] | None = None,
    stand_in: bool = True,
    model_options: dict[str, Any] | None = None,
    windows_per_step: int = 1,
    **trainer_options: Any,
) -> dict[str, Any]:
    """A tiny word model fitted with ``path`` (``graph``: lm-zoo's captured step, on :class:`ReplayByCall` where
    ``stand_in``): the module, its training loss after each step, the figures it logged at each step, the shapes of
    the windows it trained on (a step's windows, in order), and what the step's runner counted (``runner``: its
    captures' seconds, replays and uncaptured steps)."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    corpus = str(write_word_corpus(tmp_path, "5", words=60))
    dm = TextDataModule(corpus, batch_size=3, bptt=6, windows_per_step=windows_per_step)
    torch.manual_seed(0)
    options = {"embedding_size": 8, "hidden_size": 12, "num_layers": 2, "dropout": 0.2, "ar": 1.0, "tar": 1.0}
    model = LanguageModel(dm.vocab_size, **{"architecture": "lstm", **options, **(model_options or {})})

    def configure() -> Any:
        chosen = optimizer(model.parameters())
        return chosen if scheduler is None else {"optimizer": chosen, "lr_scheduler": scheduler(chosen)}

    model.configure_optimizers = configure  # LightningCLI's job in lm-zoo
    seen: dict[str, Any] = {"losses": [], "shapes": [], "figures": [], "runner": None}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, *args: Any) -> None:
            seen["losses"].append(float(outputs["loss"]))
            figures = trainer.callback_metrics.items()  # what the step logged (every step: log_every_n_steps 1)
            seen["figures"].append({name: float(value) for name, value in figures if name.startswith("train_")})
            windows = batch if isinstance(batch, list) else [batch]
            seen["shapes"].extend(tuple(window.inputs.shape) for window in windows)

        def on_train_end(self, trainer: L.Trainer, module: Any) -> None:  # before the module drops its runner
            runner = module.step_runner
            if runner is not None:
                seen["runner"] = {
                    "captures": runner.capture_seconds,
                    "replays": runner.replays,
                    "failed": runner.failed,
                    "past_limit": len(runner.past_limit),
                    "captured_for": dict(runner.captured_for),
                }

    limits = {"max_epochs": epochs} if epochs else {"max_steps": steps}
    options = {"limit_val_batches": 0, "gradient_clip_val": 0.3, "log_every_n_steps": 1, **trainer_options}
    options["callbacks"] = [Record(), *trainer_options.get("callbacks", [])]
    trainer = quiet_trainer(**limits, **options)
    with monkeypatch.context() as patch, settings.overridden(training_step=path):
        if path == "graph" and stand_in:  # on the CPU, plan() would say direct
            patch.setattr("lightning_modules.stateful.plan", lambda *a: StepPlan("graph"))
            patch.setattr(step_module, "CUDAGraphs", ReplayByCall)
        trainer.fit(model, dm)
    return {"model": model, **seen}


def _assert_same_training(one: dict[str, Any], other: dict[str, Any]) -> None:
    assert one["losses"] == pytest.approx(other["losses"], rel=1e-6, abs=1e-7) and one["losses"]
    for (name, a), b in zip(one["model"].state_dict().items(), other["model"].state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_direct_step_trains_as_lightnings_closure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: str
) -> None:
    """Dropout, AR and TAR, clipping by norm: the same losses and weights after every update, whoever runs the step."""
    direct = _fit(tmp_path / "direct", "direct", monkeypatch, optimizer=OPTIMIZERS[optimizer])
    assert direct["model"].step_plan == StepPlan("direct", "LM_ZOO_TRAINING_STEP=direct")
    assert direct["model"].step_runner is None  # dropped, with any graphs, when training ends
    lightning = _fit(tmp_path / "lightning", "lightning", monkeypatch, optimizer=OPTIMIZERS[optimizer])
    assert lightning["model"].step_plan.path == "lightning"
    _assert_same_training(direct, lightning)


def test_captured_step_on_a_stand_in_trains_as_lightnings_closure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over three epochs of a per-epoch schedule: the state zeroed at each epoch's start, a capture for each new
    learning rate and window shape, every step after the warm-up a replay; the same losses and weights as Lightning's
    closure."""
    ReplayByCall.made.clear()
    schedule = {"epochs": 3, "scheduler": lambda o: ZarembaDecay(o, constant_epochs=1, decay=0.5)}
    captured = _fit(tmp_path / "graph", "graph", monkeypatch, **schedule)
    [backend] = ReplayByCall.made
    per_epoch = len(captured["shapes"]) // 3
    shapes_per_epoch = len(set(captured["shapes"]))
    assert per_epoch > WARMUP_STEPS
    assert len(backend.captured) == 3 * shapes_per_epoch  # the rates 0.5, 0.25, 0.125, each with every window shape
    assert sum(graph.replays for graph in backend.captured) == len(captured["losses"]) - WARMUP_STEPS
    # what the start-up lines give as the captures' reasons: each shape once, then again for each later rate
    assert captured["runner"]["captured_for"] == {
        "a new window shape": shapes_per_epoch,
        "the optimizer's settings": 2 * shapes_per_epoch,
    }
    lightning = _fit(tmp_path / "lightning", "lightning", monkeypatch, **schedule)
    _assert_same_training(captured, lightning)


def test_a_cells_figures_are_each_steps_own_on_the_captured_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skip RNN's update fraction, which its layers keep from their last forward (``last_updates``): the captured step
    logs it from what the step's graph returned, so each step logs its own window's, as Lightning's closure does."""
    options = {"model_options": {"architecture": "skip_lstm", "dropout": 0.0, "cell_options": {"update_bias": 0.0}}}
    captured = _fit(tmp_path / "graph", "graph", monkeypatch, **options)
    lightning = _fit(tmp_path / "lightning", "lightning", monkeypatch, **options)
    fractions = [figures["train_update_fraction"] for figures in captured["figures"]]
    assert fractions == pytest.approx([figures["train_update_fraction"] for figures in lightning["figures"]])
    assert len(set(fractions)) > 3, fractions  # moving from step to step: a figure left from the capture would not


@pytest.mark.parametrize("path", ["direct", "graph"])
def test_several_windows_a_step_train_as_one_window_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """``windows_per_step`` 5: each window its own update, in order, the state carried through them, so that over two
    epochs (an epoch's last step shorter) the weights and each step's last loss are those of one window a step, and
    the captured path replays a graph for every window after the warm-up. Lightning counts steps of 5 windows."""
    ReplayByCall.made.clear()
    grouped = _fit(tmp_path / "grouped", path, monkeypatch, epochs=2, windows_per_step=5)
    single = _fit(tmp_path / "single", "lightning", monkeypatch, epochs=2)
    assert grouped["shapes"] == single["shapes"]
    per_epoch = len(single["shapes"]) // 2
    assert per_epoch % 5 != 0  # the epoch's last step has fewer windows
    last_of_each_step = [*range(4, per_epoch, 5), per_epoch - 1]  # by their index in an epoch
    losses = [single["losses"][epoch * per_epoch + i] for epoch in (0, 1) for i in last_of_each_step]
    assert grouped["model"].trainer.global_step == len(losses)
    _assert_same_training(grouped, {"model": single["model"], "losses": losses})
    if path == "graph":
        [backend] = ReplayByCall.made
        assert sum(graph.replays for graph in backend.captured) == len(single["shapes"]) - WARMUP_STEPS


def test_the_divergence_guard_checks_every_window_of_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of three windows whose middle one's loss is infinite (its objective, and so the weights, finite) stops
    the run at that step, though the step's last window is finite."""
    objective = LanguageModel.training_objective
    calls = {"n": 0}

    def second_window_infinite(self: LanguageModel, batch: Any, figures: bool = True) -> Any:
        result = objective(self, batch, figures)
        calls["n"] += 1
        if calls["n"] == 2:
            result.loss = result.loss * float("inf")
        return result

    monkeypatch.setattr(LanguageModel, "training_objective", second_window_infinite)
    with pytest.raises(TrainingDivergedError, match="training loss became inf at step 0"):
        _fit(tmp_path, "direct", monkeypatch, steps=3, windows_per_step=3)


def test_several_windows_a_step_need_lm_zoos_step_and_the_refusal_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Lightning's closure must run the steps, it trains one window a step: grouped windows are refused in one
    line naming why and the setting to change, before any step."""
    with pytest.raises(ConfigError) as refused:
        _fit(tmp_path, "direct", monkeypatch, windows_per_step=2, accumulate_grad_batches=2)
    assert str(refused.value) == (
        "windows_per_step 2 needs lm-zoo's own training step, which this fit cannot use (accumulate_grad_batches 2): "
        "set --data.init_args.windows_per_step 1"
    )


def test_weight_averaging_and_validation_capture_nothing_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWD-LSTM's GPU recipe validates every epoch and averages the weights once NT-ASGD triggers, the average swapped
    in for validation and out again: on the stand-in, over four epochs, its step captures one graph per window shape
    and none for anything else. (An H200 run of that recipe at 522b546 held 16 graphs, where its shapes take fewer.)"""
    ReplayByCall.made.clear()
    averaging = WeightAveragingOnPlateau(trigger="nt-asgd", nonmono=1, start_fraction=0.25)
    captured = _fit(tmp_path, "graph", monkeypatch, epochs=4, callbacks=[averaging], limit_val_batches=2)
    assert averaging.switched_on_at_step is not None
    assert captured["runner"]["captured_for"] == {"a new window shape": len(set(captured["shapes"]))}


def flatten_as_cudnn_does(rnn: torch.nn.RNNBase) -> None:
    """What ``nn.RNNBase.flatten_parameters`` does on a GPU (``torch._cudnn_rnn_flatten_weight``), on the CPU: every
    weight the module holds is copied into one new buffer and made a view of it, its storage moved."""
    weights = rnn._flat_weights
    if not all(isinstance(w, torch.Tensor) for w in weights):
        return
    with torch.no_grad():
        buffer = torch.cat([w.detach().reshape(-1) for w in weights])
        offset = 0
        for w in weights:
            w.set_(buffer.untyped_storage(), offset, w.shape, w.stride())
            offset += w.numel()


def test_weight_drop_leaves_the_parameters_where_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWD-LSTM's weight drop swaps a dropped recurrent matrix in for each window. Where the fused kernel then
    re-flattened its weights for cuDNN, the layer's other parameters moved to a new buffer at every window, and the
    captured step, keyed on their storage, was captured anew at every step until it held MAX_GRAPHS (an H200 run at
    522b546 held 16). With flattening done as on a GPU, the stand-in captures one graph per window shape and no more,
    and trains as Lightning's closure does."""
    ReplayByCall.made.clear()
    monkeypatch.setattr(torch.nn.RNNBase, "flatten_parameters", flatten_as_cudnn_does)
    options = {"model_options": {"cell_options": {"weight_drop": 0.5}}, "epochs": 2}
    captured = _fit(tmp_path / "graph", "graph", monkeypatch, **options)
    assert captured["runner"]["captured_for"] == {"a new window shape": len(set(captured["shapes"]))}
    _assert_same_training(captured, _fit(tmp_path / "lightning", "lightning", monkeypatch, **options))


def test_a_fused_layer_flattens_its_own_replaced_weights_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights replaced by other tensors (``load_state_dict(assign=True)``) are flattened into one buffer at the next
    window, once, as ``nn.RNNBase.forward`` does, so that cuDNN does not compact them at every call; a weight-dropped
    window flattens nothing."""
    import zoo

    flattened: list[int] = []

    def counted(rnn: torch.nn.RNNBase) -> None:
        flattened.append(1)
        flatten_as_cudnn_does(rnn)

    monkeypatch.setattr(torch.nn.RNNBase, "flatten_parameters", counted)
    stack = zoo.build("lstm", 4, 5, 1, weight_drop=0.5).train()
    x = torch.randn(2, 3, 4)
    flattened.clear()
    stack(x)  # weight drop: the dropped matrix swapped in, nothing flattened
    assert not flattened
    stack.load_state_dict({k: v.clone() for k, v in stack.state_dict().items()}, assign=True)
    stack.eval()(x)
    stack(x)
    assert len(flattened) == 1


def test_a_copy_of_a_module_in_training_has_no_runner() -> None:
    """A deep copy or a pickle of the module while it trains (its runner holds graphs bound to the original's memory)
    carries no runner."""
    import copy
    import pickle

    model = LanguageModel(11, "lstm", embedding_size=4, hidden_size=4)
    model.step_runner = TrainingStep.__new__(TrainingStep)
    assert copy.deepcopy(model).step_runner is None
    assert pickle.loads(pickle.dumps(model)).step_runner is None


def test_a_graph_is_replayed_for_its_shape_in_later_epochs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a schedule, one capture per window shape, each replayed in every later epoch, from a zero state at each
    epoch's start; the same training as Lightning's closure."""
    ReplayByCall.made.clear()
    captured = _fit(tmp_path / "graph", "graph", monkeypatch, epochs=3)
    [backend] = ReplayByCall.made
    assert len(backend.captured) == len(set(captured["shapes"]))
    assert all(graph.replays >= 2 for graph in backend.captured)
    _assert_same_training(captured, _fit(tmp_path / "lightning", "lightning", monkeypatch, epochs=3))


def test_a_window_shape_past_the_graph_limit_runs_uncaptured_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for one graph, the epoch's shorter last window runs uncaptured (one warning, counted in the summary)
    while the full windows replay theirs; the same training as Lightning's closure."""
    ReplayByCall.made.clear()
    monkeypatch.setattr(step_module, "MAX_GRAPHS", 1)
    with pytest.warns(UserWarning, match="new shape after 1 captured ones runs uncaptured"):
        captured = _fit(tmp_path / "graph", "graph", monkeypatch, epochs=2)
    assert len(set(captured["shapes"])) == 2
    [backend] = ReplayByCall.made
    assert len(backend.captured) == 1 and backend.captured[0].replays > 2
    assert captured["runner"]["past_limit"] == 1
    _assert_same_training(captured, _fit(tmp_path / "lightning", "lightning", monkeypatch, epochs=2))


def test_a_learning_rate_changed_at_every_step_stops_the_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A per-step schedule would capture anew at every step: after RECAPTURE_LIMIT changes in a row, one warning, and
    the steps run uncaptured; the same training as Lightning's closure."""
    ReplayByCall.made.clear()

    def every_step(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s)), "interval": "step"}

    with pytest.warns(UserWarning, match="change at every step"):
        captured = _fit(tmp_path / "graph", "graph", monkeypatch, steps=15, scheduler=every_step)
    [backend] = ReplayByCall.made
    assert len(backend.captured) < RECAPTURE_LIMIT
    lightning = _fit(tmp_path / "lightning", "lightning", monkeypatch, steps=15, scheduler=every_step)
    _assert_same_training(captured, lightning)


class AfterBackward(L.Callback):
    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        pass


@pytest.mark.parametrize(
    ("trainer_options", "said"),
    [
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches 2"),
        ({"callbacks": [AfterBackward()]}, "the callback AfterBackward acts in on_after_backward"),
        ({"precision": "bf16-mixed"}, "precision bf16-mixed"),
        ({"gradient_clip_val": 0.1, "gradient_clip_algorithm": "value"}, "gradient_clip_algorithm value"),
    ],
)
def test_lightnings_closure_runs_the_steps_lm_zoo_cannot_and_the_line_says_why(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    trainer_options: dict,
    said: str,
) -> None:
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    dm = TextDataModule(str(write_word_corpus(tmp_path, "5")), batch_size=3, bptt=6)
    model = LanguageModel(dm.vocab_size, "lstm", embedding_size=8, hidden_size=8)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, **trainer_options)
    trainer.fit(model, dm)
    assert model.step_plan == StepPlan("lightning", said)
    assert model.step_summary() == f"training step: Lightning's closure ({said})"


def test_the_plan_follows_the_switch_and_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """LM_ZOO_TRAINING_STEP and LM_ZOO_KERNELS=plain pick the path; on a CPU lm-zoo's step runs uncaptured."""
    assert settings.from_environment({"LM_ZOO_TRAINING_STEP": "Direct"}).training_step == "direct"
    assert settings.from_environment({"LM_ZOO_TRAINING_STEP": "nonsense"}).training_step == "graph"
    model = LanguageModel(11, "lstm", embedding_size=4, hidden_size=4)
    trainer = quiet_trainer(max_steps=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(L.Trainer, "optimizers", property(lambda self: [optimizer]))
    model.trainer = trainer
    for changes, expected in (
        ({}, StepPlan("direct", "CUDA graphs need a GPU")),
        ({"training_step": "direct"}, StepPlan("direct", "LM_ZOO_TRAINING_STEP=direct")),
        ({"training_step": "lightning"}, StepPlan("lightning", "LM_ZOO_TRAINING_STEP=lightning")),
        ({"plain_kernels": True}, StepPlan("lightning", "LM_ZOO_KERNELS=plain")),
    ):
        with settings.overridden(**changes):
            assert step_module.plan(trainer, model) == expected


@pytest.mark.parametrize("recipe", ["configs/ptb/awd-lstm-gpu.yaml", "configs/ptb-char/awd-lstm-gpu.yaml"])
def test_a_gpu_recipes_variable_windows_fit_in_the_captured_steps(recipe: str) -> None:
    """AWD-LSTM's variable lengths rounded by the recipe's bptt_multiple: over ten epochs of a PTB-sized stream, fewer
    window shapes than the graphs a run keeps, so every window replays a captured step."""
    import yaml

    from datamodules.windows import StreamWindows

    data = yaml.safe_load((Path(__file__).parents[1] / recipe).read_text())["data"]["init_args"]
    windows = StreamWindows(
        np.arange(1, 1_000_001), data["batch_size"], data["bptt"], start_id=0, variable_bptt=data["variable_bptt"],
        seed=data["seed"], bptt_multiple=data["bptt_multiple"],
    )  # fmt: skip
    multiple = data["bptt_multiple"]
    shapes = {-(-length // multiple) * multiple for epoch in range(10) for length in windows.window_lengths(epoch)}
    assert len(shapes) <= step_module.MAX_GRAPHS  # the last windows padded to a multiple too
