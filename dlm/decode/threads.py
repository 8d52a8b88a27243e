"""How many threads a CPU decode uses when other processes share the machine.

Each decode forward is a few hundred short parallel regions (one per kernel call). When another process keeps a
core busy, every region waits for the operating system to give the second thread a time slice: measured on a
2-core AMD EPYC (AVX2) with one busy background process, 2 threads made a SmolLM2-135M step 4.6x slower (84 ms vs
18 ms quiet), 1 thread only 1.4x (25 ms) - and transformers' ``generate`` and llama.cpp suffer the same way. So
with ``threads="auto"`` (the commands' default, ``--threads auto``) the engine uses the cores that other processes
leave idle: it counts the runnable tasks of other processes (``/proc/loadavg``'s running count, minus this
process's own running threads, the median of a few samples) when it starts and every :data:`INTERVAL` seconds
while it decodes, and sets torch's thread count to ``cores - busy`` (at least 1). An integer fixes the count;
None leaves torch's setting alone. The OpenMP wait policy is left at its default: measured on the same machine,
``OMP_WAIT_POLICY=PASSIVE`` or ``ACTIVE`` made the quiet step 5-10% slower and do not help the busy case.
"""

from __future__ import annotations

import os
import time

import torch

from dlm.decode.options import parse_threads

INTERVAL = 2.0  # seconds between two looks at the machine's load while decoding
SAMPLES = 5


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _running_total() -> int | None:
    try:
        with open("/proc/loadavg") as fh:
            return int(fh.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _running_own() -> int:
    n = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as fh:
                    if fh.read().rpartition(")")[2].split()[0] == "R":
                        n += 1
            except OSError:
                continue
    except OSError:
        return 1
    return max(n, 1)


def busy_cores() -> int | None:
    """How many cores other processes keep busy right now (None where this cannot be read: not Linux)."""
    seen = []
    for i in range(SAMPLES):
        total = _running_total()
        if total is None:
            return None
        seen.append(max(total - _running_own(), 0))
        if i + 1 < SAMPLES:
            time.sleep(0.002)
    return sorted(seen)[len(seen) // 2]


def auto_threads() -> int:
    n = cores()
    busy = busy_cores()
    return n if busy is None else max(1, min(n, n - busy))


class ThreadPolicy:
    """Sets torch's thread count for an engine (see the module doc) in the thread that runs its forwards, on its
    first :meth:`tick` (not when built: a server builds its engine in one thread and steps it in another, and the
    builder's own count is left alone); :meth:`restore` puts the caller's back."""

    def __init__(self, threads):
        self.mode = parse_threads(threads)
        self._saved = torch.get_num_threads()
        self._next = 0.0
        self.current = self._saved

    def _set(self, n: int) -> None:
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.current = n

    def tick(self) -> None:
        """Look at the load again if it is time (auto mode); cheap otherwise. Called from the thread that runs the
        forwards (torch's thread count is per thread under OpenMP)."""
        if isinstance(self.mode, int):
            if torch.get_num_threads() != self.mode:
                self._set(self.mode)
            return
        if self.mode != "auto":
            return
        now = time.monotonic()
        if now >= self._next:
            self._next = now + INTERVAL
            self._set(auto_threads())

    def restore(self) -> None:
        if self.mode is not None and torch.get_num_threads() != self._saved:
            torch.set_num_threads(self._saved)
        self.mode = None
