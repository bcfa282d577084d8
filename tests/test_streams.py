"""Stream batching: every token predicted once per epoch, contiguous columns, disjoint DDP ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.windows import IGNORE_INDEX, StreamWindows, column_spans

START = 0


def _stream(n: int) -> torch.Tensor:
    return torch.arange(1, n + 1)  # distinct ids, so positions can be recovered from values


def _columns(ds: StreamWindows) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Concatenate each column's inputs and (unpadded) targets over an epoch; also the window lengths."""
    rows = ds.tokens.size(0)
    inputs: list[list[int]] = [[] for _ in range(rows)]
    targets: list[list[int]] = [[] for _ in range(rows)]
    lengths = []
    for batch in ds:
        assert batch.inputs.shape == batch.targets.shape
        lengths.append(batch.inputs.size(1))
        for r in range(rows):
            keep = batch.targets[r] != IGNORE_INDEX
            inputs[r] += batch.inputs[r][keep].tolist()
            targets[r] += batch.targets[r][keep].tolist()
    return inputs, targets, lengths


@pytest.mark.parametrize(("n", "batch", "bptt"), [(100, 3, 7), (101, 4, 5), (10, 3, 35), (64, 8, 8), (5, 8, 3)])
def test_every_token_predicted_exactly_once(n: int, batch: int, bptt: int) -> None:
    ds = StreamWindows(_stream(n), batch, bptt, start_id=START)
    inputs, targets, _ = _columns(ds)
    predicted = sorted(t for column in targets for t in column)
    assert predicted == list(range(1, n + 1))  # every token, once, the first one included
    assert ds.num_predicted == n
    # each (input -> target) pair is a real bigram of the stream (with the start token before the first)
    full = [START] + list(range(1, n + 1))
    for column_inputs, column_targets in zip(inputs, targets):
        for x, y in zip(column_inputs, column_targets):
            assert full.index(y) == full.index(x) + 1


def test_windows_are_contiguous_per_column_and_the_last_is_kept() -> None:
    ds = StreamWindows(_stream(100), 3, 7, start_id=START)
    inputs, targets, lengths = _columns(ds)
    assert lengths == [7, 7, 7, 7] + [6]  # column length ceil(100/3) = 34 = 4*7 + 6
    assert len(ds) == len(lengths)
    spans = column_spans(100, 3)
    full = [START] + list(range(1, 101))
    for (start, length), column_inputs, column_targets in zip(spans, inputs, targets):
        assert column_inputs == full[start : start + length]
        assert column_targets == full[start + 1 : start + length + 1]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_ranks_get_disjoint_columns_that_cover_the_data(world: int) -> None:
    n, batch, bptt = 203, 4, 6
    per_rank = [StreamWindows(_stream(n), batch, bptt, start_id=START, rank=r, world_size=world) for r in range(world)]
    seen: list[int] = []
    window_counts = set()
    for ds in per_rank:
        _, targets, lengths = _columns(ds)
        window_counts.add(len(lengths))
        seen += [t for column in targets for t in column]
    assert sorted(seen) == list(range(1, n + 1))  # disjoint (no duplicates) and covering
    assert len(window_counts) == 1  # every rank runs the same number of steps


def test_variable_bptt_is_deterministic_bounded_and_covers_the_epoch() -> None:
    ds = StreamWindows(_stream(5000), 4, 35, start_id=START, variable_bptt=True, seed=3)
    first = ds.window_lengths(0)
    assert first == ds.window_lengths(0)
    assert first != ds.window_lengths(1)
    assert sum(first) == ds.column_length
    assert all(5 <= length <= 55 for length in first[:-1])
    assert 30 < np.mean(first) < 40
    other_rank = StreamWindows(_stream(5000), 4, 35, start_id=START, variable_bptt=True, seed=3, rank=1, world_size=2)
    assert other_rank.window_lengths(0) == StreamWindows(
        _stream(5000), 4, 35, start_id=START, variable_bptt=True, seed=3, rank=0, world_size=2
    ).window_lengths(0)
    _, targets, _ = _columns(ds)
    assert sorted(t for column in targets for t in column) == list(range(1, 5001))


def test_variable_bptt_rounded_to_a_multiple_keeps_every_target_in_a_few_shapes() -> None:
    """bptt_multiple: each drawn length rounded to a multiple, the epoch's last window padded to one (its extra
    targets ignored, its extra inputs the start id); every target predicted once, as without it, in a few shapes."""
    plain = StreamWindows(_stream(5000), 4, 35, start_id=START, variable_bptt=True, seed=3)
    rounded = StreamWindows(_stream(5000), 4, 35, start_id=START, variable_bptt=True, seed=3, bptt_multiple=8)
    lengths = rounded.window_lengths(0)
    assert sum(lengths) == rounded.column_length and all(length % 8 == 0 for length in lengths[:-1])
    # The same draws, rounded: the nearest multiple of 8 of each of plain's lengths while both sequences run alike.
    assert lengths[0] == 8 * max(1, round(plain.window_lengths(0)[0] / 8))
    inputs, targets, shapes = _columns(rounded)
    assert all(shape % 8 == 0 for shape in shapes) and len(set(shapes)) <= 6
    assert sorted(t for column in targets for t in column) == list(range(1, 5001))
    assert inputs == _columns(plain)[0]  # the predicted positions see the same inputs
    last = list(rounded)[-1]
    short = -lengths[-1] % 8
    if short:
        assert (last.inputs[:, -short:] == START).all() and (last.targets[:, -short:] == IGNORE_INDEX).all()
    fixed = StreamWindows(_stream(5000), 4, 35, start_id=START, bptt_multiple=8)  # only variable lengths are rounded
    assert fixed.window_lengths(0) == StreamWindows(_stream(5000), 4, 35, start_id=START).window_lengths(0)
