"""The zoo's C++ kernels (``zoo/csrc``), compiled on first use with :func:`torch.utils.cpp_extension.load`.

They are optional: each has a Python twin that computes the same thing with the same ATen ops (the tests hold the
two equal), and where the extension cannot be built (no C++ compiler, say) the Python twin runs, after one warning
that names the reason. ``LM_ZOO_CPP=0`` skips the build.

The build takes some 20 s and is cached by PyTorch (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), keyed by the source, so it happens once per machine and source version. It is
compiled for the machine it runs on; no binary ships with the package, so there is nothing to match to a PyTorch
build.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zoo import settings
from zoo.errors import clip

#: The extension's name (its cache folder) and sources.
NAME = "lm_zoo_kernels"
SOURCES = [Path(__file__).parent / "csrc" / "mogrifier_window.cpp"]


def disabled() -> bool:
    """Whether the Python kernels are asked for (``LM_ZOO_CPP=0``, :mod:`zoo.settings`)."""
    return not settings.current().cpp_kernels


@functools.cache
def ops() -> Any | None:
    """``torch.ops.lm_zoo`` with the C++ kernels registered, or ``None`` when they cannot be had (see module doc)."""
    if disabled():
        return None
    try:
        from torch.utils import cpp_extension

        # A build is silent and takes a while; a cached one loads in a moment. Said once per process, as downloads are.
        print("lm-zoo: loading the C++ kernels (zoo/csrc; built on first use, about 20 s)", file=sys.stderr, flush=True)
        with _ninja_on_path():
            cpp_extension.load(
                name=NAME,
                sources=[str(path) for path in SOURCES],
                extra_cflags=["-O2"],
                is_python_module=False,
                verbose=False,
            )
        return torch.ops.lm_zoo
    except Exception as error:  # noqa: BLE001 - any failure to build means the Python twin runs, which is correct
        reason = _one_line(error)
        warnings.warn(
            f"lm-zoo: the C++ kernels could not be built ({reason}); the Mogrifier runs its Python loop instead, "
            "5-16% slower at batch 20 (2 x 650). Install a C++ compiler (g++) to build them, or set "
            "LM_ZOO_CPP=0 to skip the attempt.",
            stacklevel=2,
        )
        return None


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """PyTorch's builder calls ``ninja`` by name. The ``ninja`` wheel installs it beside this interpreter, which is
    not on ``PATH`` when the virtual environment's Python is run without activating it: for the build only (the
    builder reads ``os.environ``; it takes no environment of its own), ``PATH`` gains that directory."""
    before = os.environ.get("PATH")
    if shutil.which("ninja") is None:
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + (before or "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _one_line(error: Exception) -> str:
    """The gist of a build error: its first line up to the compiler command, and the compiler's first error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    gist = lines[0].split(": [", 1)[0]  # "Error building extension 'x': [1/2] c++ ..." -> the part before the command
    first_error = next((line for line in lines[1:] if "error" in line.lower()), None)
    return gist if first_error is None else f"{gist}: {clip(first_error)}"
