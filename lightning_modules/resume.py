"""What a checkpoint must hold beyond Lightning's own state for a resumed ``fit`` to continue exactly, and the guard
that keeps non-finite weights out of checkpoints.

Lightning restores the weights, optimizer, schedulers, loop counters and callback states (weight averaging included),
but not the random number generators (``dump_checkpoint`` saves none), so a resumed run would draw other dropout masks
from the first step on. :class:`~lightning_modules.stateful.StatefulTraining` stores these under
:data:`RESUME_KEY` and puts them back when training starts; a checkpoint loaded for evaluation never needs or uses
them.

Under DDP every rank reads its own columns of the stream and draws its own dropout masks, so each rank's carried
state, loss accumulator and generators differ: they are gathered into the checkpoint (which rank 0 alone writes) keyed
by rank, torchtitan's ``dp_rank_N`` way, with the world size::

    checkpoint["lm_zoo_resume"] = {"world_size": 2, "rank_0": {...}, "rank_1": {...}}

and each rank takes back its own (:func:`rank_state`). Checkpoints written before this layout hold one process's state
un-keyed; they resume in one process as before.

Two kinds of randomness, seeded from the run's one seed (LightningCLI's ``seed_everything`` gives every rank the same):

- per rank: the global generators (dropout masks, state dropping). Rank 0 keeps the seeded ones, so a one-process run
  draws the masks it always drew (NCE runs excepted: their noise no longer advances these generators); rank r > 0 is
  re-seeded with :func:`derived_seed` ``(seed, 1 + r)`` when training starts, so no two ranks repeat each other's
  masks (:func:`seed_rank`).
- shared by all ranks: a dedicated generator, :func:`new_shared_generator`, for draws that the reference shares
  across the whole batch (the NCE / sampled-softmax noise words, Léonard et al. 2016's ``batchnoise``): the same seed
  on every rank and the same number of draws per step, so every rank draws the same noise words at every step.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from zoo.errors import CheckpointError

RESUME_KEY = "lm_zoo_resume"
WORLD_SIZE = "world_size"  # the key that marks the per-rank layout (absent in one-process checkpoints before it)
SHARED_STREAM = 0  # derived_seed's stream of the shared generator; rank r's is r + 1


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


def derived_seed(seed: int, stream: int) -> int:
    """A seed for one independent stream of a run seeded with ``seed``: numpy's ``SeedSequence`` hashes the pair, so
    the streams neither coincide nor overlap the way ``seed + rank`` would with another run's ``seed``.

    Args:
        seed: the run's seed (``torch.initial_seed()`` after ``seed_everything``), >= 0.
        stream: which stream (:data:`SHARED_STREAM`, or ``1 + rank``).

    Returns:
        A 32-bit seed, valid for torch, numpy and Python alike.
    """
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


def seed_rank(seed: int, rank: int) -> None:
    """Give rank ``rank`` its own global generators (torch on every device, numpy, Python): rank 0 keeps the run's
    seeded ones, rank r > 0 is re-seeded from :func:`derived_seed` ``(seed, 1 + r)``."""
    if rank == 0:
        return
    rank_seed = derived_seed(seed, 1 + rank)
    torch.manual_seed(rank_seed)  # also every CUDA device's
    np.random.seed(rank_seed)
    random.seed(rank_seed)


def new_shared_generator(seed: int, device: torch.device) -> torch.Generator:
    """The generator every rank draws identically from (seeded from :func:`derived_seed` ``(seed, SHARED_STREAM)``,
    a stream apart from rank 0's global one), on ``device`` so that draws happen where the tensors are."""
    return torch.Generator(device=device).manual_seed(derived_seed(seed, SHARED_STREAM))


def generator_state(generator: torch.Generator) -> dict[str, Any]:
    """What :func:`set_generator_state` needs to continue ``generator``'s stream (a CPU tensor and the device type)."""
    return {"device": generator.device.type, "state": generator.get_state()}


def set_generator_state(generator: torch.Generator, saved: Mapping[str, Any]) -> None:
    """Continue ``generator`` from :func:`generator_state`'s ``saved``.

    Raises:
        CheckpointError: ``saved`` comes from another kind of device (a CPU generator's state is not a CUDA one's).
    """
    if saved["device"] != generator.device.type:
        raise CheckpointError(
            f"the checkpoint's shared noise generator ran on {saved['device']}, this run's on "
            f"{generator.device.type}: resume it on {saved['device']} (--trainer.accelerator), or start a new run"
        )
    generator.set_state(saved["state"].cpu())


def keyed_by_rank(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint's resume entry: every rank's state (``states[r]`` is rank r's) under ``rank_r``, and the world
    size."""
    return {WORLD_SIZE: len(states), **{f"rank_{rank}": state for rank, state in enumerate(states)}}


def rank_state(resume: Mapping[str, Any], rank: int, world_size: int) -> Mapping[str, Any]:
    """Rank ``rank``'s own resume state from the checkpoint's entry (:func:`keyed_by_rank`, or the un-keyed
    one-process layout written before it).

    Raises:
        CheckpointError: the checkpoint was written by another number of processes. The carried state belongs to
            each rank's own columns of the stream, which another world size cuts differently, and the ranks'
            generators cannot be split or merged: no exact resume exists, so none is pretended.
    """
    written = int(resume.get(WORLD_SIZE, 1))
    if written != world_size:
        kept = "one process's" if WORLD_SIZE not in resume else f"{written} processes'"
        raise CheckpointError(
            f"this checkpoint holds {kept} training state (carried recurrent state of each process's columns, "
            f"random generators) and this run has {world_size}: resume it with --trainer.devices x --trainer.num_nodes "
            f"= {written}, or start a new run"
        )
    return resume if WORLD_SIZE not in resume else resume[f"rank_{rank}"]


def gathering_world_size(trainer: Any) -> int:
    """The number of ranks whose state a step or a checkpoint gathers: the trainer's world size inside a process
    group, else 1 (a trainer of several devices before its processes started, or none at all)."""
    world_size = getattr(trainer, "world_size", 1) if trainer is not None else 1
    return world_size if world_size > 1 and dist.is_available() and dist.is_initialized() else 1
