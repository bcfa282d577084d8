"""zoo.allocator: lm-zoo's glibc malloc settings take effect, and yield to the user's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zoo.allocator import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt is not this process's C library")

# A fresh interpreter (glibc's dynamic mmap threshold is process state): how many bytes one malloc of argv[2] MB adds to
# the mmapped blocks (mallinfo2's hblkhd), after calling keep_freed_memory or not, and what it returned.
PROBE = """
import ctypes, json, sys
from zoo.allocator import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
applied = keep_freed_memory() if sys.argv[1] == "apply" else None
before = libc.mallinfo2().hblkhd
block = libc.malloc(int(sys.argv[2]) * 2**20)
grown = libc.mallinfo2().hblkhd - before
libc.free(ctypes.c_void_p(block))
print(json.dumps({"applied": applied, "mmapped": grown}))
"""


def probe(mode: str, megabytes: int = 16, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "LM_ZOO_MALLOC", "GLIBC_TUNABLES"))}
    command = [sys.executable, "-c", PROBE, mode, str(megabytes)]
    done = subprocess.run(command, env={**clean, **env}, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize("megabytes", [16, 100])
def test_a_block_comes_from_the_heap_once_applied(megabytes: int):
    """16 MB: above glibc's first mmap threshold; 100 MB (a WikiText-2 model's logits at batch 20 x 35 are 93 MB):
    above the most any mmap threshold can be (32 MB), so only switching mmap off keeps it on the heap."""
    mapped = {"applied": None, "mmapped": pytest.approx(megabytes * 2**20, rel=0.01)}  # glibc's default
    assert probe("leave", megabytes) == mapped
    assert probe("apply", megabytes) == {"applied": True, "mmapped": 0}


@pytest.mark.parametrize(
    "env",
    [
        {"LM_ZOO_MALLOC": "default"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
)
def test_the_users_own_settings_win(env):
    result = probe("apply", **env)
    assert result["applied"] is False
    assert result["mmapped"] >= 16 * 2**20


def test_the_cli_applies_it(monkeypatch, capsys):
    import cli

    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(True))
    assert cli.main(["models"]) == 0
    assert calls == [True]
