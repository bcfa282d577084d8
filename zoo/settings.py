"""The process's switches, read from the environment once, into one object (:func:`current`).

==========================  ===========================================================================================
``LM_ZOO_KERNELS=plain``    the reference path of plain autograd ops everywhere (:mod:`zoo.kernels`); default: fast
``LM_ZOO_CPP=0``            the Mogrifier's Python window loops instead of building the C++ ones (:mod:`zoo.native`)
``LM_ZOO_WINDOW_GRAPHS=0``  no CUDA graphs for training windows (:mod:`zoo.window`) or sampling (:mod:`zoo.sampling`)
``LM_ZOO_TRAINING_STEP``    who runs a training step (:mod:`lightning_modules.training_step`): ``graph`` (the default:
                            lm-zoo, captured as one CUDA graph on a GPU), ``direct`` (lm-zoo, never captured) or
                            ``lightning`` (Lightning's closure, the reference path)
``LM_ZOO_PROGRESS_SECONDS`` seconds between two progress lines where stderr is no terminal (default 30)
``LM_ZOO_MALLOC=default``   glibc's own malloc settings instead of lm-zoo's (:mod:`zoo.allocator`)
==========================  ===========================================================================================

Code on hot paths (a window of a recurrent stack) reads a field of :func:`current`, never the environment. A program
that wants other settings than its environment's says so with :func:`use`, or for a while with :func:`overridden`
(the tests hold the fast paths equal to the plain one this way).

One more process-wide switch is torch's own: the precision of float32 matrix products (:func:`set_matmul_precision`),
which ``lm-zoo fit`` and ``lm-zoo evaluate`` take as an option and record with their results, since it changes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

DEFAULT_PROGRESS_SECONDS = 30.0
TrainingStepPath = Literal["graph", "direct", "lightning"]
_OFF = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Settings:
    """lm-zoo's process-wide switches.

    Attributes:
        plain_kernels: run the reference path (plain autograd ops: no oneDNN private op, no C++ extension, no fused
            ``nn.LSTM``/``nn.GRU``) instead of the fast paths.
        cpp_kernels: build and use the C++ window loops of the Mogrifier (else its Python twins).
        window_graphs: capture each training window of a per-step stack on CUDA as a CUDA graph (:mod:`zoo.window`),
            and ``generate``'s token step (:mod:`zoo.sampling`).
        training_step: who runs a training step: ``graph``, ``direct`` or ``lightning``
            (:mod:`lightning_modules.training_step`; ``plain_kernels`` implies ``lightning``).
        progress_seconds: seconds between two progress lines where stderr is not a terminal.
        tune_malloc: apply lm-zoo's malloc settings at start-up (``lm-zoo`` only).
    """

    plain_kernels: bool = False
    cpp_kernels: bool = True
    window_graphs: bool = True
    training_step: TrainingStepPath = "graph"
    progress_seconds: float = DEFAULT_PROGRESS_SECONDS
    tune_malloc: bool = True


def from_environment(environ: Mapping[str, str] = os.environ) -> Settings:
    """The settings ``environ`` asks for (the table in the module doc); a value that is not a number is the default."""
    try:
        seconds = max(0.0, float(environ.get("LM_ZOO_PROGRESS_SECONDS", DEFAULT_PROGRESS_SECONDS)))
    except ValueError:
        seconds = DEFAULT_PROGRESS_SECONDS
    return Settings(
        plain_kernels=environ.get("LM_ZOO_KERNELS", "").strip().lower() == "plain",
        cpp_kernels=environ.get("LM_ZOO_CPP", "1").strip().lower() not in _OFF,
        window_graphs=environ.get("LM_ZOO_WINDOW_GRAPHS", "1").strip().lower() not in _OFF,
        training_step=_choice(environ.get("LM_ZOO_TRAINING_STEP", ""), get_args(TrainingStepPath), "graph"),
        progress_seconds=seconds,
        tune_malloc=environ.get("LM_ZOO_MALLOC", "").strip().lower() != "default",
    )


def _choice(value: str, choices: tuple[str, ...], default: str) -> Any:
    """``value`` if it names one of ``choices`` (any case), else ``default``."""
    value = value.strip().lower()
    return value if value in choices else default


_current: Settings | None = None


def current() -> Settings:
    """The settings in force: the environment's, read at the first call, unless :func:`use` set others."""
    global _current
    if _current is None:
        _current = from_environment()
    return _current


def use(settings: Settings) -> None:
    """Put ``settings`` in force for the rest of the process."""
    global _current
    _current = settings


@contextlib.contextmanager
def overridden(**changes: object) -> Iterator[Settings]:
    """Within the block, :func:`current` with ``changes`` (field names of :class:`Settings`); restored after."""
    before = current()
    use(dataclasses.replace(before, **changes))
    try:
        yield current()
    finally:
        use(before)


# ------------------------------------------------------------------------------------------ float32 matmul precision
MatmulPrecision = Literal["highest", "high", "medium"]
MATMUL_PRECISIONS: tuple[str, ...] = get_args(MatmulPrecision)
#: What lm-zoo runs at unless told otherwise: full float32, the precision of the CPU runs and the registry's figures.
DEFAULT_MATMUL_PRECISION = "highest"
MATMUL_PRECISION_HELP = (
    "precision of float32 matrix products: highest (full float32, the default: what the CPU and the registered "
    "figures use), high (TF32 on NVIDIA GPUs from Ampere on, cuDNN's fused RNNs included), medium (bfloat16 products "
    "where the hardware has them); recorded with the results"
)


def set_matmul_precision(precision: str) -> None:
    """Compute float32 matrix products at ``precision`` everywhere torch can lower it, consistently.

    ``torch.set_float32_matmul_precision`` governs cuBLAS (TF32 at ``high``) and oneDNN's CPU matmuls (TF32 at
    ``high``, bfloat16 at ``medium``, on processors that have them) but not cuDNN, whose RNNs and convolutions use
    TF32 by default whatever it says: ``highest`` alone would leave the fused ``nn.LSTM``/``nn.GRU`` layers in TF32
    while the per-step cells ran in full float32. ``torch.backends.cudnn.allow_tf32`` follows the same choice (cuDNN
    has no bfloat16 mode for float32 inputs, so ``medium`` is TF32 there). That legacy flag is the one torch 2.6
    (lm-zoo's oldest) has too; it sets cuDNN's RNN and convolution flags together, which keeps torch's newer
    per-operator API readable (it refuses to report a mixture).

    Args:
        precision: ``highest``, ``high`` or ``medium`` (:data:`MATMUL_PRECISIONS`).

    Raises:
        ValueError: another name.
    """
    import torch  # deferred: this module is read at start-up, before anything needs torch

    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision {precision!r}: use one of {', '.join(MATMUL_PRECISIONS)}")
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = precision != "highest"


@contextlib.contextmanager
def matmul_precision_in_force(precision: str) -> Iterator[None]:
    """Within the block, :func:`set_matmul_precision` ``(precision)``; torch's previous flags restored after."""
    import torch

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    set_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
