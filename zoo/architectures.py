"""The catalogue of the zoo: every architecture by name, with its presets, and :func:`build`.

Adding an architecture: write ``zoo/<family>.py``, then add one :class:`Architecture` entry below with a ``tiny``
preset (what the tests train) and the paper-size preset.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from zoo.errors import ConfigError
from zoo.fs_rnn import FSRNN
from zoo.genome import Genome
from zoo.gru import GRU, GRUPaper
from zoo.lstm import LSTM
from zoo.lstm_ablations import LSTMNoForget, LSTMNoInput, LSTMNoOutput
from zoo.mlstm import MLSTM
from zoo.mogrifier import Mogrifier
from zoo.mut import MUT1, MUT2, MUT3
from zoo.on_lstm import ONLSTM
from zoo.rnn import TanhRNN
from zoo.skip_rnn import SkipLSTM
from zoo.stack import STACK_OPTIONS


@dataclass(frozen=True)
class Architecture:
    """A registry entry.

    Attributes:
        name: the name used in configs (``model.init_args.architecture``).
        cls: the ``nn.Module`` class; its ``__init__(input_size, hidden_size, num_layers, **options)``.
        description: one line for ``lm-zoo models``.
        reference: where the equations come from.
        presets: named sizes, each a dict of ``build`` keyword arguments.
    """

    name: str
    cls: type[nn.Module]
    description: str
    reference: str
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def options(self) -> list[str]:
        """Keyword options accepted beyond input_size, hidden_size and num_layers."""
        params = inspect.signature(self.cls.__init__).parameters
        own = [
            name
            for name, p in params.items()
            if name not in ("self", "input_size", "hidden_size", "num_layers") and p.kind is not p.VAR_KEYWORD
        ]
        takes_stack_options = any(p.kind is p.VAR_KEYWORD for p in params.values())
        return own + (list(STACK_OPTIONS) if takes_stack_options else [])


_TINY = {"input_size": 16, "hidden_size": 16, "num_layers": 2}
# Zaremba et al. 2014 "medium": 2 x 650 (the size the Jozefowicz PTB comparisons and pytorch/examples use).
_MEDIUM = {"input_size": 650, "hidden_size": 650, "num_layers": 2}

_REGISTRY: dict[str, Architecture] = {
    arch.name: arch
    for arch in [
        Architecture(
            "lstm",
            LSTM,
            "LSTM with forget-gate bias (default 1, 'LSTM-b'); fused kernel unless a reset falls mid-window",
            "Hochreiter & Schmidhuber 1997; Jozefowicz et al. 2015 §2.2",
            {
                "tiny": _TINY,
                "medium": _MEDIUM,
                "zaremba-small": {"input_size": 200, "hidden_size": 200, "num_layers": 2},
                "zaremba-large": {"input_size": 1500, "hidden_size": 1500, "num_layers": 2},
            },
        ),
        Architecture(
            "gru",
            GRU,
            "GRU, cuDNN 'reset after' form; fused kernel unless a reset falls mid-window",
            "Cho et al. 2014",
            {"tiny": _TINY, "medium": _MEDIUM},
        ),
        Architecture(
            "rnn_tanh",
            TanhRNN,
            "tanh (Elman) RNN; fused kernel unless a reset falls mid-window",
            "Elman 1990; Jozefowicz et al. 2015 baseline",
            {"tiny": _TINY, "medium": _MEDIUM},
        ),
        # Jozefowicz et al. 2015 (Table 3) compare cells at 5M/10M/20M parameters, sizing each by its own hidden size.
        # "jozefowicz-ptb": 2 layers, embedding = hidden, 10k-word vocabulary, untied softmax; H chosen (in steps of
        # 10) so that stack + embedding (V x H) + softmax (H x V + V) is closest to 20M (the LSTM's 2 x 650 is 19.8M).
        Architecture(
            "lstm_no_forget",
            LSTMNoForget,
            "LSTM-f: the LSTM without a forget gate (f = 1, c' = c + i*g)",
            "Jozefowicz et al. 2015 Table 1",
            {"tiny": _TINY, "jozefowicz-ptb": {"input_size": 700, "hidden_size": 700, "num_layers": 2}},  # 19.9M
        ),
        Architecture(
            "lstm_no_input",
            LSTMNoInput,
            "LSTM-i: the LSTM without an input gate (i = 1, c' = f*c + g); forget bias 1",
            "Jozefowicz et al. 2015 Table 1",
            {"tiny": _TINY, "jozefowicz-ptb": {"input_size": 700, "hidden_size": 700, "num_layers": 2}},  # 19.9M
        ),
        Architecture(
            "lstm_no_output",
            LSTMNoOutput,
            "LSTM-o: the LSTM without an output gate (o = 1, h = tanh(c)); forget bias 1",
            "Jozefowicz et al. 2015 Table 1, §4",
            {"tiny": _TINY, "jozefowicz-ptb": {"input_size": 700, "hidden_size": 700, "num_layers": 2}},  # 19.9M
        ),
        Architecture(
            "gru_paper",
            GRUPaper,
            "GRU as written in Jozefowicz et al. 2015: reset gate before the matmul, W_hh (r*h); per-step loop",
            "Cho et al. 2014; Jozefowicz et al. 2015 §2.3",
            {"tiny": _TINY, "jozefowicz-ptb": {"input_size": 700, "hidden_size": 700, "num_layers": 2}},  # 19.9M
        ),
        Architecture(
            "mut1",
            MUT1,
            "MUT1: evolved GRU-like cell, z from x only, tanh(x) in the candidate (projected if input != hidden)",
            "Jozefowicz et al. 2015 §4",
            {"tiny": _TINY, "jozefowicz-ptb": {"input_size": 770, "hidden_size": 770, "num_layers": 2}},  # 20.2M
        ),
        Architecture(
            "mut2",
            MUT2,
            "MUT2: evolved GRU-like cell, reset gate sees x without a matrix (projected if input != hidden)",
            "Jozefowicz et al. 2015 §4",
            {"tiny": _TINY, "jozefowicz-ptb": {"input_size": 730, "hidden_size": 730, "num_layers": 2}},  # 19.9M
        ),
        Architecture(
            "mut3",
            MUT3,
            "MUT3: evolved GRU-like cell, update gate sees tanh(h)",
            "Jozefowicz et al. 2015 §4",
            {"tiny": _TINY, "jozefowicz-ptb": {"input_size": 700, "hidden_size": 700, "num_layers": 2}},  # 19.9M
        ),
        Architecture(
            "on_lstm",
            ONLSTM,
            "ON-LSTM: cumax master forget/input gates over chunks of chunk_size neurons; split points d̂ per step",
            "Shen et al. 2019 §4, eqs. 1-15",
            {
                "tiny": {**_TINY, "chunk_size": 4},
                # §5.1: 3 layers of 1150, C = 10, embedding 400. The paper's last layer has 400 units (= embedding, for
                # tying); the zoo stacks equal layers and the LanguageModel ties through a projection instead.
                "shen-ptb": {"input_size": 400, "hidden_size": 1150, "num_layers": 3, "chunk_size": 10},
            },
        ),
        Architecture(
            "fs_rnn",
            FSRNN,
            "Fast-Slow LSTM: fast_cells LSTM cells in a chain per step, one slow LSTM cell between F1 and F2",
            "Mujika et al. 2017",
            {
                "tiny": {**_TINY, "slow_size": 8},
                # PTB characters, FS-LSTM-2: fast 700, slow 400, embedding 128 (with 50 characters: 7.2M parameters,
                # the paper's Table 1 count; the authors' configs.py has embed_size 128, hyper_size 400).
                "mujika-ptb": {
                    "input_size": 128,
                    "hidden_size": 700,
                    "num_layers": 1,
                    "fast_cells": 2,
                    "slow_size": 400,
                },
            },
        ),
        Architecture(
            "skip_lstm",
            SkipLSTM,
            "Skip LSTM: a binary update gate (straight-through round) copies the state on skipped steps; budget loss",
            "Campos et al. 2018 (Skip RNN)",
            {
                "tiny": _TINY,
                "medium": _MEDIUM,
                # The authors' adding task: (value, marker) inputs, one layer of 110 units (src/01_adding_task.py).
                "campos-adding": {"input_size": 2, "hidden_size": 110, "num_layers": 1},
            },
        ),
        # Melis et al. 2020 compare models at 24M parameters on PTB (Tables 1, 3): 2 layers, 10k words, tied
        # embeddings with embedding = hidden (input embedding ratio 1, no projection). "melis-ptb" picks the hidden
        # size whose stack + embedding (V x H) + softmax bias (V) is closest to 24M (the LSTM's is 950: 23.97M).
        Architecture(
            "mogrifier",
            Mogrifier,
            "Mogrifier LSTM: x and h_prev gate each other for `rounds` rounds (x first, factor 2) before the LSTM; "
            "rank <= 0 is full rank, zigzag=False the §4.1 ablation",
            "Melis, Kočiský & Blunsom 2020 (Mogrifier LSTM) §2 eqs. 1-2, §4.1",
            {
                "tiny": {**_TINY, "rounds": 5, "rank": 4},
                # r = 5, k = 84: in the paper's best ranges (r in {5, 6}, k in [40, 90], §4.1); 23.98M.
                "melis-ptb": {"input_size": 912, "hidden_size": 912, "num_layers": 2, "rounds": 5, "rank": 84},
            },
        ),
        Architecture(
            "genome",
            Genome,
            "any cell written as a computation graph (cell_options.genome: a genome string, or lstm, gru_paper, "
            "rnn_tanh, mut1-3); what the architecture search mutates",
            "Jozefowicz et al. 2015 §3.2",
            {
                "tiny": {**_TINY, "genome": "lstm"},
                "jozefowicz-ptb": {"input_size": 650, "hidden_size": 650, "num_layers": 2, "genome": "lstm"},
            },
        ),
        Architecture(
            "mlstm",
            MLSTM,
            "mLSTM: the LSTM run on h_m = (W_mx x) * (W_mh h_prev) instead of h_prev",
            "Krause et al. 2016, as defined in Melis et al. 2020 §4.2",
            {
                "tiny": _TINY,
                "melis-ptb": {"input_size": 874, "hidden_size": 874, "num_layers": 2},  # 24.04M (Table 3's mLSTM)
            },
        ),
    ]
}


def names() -> list[str]:
    """Registered architecture names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> Architecture:
    """The registry entry for ``name``.

    Raises:
        ConfigError: ``name`` is not registered (the message lists the known names).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown architecture {name!r}: choose one of {', '.join(names())} (`lm-zoo models` describes them)"
        ) from None


def describe() -> list[tuple[str, str, str]]:
    """``(name, description, reference)`` for every architecture."""
    return [(a.name, a.description, a.reference) for a in (_REGISTRY[n] for n in names())]


def preset(name: str, size: str) -> dict[str, Any]:
    """The ``build`` keyword arguments of a named size (``"tiny"``, ``"medium"``, ...) of an architecture."""
    arch = get(name)
    if size not in arch.presets:
        raise ConfigError(f"architecture {name!r} has no preset {size!r}: it has {', '.join(arch.presets)}")
    return dict(arch.presets[size])


def build(name: str, input_size: int, hidden_size: int, num_layers: int = 1, **options: Any) -> nn.Module:
    """Build a recurrent stack by name.

    Args:
        name: a registered architecture (see :func:`names`).
        input_size: size of each input vector.
        hidden_size: units per layer.
        num_layers: stacked layers.
        **options: architecture options (e.g. ``forget_bias``, ``dropout``, ``init_range``).

    Returns:
        An ``nn.Module`` with ``forward(x: (B, T, I), state=None, reset=None) -> (y: (B, T, H), state)``.

    Raises:
        ConfigError: unknown name, or an option the architecture does not take.
    """
    arch = get(name)
    unknown = sorted(set(options) - set(arch.options()))
    if unknown:
        raise ConfigError(
            f"architecture {name!r} has no option {', '.join(map(repr, unknown))}: its options are "
            f"{', '.join(arch.options())}"
        )
    try:
        return arch.cls(input_size, hidden_size, num_layers, **options)
    except ValueError as error:  # a cell's own check of an option's value: the user's input, so one line
        raise ConfigError(f"architecture {name!r}: {error}") from None


def units_for_budget(parameters: Callable[[int], int], budget: int, most: int = 4096, what: str = "the model") -> int:
    """The most units whose model has at most ``budget`` parameters: the binary search of Jozefowicz et al. 2015
    §3.7 ("we used binary search to select the appropriate number of units for a given number of parameters").

    Args:
        parameters: a model's parameter count for a number of units (increasing in it).
        budget: the parameter budget.
        most: the largest number of units considered.
        what: the model, as the error names it.

    Raises:
        ConfigError: even one unit is over the budget.
    """
    if parameters(1) > budget:
        raise ConfigError(f"a budget of {budget} parameters is too small for {what}: one unit needs {parameters(1)}")
    low, high = 1, most
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if parameters(middle) <= budget else (low, middle - 1)
    return low
