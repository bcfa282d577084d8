"""The learning curve of a run, read from its TensorBoard event files and drawn to a PNG for the model card.

Drawn with Pillow (which tensorboard already requires), not matplotlib: two line plots with labelled axes need no
plotting library, and lm-zoo should not pull one in for a maintainer's picture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from zoo.errors import CheckpointError

CURVE_NAME = "learning_curve.png"
TRAIN_TAG, VALID_TAG = "train_loss", "val_ppl"
MUSIC_VALID_TAG = "val_loss"  # a music model's validation figure: NLL per frame (it has no perplexity)


@dataclass
class RunLog:
    """What a run's TensorBoard events say, over every directory of a run resumed in several (``--ckpt_path last``).

    Attributes:
        train_loss: ``(step, loss)`` of the logged training windows.
        valid: ``(step, figure)`` after each validation: perplexity (a music model's: NLL per frame).
        wall_time: seconds between each directory's first and last event, summed (time between resumptions is left
            out).
        steps: training steps run (Lightning logs a step's index, from 0).
        epochs: epochs begun (Lightning logs the epoch index with the training loss).
    """

    train_loss: list[tuple[int, float]] = field(default_factory=list)
    valid: list[tuple[int, float]] = field(default_factory=list)
    wall_time: float = 0.0
    steps: int = 0
    epochs: int = 0


def read_run(directories: Sequence[Path], valid_tag: str = VALID_TAG) -> RunLog:
    """Read the training loss and validation perplexity logged in ``directories`` (TensorBoard log dirs).

    Args:
        directories: the run's log directories, in order.
        valid_tag: the validation figure's tag (:data:`MUSIC_VALID_TAG` for a music model).

    Raises:
        CheckpointError: a directory holds no events with a training loss.
    """
    log = RunLog()
    for directory in directories:
        events = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        tags = events.Tags().get("scalars", [])
        if TRAIN_TAG not in tags:
            raise CheckpointError(f"{directory} holds no TensorBoard events with {TRAIN_TAG}: pass the run's log dir")
        train = events.Scalars(TRAIN_TAG)
        valid = events.Scalars(valid_tag) if valid_tag in tags else []
        log.train_loss += [(e.step, e.value) for e in train]
        log.valid += [(e.step, e.value) for e in valid]
        times = [e.wall_time for e in train + valid]
        log.wall_time += max(times) - min(times)
        log.steps = max([log.steps] + [e.step + 1 for e in train + valid])
        if "epoch" in tags:
            log.epochs = max([log.epochs] + [int(e.value) + 1 for e in events.Scalars("epoch")])
    log.train_loss.sort()
    log.valid.sort()
    return log


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values spanning [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def _label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e3:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


Series = tuple[list[tuple[float, float]], tuple[int, int, int], str | None]  # points, colour, legend label


def render(log: RunLog, tokens_per_step: int, out: Path, title: str, music: bool = False) -> Path:
    """Draw the training loss and the validation perplexity against training tokens, side by side, to ``out``.

    A music model's (``music``) are the training and validation NLL per frame against training frames.
    """
    unit = "frame" if music else "token"
    panels = [
        (f"training loss (nats per {unit})", log.train_loss, (31, 119, 180)),
        ("validation NLL (nats per frame)" if music else "validation perplexity", log.valid, (214, 39, 40)),
    ]
    return render_panels(
        [
            (name, f"training {unit}s", [([(step * tokens_per_step, y) for step, y in points], colour, None)])
            for name, points, colour in panels
        ],
        out,
        title,
    )


def render_panels(panels: Sequence[tuple[str, str, Sequence[Series]]], out: Path, title: str) -> Path:
    """Line plots side by side in one PNG: each panel ``(name, x-axis label, series)``, each series drawn as a
    line (with dots when it has few points) and named in the panel's corner when it has a label."""
    from PIL import Image, ImageDraw

    width, height, margin = 1000, 380, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((margin, 8), title, fill="black")
    panel_width = (width - (len(panels) + 1) * margin) // len(panels)
    for index, (name, x_label, series) in enumerate(panels):
        left, top = margin + index * (panel_width + margin), 46
        right, bottom = left + panel_width, height - 45
        draw.rectangle((left, top, right, bottom), outline="black")
        draw.text((left, top - 14), name, fill="black")
        draw.text((right - 90, bottom + 22), x_label, fill="black")
        every = [point for points, _, _ in series for point in points]
        if not every:
            draw.text((left + 10, top + 10), "not logged", fill="black")
            continue
        xs, ys = [x for x, _ in every], [y for _, y in every]
        x_low, x_high = 0.0, max(xs) or 1.0
        y_low, y_high = min(ys), max(ys)
        pad = (y_high - y_low) * 0.05 or 1.0
        y_low, y_high = y_low - pad, y_high + pad

        def at(x: float, y: float, box: tuple[int, int, int, int] = (left, top, right, bottom)) -> tuple[float, float]:
            x0, y0, x1, y1 = box
            return x0 + (x - x_low) / (x_high - x_low) * (x1 - x0), y1 - (y - y_low) / (y_high - y_low) * (y1 - y0)

        for tick in _ticks(x_low, x_high):
            x, _ = at(tick, y_low)
            draw.line((x, bottom, x, bottom + 4), fill="black")
            draw.text((x - 10, bottom + 6), _label(tick), fill="black")
        for tick in _ticks(y_low, y_high):
            _, y = at(x_low, tick)
            draw.line((left - 4, y, left, y), fill="black")
            draw.line((left + 1, y, right - 1, y), fill=(230, 230, 230))
            draw.text((left - 44, y - 6), _label(round(tick, 6)), fill="black")
        for number, (points, colour, label) in enumerate(series):
            coordinates = [at(x, y) for x, y in points]
            if len(coordinates) > 1:
                draw.line(coordinates, fill=colour, width=2)
            for x, y in coordinates if len(coordinates) < 40 else []:
                draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=colour)
            if label is not None:
                draw.text((right - 120, top + 8 + 14 * number), label, fill=colour)
    image.save(out, format="PNG", optimize=True)
    return out
