"""No host synchronisation in a training step or a validation step: counted on
the CPU by :class:`benchmarks.host_syncs.HostSyncCounter`, which follows the tensors that would live on a GPU and
counts the calls that would make the host wait for them (``.item()``, ``.tolist()``, ``.cpu()``, a tensor in an
``if``, ``nonzero``, boolean-mask indexing, blocking copies to the device)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import zoo
from benchmarks.host_syncs import HostSyncCounter, count_fit
from datamodules.windows import LMBatch
from evaluation.deterministic import deterministic_nll
from evaluation.mc_dropout import MCDropout, mc_nll
from zoo.layers import FusedLayer
from zoo.state import KeepAt, Resets


def test_the_counter_counts_what_would_wait_for_a_gpu_and_nothing_on_the_host() -> None:
    """The assertions below mean something only if the counter sees each kind of synchronisation."""
    on_device, on_host = torch.randn(4), torch.randn(4)
    with HostSyncCounter() as counter:
        counter.mark(on_device)
        counter.counting = True
        derived = on_device * 2 + 1  # computed from a device tensor: on the device
        derived.sum().item()
        if derived[0] > 0:
            pass
        derived[derived > 0] = 0.0
        derived.nonzero()
        derived.cpu().tolist()  # one copy to the host; the list comes from the host copy
        torch.tensor([1, 2], device=derived.device)
        on_host.long().to(derived.device)
        on_host.to(derived.device, non_blocking=True)
        derived.to(torch.float64)  # a conversion on the device
        landed = torch.empty(4)
        landed.copy_(derived, non_blocking=True)  # to the host without waiting (into pinned memory, on a GPU)
        landed.tolist()  # read once it has landed: the host's own
        on_host.sum().item(), on_host.tolist(), on_host.nonzero(), bool(on_host[0] > 0)  # the host's own business
        torch.zeros(3).tolist()  # made on the host
    assert counter.counts == {
        "item": 1,
        "__bool__": 1,
        "__setitem__[boolean mask]": 1,
        "nonzero": 1,
        "cpu": 1,
        "tensor(..., device=) (blocking copy to the device)": 1,
        "to(device) (blocking copy to the device)": 1,
    }


def by_site(steps: list[tuple[Counter[str], Counter[str]]]) -> list[dict[str, int]]:
    """Each step's counts by call site, the line numbers dropped (they move as the code does)."""
    return [dict(Counter({site.rsplit(":", 1)[0]: n for site, n in sites.items()})) for _, sites in steps]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["ptb-lstm", "gbw-lstm4-per-step", "gbw-lstm4-packed"])
def test_no_training_or_validation_step_synchronises(
    setting: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-layer LSTM on a word stream, and a 4-layer LSTM with an NCE head on GBW's multi-sequence batches, whose
    windows reset inside (a sentence starts in nearly every one), run as packed segments (CUDA's path, forced here)
    or by the per-step loop (the CPU's)."""
    monkeypatch.setenv("LM_ZOO_CACHE", str(tmp_path / "cache"))
    packed: list[bool] = []
    segments = FusedLayer._segments

    def recording(self: FusedLayer, x: torch.Tensor, state: Any, keep_at: Any) -> Any:
        packed.append(isinstance(keep_at, KeepAt) and keep_at.segments is not None)  # worked out before the step
        return segments(self, x, state, keep_at)

    monkeypatch.setattr(FusedLayer, "_segments", recording)
    counted = count_fit(setting, tmp_path, steps=3)

    train, val = by_site(counted.train), by_site(counted.val)
    assert len(train) == 3 and len(val) == 3
    # The divergence check's figures go to the host without waiting, and are read a step later (StatefulTraining).
    assert train[1:] == [{}] * 2, train
    # Lightning's first self.log of a key moves its accumulators to the device (asynchronously on a GPU: Lightning
    # passes non_blocking=True there, not on the CPU): the first step's only calls.
    first = {site: n for site, n in train[0].items() if not site.endswith("lightning/fabric/utilities/apply_func.py")}
    assert first == {}, train[0]
    assert val == [{}] * 3, val
    if setting.endswith("packed"):
        # 4 layers, 3 training and 3 validation windows with resets inside, each from the host-made layout.
        assert len(packed) == 4 * 6 and all(packed)
    else:
        assert packed == []


def stack_outputs(stack: torch.nn.Module, x: torch.Tensor, carried: Any, reset: Any) -> list[torch.Tensor]:
    stack.zero_grad()
    x.grad = None
    y, state = stack(x, carried, reset)
    (y.sin().sum() + sum(s.cos().sum() for s in state)).backward()
    return [y, *state, x.grad.clone(), *(p.grad.clone() for p in stack.parameters())]


@pytest.mark.parametrize("seed", range(4))
def test_segments_laid_out_on_the_host_compute_the_per_step_loop(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random resets (several in a stream, at step 0, at the last step, in every stream or in none), as a
    :class:`Resets`, as a bare mask and as a layer's plain ``keep_at`` dict: outputs, final state and gradients of
    the per-step loop."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    stack = zoo.build("lstm", 5, 6, 2).train()
    batch, steps = 5, 7
    x = torch.randn(batch, steps, 5, requires_grad=True)
    reset = torch.rand(batch, steps, generator=generator) < 0.3
    reset[seed % batch] = seed % 2 == 0  # one stream resets at every step, or never
    carried = tuple(torch.randn(2, batch, 6) for _ in range(2))
    monkeypatch.setattr(FusedLayer, "packed_segments", False)
    loop = stack_outputs(stack, x, carried, reset)
    monkeypatch.setattr(FusedLayer, "packed_segments", True)
    for given in (Resets.from_mask(reset), reset):
        for expected, got in zip(loop, stack_outputs(stack, x, carried, given), strict=True):
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    layer, state = stack.layers[0], tuple(s[0] for s in carried)
    keep = (~reset).float()
    plain = {t: keep[:, t] for t in range(1, steps) if reset[:, t].any()}
    y_loop, _ = layer(x, state, plain)  # packed
    monkeypatch.setattr(FusedLayer, "packed_segments", False)
    torch.testing.assert_close(y_loop, layer(x, state, plain)[0], atol=2e-5, rtol=1e-4)


def test_a_bare_mask_on_the_device_costs_one_synchronisation_and_resets_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zoo contract keeps ``reset`` a plain mask; one on a GPU is copied to the host once per window, whatever
    the number of layers, and a :class:`Resets` made before the transfer costs nothing."""
    monkeypatch.setattr(FusedLayer, "packed_segments", True)
    stack = zoo.build("lstm", 4, 5, 4)
    x = torch.randn(3, 6, 4)
    reset = torch.zeros(3, 6, dtype=torch.bool)
    reset[0, 2] = reset[1, 4] = reset[2, 0] = True
    resets = Resets.from_mask(reset)  # on the host, before the window moves
    counts = []
    for given in (reset, resets):
        with HostSyncCounter() as counter:
            counter.mark(x, reset, list(stack.parameters()))
            moved = given if isinstance(given, torch.Tensor) else given.to(x.device)
            counter.counting = True
            stack(x, reset=moved)
        counts.append(dict(counter.counts))
    assert counts == [{"cpu": 1}, {}]


def test_the_evaluation_loop_passes_the_host_made_resets_and_never_waits_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``deterministic_nll`` (``lm-zoo evaluate``'s loop) hands the model each window's :class:`Resets`, so a window
    with resets inside costs no synchronisation; the bare mask alone costs one per window. Same NLL either way."""
    monkeypatch.setattr(FusedLayer, "packed_segments", True)
    torch.manual_seed(0)
    model = zoo.RecurrentLM(vocab_size=11, architecture="lstm", embedding_size=4, hidden_size=5, num_layers=2).eval()
    ids = torch.randint(11, (3, 13))
    reset = torch.rand(3, 12) < 0.3
    windows = [
        LMBatch(ids[:, t : t + 6], ids[:, t + 1 : t + 7], reset[:, t : t + 6], Resets.from_mask(reset[:, t : t + 6]))
        for t in (0, 6)
    ]
    results = []
    for given in (windows, [window._replace(resets=None) for window in windows]):
        with HostSyncCounter() as counter:
            counter.mark(list(model.parameters()))
            counter.counting = True
            nll = torch.cat([n for n, _ in deterministic_nll(model, given)], dim=1)  # (B, T)
        results.append((nll, counter.counts["cpu"]))
    (with_resets, waits), (bare, bare_waits) = results
    torch.testing.assert_close(with_resets, bare)
    assert waits == 0 and bare_waits == 2


def test_mc_dropout_works_out_each_calls_resets_on_the_host_and_never_waits_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MC dropout replicates a window and splits the replicas into forward calls; each call's :class:`Resets` is made
    from the host mask, so windows with resets inside cost no synchronisation even when they carry the bare mask
    alone. At dropout scale 0 the replicas are the deterministic model, and their NLL is the deterministic pass's."""
    monkeypatch.setattr(FusedLayer, "packed_segments", True)
    torch.manual_seed(0)
    model = zoo.RecurrentLM(
        vocab_size=11, architecture="lstm", embedding_size=4, hidden_size=5, num_layers=2, dropout=0.3
    ).eval()
    ids = torch.randint(11, (3, 13))
    reset = torch.rand(3, 12) < 0.3
    assert reset[:, 1:6].any() and reset[:, 7:].any()  # resets inside both windows
    windows = [LMBatch(ids[:, t : t + 6], ids[:, t + 1 : t + 7], reset[:, t : t + 6]) for t in (0, 6)]
    with HostSyncCounter() as counter:
        counter.mark(list(model.parameters()))
        counter.counting = True
        settings = MCDropout(samples=4, dropout_scale=0.0, rows_per_call=5)  # calls that cut through replicas
        mc = torch.cat([nll for nll, _ in mc_nll(model, windows, settings)], dim=1)  # (B, T)
    assert counter.counts["cpu"] == 0
    deterministic = torch.cat([n for n, _ in deterministic_nll(model, windows)], dim=1)
    torch.testing.assert_close(mc, deterministic.double())


def test_the_epoch_mean_weighs_each_window_by_its_predicted_tokens() -> None:
    """The metric that averages nats per token without a NaN check (torchmetrics' MeanMetric with
    nan_strategy="disable" drops the weights): a window of 3 tokens at 1.0 and one of 1 token at 2.0 average 1.25,
    not 1.5, and a window with nothing to predict adds nothing."""
    from lightning_modules.stateful import WeightedMean

    mean = WeightedMean()
    for nats, tokens in ((1.0, 3), (2.0, 1), (7.0, 0)):
        mean.update(torch.tensor(nats), weight=torch.tensor(tokens))
    assert mean.compute().item() == pytest.approx(1.25)
