"""``zoo.sampling``: the device path of ``generate`` (captured as one CUDA graph a token on a GPU), run eagerly on the
CPU against the plain path, against the distribution it draws from, and for the host waits it leaves.

The GPU suite (``tests/test_gpu.py``) holds the captured step equal to the same step run eagerly."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.host_syncs import HostSyncCounter
from zoo import RecurrentLM, sampling


def tiny(architecture: str, seed: int = 0) -> RecurrentLM:
    torch.manual_seed(seed)
    return RecurrentLM(23, architecture, 8, 8, num_layers=2).eval()


def device_path(model: RecurrentLM, prompt: torch.Tensor, tokens: int, **options) -> list[list[int]]:
    """``generate``'s device path, eagerly (what a graph replays on CUDA)."""
    with torch.no_grad():
        logits, state = model(prompt)
        return sampling.sample(model._sampling_step(prompt), logits[:, -1], state, tokens, capture=False, **options)


@pytest.mark.parametrize("architecture", ["lstm", "mogrifier", "on_lstm", "skip_lstm", "mlstm"])
def test_the_device_path_equals_the_plain_one_where_both_are_deterministic(architecture: str) -> None:
    """With top-k 1 both paths take the most likely token: the same ids, through the same states, and the same stops
    (a stop id met in one row, past the first stop check at 32 tokens in another)."""
    model = tiny(architecture)
    prompt = torch.randint(23, (3, 4), generator=torch.Generator().manual_seed(1))
    greedy = model.generate(prompt, 70, top_k=1)
    assert device_path(model, prompt, 70, top_k=1) == greedy
    stop = greedy[0][4]
    plain = model.generate(prompt, 70, top_k=1, stop_id=stop)
    assert plain[0] == greedy[0][: greedy[0].index(stop) + 1]
    assert device_path(model, prompt, 70, top_k=1, stop_id=stop) == plain


def test_the_draws_follow_softmax_of_the_scores_and_never_a_masked_token() -> None:
    """Each of 40,000 rows draws once from the same scores (temperature 0.5, top-k 4 of 6): every frequency within
    5 standard errors of its probability, written out here."""
    logits = torch.tensor([0.3, -1.0, 0.9, 0.0, 1.4, -0.2])
    rows = 40_000
    scores = sampling.next_token_scores(logits.expand(rows, -1), temperature=0.5, top_k=4)
    ids = sampling.draw(scores, torch.Generator().manual_seed(0))
    assert ids.shape == (rows, 1)
    counts = torch.bincount(ids.flatten(), minlength=6).tolist()
    kept = [0, 2, 3, 4]  # the 4 highest logits
    total = sum(math.exp(logits[i].item() / 0.5) for i in kept)
    for token, count in enumerate(counts):
        if token not in kept:
            assert count == 0, (token, counts)
            continue
        p = math.exp(logits[token].item() / 0.5) / total
        assert abs(count / rows - p) < 5 * math.sqrt(p * (1 - p) / rows), (token, count / rows, p)


def test_a_seed_gives_the_same_samples_and_another_seed_others() -> None:
    model = tiny("lstm")
    prompt = torch.zeros(2, 1, dtype=torch.long)

    def run(seed: int) -> list[list[int]]:
        return device_path(model, prompt, 40, generator=torch.Generator().manual_seed(seed))

    assert run(3) == run(3)
    assert run(3) != run(4)
    torch.manual_seed(5)  # without a generator: torch's global one, as the plain path
    first = device_path(model, prompt, 40)
    torch.manual_seed(5)
    assert device_path(model, prompt, 40) == first


def test_the_host_waits_once_per_stop_check_not_once_per_token() -> None:
    """Counted by the host-sync counter (benchmarks/host_syncs.py) with the model on the "device": 200 tokens with a
    stop id that never comes wait 6 times (the checks at 32, 64, ..., 192) plus once for the ids at the end; the plain
    path waits at every token."""
    model = tiny("lstm")
    prompt = torch.zeros(1, 1, dtype=torch.long)
    with HostSyncCounter() as counter:
        counter.mark(list(model.parameters()), prompt)
        counter.counting = True
        device_path(model, prompt, 200, stop_id=99)  # no such id: every check finds a row still going
        device_waits = sum(counter.take()[0].values())
        model.generate(prompt, 200, stop_id=99)
        plain_waits = sum(counter.take()[0].values())
    assert device_waits == 200 // sampling.STOP_CHECK_EVERY + 1
    assert plain_waits >= 200


def test_graphs_are_for_cuda_and_follow_the_settings() -> None:
    from zoo import settings

    assert not sampling.captures(torch.device("cpu"))
    assert sampling.captures(torch.device("cuda"))
    with settings.overridden(window_graphs=False):
        assert not sampling.captures(torch.device("cuda"))
    with settings.overridden(plain_kernels=True):
        assert not sampling.captures(torch.device("cuda"))
