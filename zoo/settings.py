"""The process's switches, read from the environment once, into one object (:func:`current`).

==========================  ===========================================================================================
``LM_ZOO_KERNELS=plain``    the reference path of plain autograd ops everywhere (:mod:`zoo.kernels`); default: fast
``LM_ZOO_CPP=0``            the Mogrifier's Python window loops instead of building the C++ ones (:mod:`zoo.native`)
``LM_ZOO_PROGRESS_SECONDS`` seconds between two progress lines where stderr is no terminal (default 30)
``LM_ZOO_MALLOC=default``   glibc's own malloc settings instead of lm-zoo's (:mod:`zoo.allocator`)
==========================  ===========================================================================================

Code on hot paths (a window of a recurrent stack) reads a field of :func:`current`, never the environment. A program
that wants other settings than its environment's says so with :func:`use`, or for a while with :func:`overridden`
(the tests hold the fast paths equal to the plain one this way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

DEFAULT_PROGRESS_SECONDS = 30.0
_OFF = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Settings:
    """lm-zoo's process-wide switches.

    Attributes:
        plain_kernels: run the reference path (plain autograd ops: no oneDNN private op, no C++ extension, no fused
            ``nn.LSTM``/``nn.GRU``) instead of the fast paths.
        cpp_kernels: build and use the C++ window loops of the Mogrifier (else its Python twins).
        progress_seconds: seconds between two progress lines where stderr is not a terminal.
        tune_malloc: apply lm-zoo's malloc settings at start-up (``lm-zoo`` only).
    """

    plain_kernels: bool = False
    cpp_kernels: bool = True
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
        progress_seconds=seconds,
        tune_malloc=environ.get("LM_ZOO_MALLOC", "").strip().lower() != "default",
    )


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
