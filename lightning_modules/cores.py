"""How many CPU threads a fit's torch operations use: the process's own choice, and fewer while other work keeps the
machine's cores busy.

Why: torch's CPU operations run on an OpenMP thread pool whose threads spin while they wait for one another. Two fits
on the same two cores, each with two threads, each took over a hundred times longer a step than alone (``make demo``:
51 batches/s alone, 0.38-0.4 each side by side; a plain PyTorch loop did the same): a thread spun out its whole time
slice waiting for one the other process held. With one thread each, the pair ran at 63-64 steps/s each. So a fit
counts the cores other processes keep busy, at its start and every :data:`CHECK_SECONDS` of training, and runs on the
cores left, at least one; when the other work ends it goes back to its own count.

A user's ``OMP_NUM_THREADS`` is a choice kept as it is: the count then never changes, which a resume that must be bit
for bit needs (the number of threads can change the order of a float sum). Linux only (``/proc/stat``); elsewhere the
count stays the process's.
"""

from __future__ import annotations

import math
import os
import time

import torch

#: Seconds of training between two looks at what else keeps the cores busy.
CHECK_SECONDS = 5.0
#: How long the look at the start of a fit takes.
START_SAMPLE_SECONDS = 0.25
#: Other processes' use of the cores counted as one busy core from this share of a core on.
BUSY_SHARE = 0.5


def cpu_seconds() -> tuple[float, float] | None:
    """``(every core's busy seconds since boot, this process's own CPU seconds)``, or ``None`` without ``/proc``."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = os.times()  # every thread of this process
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own.user + own.system


class CoreSharing:
    """The thread count of one fit's process, following what other processes keep busy (see the module doc).

    Args:
        cores: the cores this process may run on (default: its affinity).
        threads: its own count, used when nothing else runs (default: torch's now).
        fixed: keep the count whatever runs beside (default: when ``OMP_NUM_THREADS`` is set).
    """

    def __init__(self, cores: int | None = None, threads: int | None = None, fixed: bool | None = None) -> None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.cores = cores or affinity
        self.own = threads or torch.get_num_threads()
        # One thread has nothing to give up; OMP_NUM_THREADS is the user's choice.
        self.fixed = ("OMP_NUM_THREADS" in os.environ or self.own == 1) if fixed is None else fixed
        self.others = 0.0  # cores the other processes kept busy over the last look
        self._last: tuple[float, float, float] | None = None  # (busy, own, monotonic time) at the last look

    def start(self) -> str:
        """Look for a moment, set the count, and say it in words for the start-up line."""
        if not self.fixed:
            self._look()  # the first reading
            if self._last is not None:  # there is a /proc to read
                time.sleep(START_SAMPLE_SECONDS)
                self._apply(self._look())
        return self.describe()

    def check(self) -> str | None:
        """At most every :data:`CHECK_SECONDS`: look again and change the count if the other work changed; a line
        saying so when it did, else ``None``."""
        if self.fixed or self._last is None or time.monotonic() - self._last[2] < CHECK_SECONDS:
            return None
        before = torch.get_num_threads()
        self._apply(self._look())
        return None if torch.get_num_threads() == before else self.describe()

    def restore(self) -> None:
        """Give the process its own count back (the fit is over)."""
        if torch.get_num_threads() != self.own:
            torch.set_num_threads(self.own)

    def describe(self) -> str:
        """The count in words, with why it is lower than the process's own where it is."""
        threads = torch.get_num_threads()
        line = f"{threads} CPU thread{'s' * (threads != 1)}"
        if self.fixed:
            return line + (" (OMP_NUM_THREADS)" if "OMP_NUM_THREADS" in os.environ else "")
        busy = _busy_cores(self.others)
        return line + (f" (other processes keep {busy} of {self.cores} cores busy)" if busy else "")

    def threads_for(self, others: float) -> int:
        """The count while other processes keep ``others`` cores' worth busy: the cores left, at least one, at most
        this process's own count."""
        return max(1, min(self.own, self.cores - _busy_cores(others)))

    def _look(self) -> float | None:
        """Cores' worth the other processes kept busy since the last look (``None``: the first look, or no /proc)."""
        now = cpu_seconds()
        if now is None:
            return None
        at = time.monotonic()
        last, self._last = self._last, (*now, at)
        if last is None or at <= last[2]:
            return None
        others = ((now[0] - last[0]) - (now[1] - last[1])) / (at - last[2])
        return max(0.0, others)

    def _apply(self, others: float | None) -> None:
        if others is None:
            return
        self.others = others
        threads = self.threads_for(others)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


def _busy_cores(others: float) -> int:
    """Other processes' use, in whole busy cores (a core counts from :data:`BUSY_SHARE` of it)."""
    return math.floor(others + 1 - BUSY_SHARE)
