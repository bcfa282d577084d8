"""The zoo: recurrent stacks by name, in pure PyTorch (no Lightning), one file per architecture family.

>>> import zoo
>>> stack = zoo.build("lstm", input_size=16, hidden_size=32, num_layers=2)
>>> y, state = stack(torch.zeros(4, 10, 16))     # (B, T, I) -> (B, T, H)

Every stack follows the contract in :mod:`zoo.stack`: ``forward(x, state=None, reset=None) -> (y, state)``.
The catalogue (names, presets, :func:`build`) is :mod:`zoo.architectures`; adding an architecture is one entry there.
"""

from __future__ import annotations

from zoo.lazy import lazy_names

# name -> the module that defines it. Imported when first used, not with the package, so that ``zoo.errors`` (which
# every layer raises) costs no torch import: ``lm-zoo --help`` prints at once.
_HOMES = {
    "Architecture": "zoo.architectures",
    "LMConfig": "zoo.language_model",
    "RecurrentLM": "zoo.language_model",
    "State": "zoo.state",
    "build": "zoo.architectures",
    "describe": "zoo.architectures",
    "detach_state": "zoo.state",
    "get": "zoo.architectures",
    "mask_state": "zoo.state",
    "names": "zoo.architectures",
    "preset": "zoo.architectures",
    "units_for_budget": "zoo.architectures",
}
__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
