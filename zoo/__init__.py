"""The zoo: recurrent stacks by name, in pure PyTorch (no Lightning), one file per architecture family.

>>> import zoo
>>> stack = zoo.build("lstm", input_size=16, hidden_size=32, num_layers=2)
>>> y, state = stack(torch.zeros(4, 10, 16))     # (B, T, I) -> (B, T, H)

Every stack follows the contract in :mod:`zoo.base`: ``forward(x, state=None, reset=None) -> (y, state)``.
The catalogue (names, presets, :func:`build`) is :mod:`zoo.architectures`; adding an architecture is one entry there.
"""

from zoo.architectures import Architecture, build, describe, get, names, preset, units_for_budget
from zoo.base import State, detach_state, mask_state
from zoo.language_model import RecurrentLM

__all__ = [
    "Architecture",
    "RecurrentLM",
    "State",
    "build",
    "describe",
    "detach_state",
    "get",
    "mask_state",
    "names",
    "preset",
    "units_for_budget",
]
