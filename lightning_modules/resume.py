"""What a checkpoint must hold beyond Lightning's own state for a resumed ``fit`` to continue exactly, and the guard
that keeps non-finite weights out of checkpoints.

Lightning restores the weights, optimizer, schedulers, loop counters and callback states (weight averaging included),
but not the random number generators (``dump_checkpoint`` saves none), so a resumed run would draw other dropout masks
from the first step on. :class:`~lightning_modules.language_model.LanguageModel` stores these under
:data:`RESUME_KEY` and puts them back when training starts; a checkpoint loaded for evaluation never needs or uses
them.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

RESUME_KEY = "lm_zoo_resume"


def rng_states() -> dict[str, Any]:
    """The global random number generators' states: torch (CPU and every initialised CUDA device), numpy, Python.

    Held as tensors and plain values, so the checkpoint still loads with ``torch.load(weights_only=True)`` (a numpy
    array in it would not).
    """
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_states` returned (CUDA states only for the devices this process has)."""
    torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and torch.cuda.is_available():
        for device, state in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state.cpu(), device)
    numpy = states["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"]))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))


def non_finite(tensors: Mapping[str, Tensor]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or an infinity."""
    return [
        name
        for name, tensor in tensors.items()
        if isinstance(tensor, Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
