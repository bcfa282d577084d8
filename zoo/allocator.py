"""glibc ``malloc`` settings for training recurrent models on a CPU, applied by ``lm-zoo`` at start-up.

A training step of a recurrent model allocates and frees the same few hundred tensors of 0.1-100 MB at every step
(gates, states, per-step gradients, a word model's (B, T, V) logits). glibc serves every block above its mmap threshold
(128 kB at first, raised dynamically up to 32 MB, never past that) with a fresh ``mmap`` and gives the pages back at
``free``, and it returns the top of the heap to the system above its trim threshold; either way the next step touches
new pages and pays a page fault per 4 kB. Measured on this project's 2-core CPU with the 2 x 200 PTB LSTM:
32-34 million minor faults and 60-65 s of system time per epoch, and 20-25% more tokens/s for both ``lm-zoo fit`` and
pytorch/examples' loop with ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824`` in the environment.
A block above 32 MB still went to ``mmap`` under those settings: the full softmax of a 33,278-word WikiText-2 model at
batch 20 x 35 allocates 93 MB logits and their gradients every step, and the page faults took a third of its ``lm-zoo
fit`` (``benchmarks/allocator.py``, rendered in docs/results.md). So no block is served by ``mmap`` at all
(``M_MMAP_MAX`` 0): every one comes from the heap and its pages are reused by the next step.

:func:`keep_freed_memory` sets ``M_MMAP_MAX`` and the trim threshold with ``mallopt`` from inside the process, so that
users get the speed without knowing the variables. The cost is that up to 1 GB of freed heap stays with the process
instead of going back to the system (its peak RSS is what it is either way). Users who set their own ``MALLOC_*``
variables or glibc tunables keep them, ``LM_ZOO_MALLOC=default`` keeps glibc's defaults, and other C libraries (macOS,
musl) are left alone. jemalloc or tcmalloc through ``LD_PRELOAD`` would serve too, but need a system package; glibc is
already there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from zoo import settings

# mallopt's parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4  # how many blocks glibc may serve by mmap at once; 0: none

TRIM_THRESHOLD_BYTES = 2**30

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (the one with ``mallopt`` and these parameters), else ``None``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it; AttributeError otherwise)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Serve every block from the heap (none by ``mmap``) and keep up to 1 GB of freed heap, so that a training step
    reuses the pages of the step before instead of faulting in new ones.

    Returns:
        Whether the settings were applied: ``False`` under another C library, with ``LM_ZOO_MALLOC=default``, or when
        the environment already sets glibc's malloc variables or tunables (the user's choice wins).
    """
    if not settings.current().tune_malloc:
        return False
    if any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success. Without mmap the mmap threshold (and glibc's dynamic raising of it) is moot.
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
